"""An adapter directory as `mlx_lm.lora` writes it, read and checked against a model.

What: `read(name, path, model)` loads `adapter_config.json` and
`adapters.safetensors` and returns an `AdapterWeights`: for every layer the
adapter targets, its `lora_a` [in, rank] and `lora_b` [rank, out], and the
config's `scale`. The targets are the ones `mlx_lm.tuner.utils.linear_to_lora_layers`
picks: `lora_parameters.keys` (module names inside a block, e.g.
`self_attn.q_proj`) in the last `num_layers` blocks (`model.layers[-max(n, 0):]`,
so 0 and -1 mean all), or every linear layer of those blocks without keys.
Invariants: nothing is kept unless everything checks out; every refusal is a
`WorkerError` naming the file, key or tensor (NotFound for a missing path,
InvalidArgument for the rest); only `fine_tune_type` "lora" on linear layers
(plain, quantized, or one the engine's rewrites wrapped) is served.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn

from mlx_worker_svc.core.errors import InvalidArgument, NotFound
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.engine.rewrite import fused

CONFIG, WEIGHTS = "adapter_config.json", "adapters.safetensors"
MAX_NAME = 128  # an adapter name: 1 to 128 printable characters, no whitespace


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's matrices by the module path they apply to (`model.layers.0.mlp.up_proj`)."""

    name: str
    path: str
    rank: int
    scale: float
    a: dict[str, mx.array]  # [in, rank]
    b: dict[str, mx.array]  # [rank, out]

    @property
    def nbytes(self) -> int:
        return sum(int(x.nbytes) for x in (*self.a.values(), *self.b.values()))


def check_name(name: str, where: str) -> str:
    """An adapter name: 1 to MAX_NAME characters, printable, no whitespace."""
    if not name:
        raise InvalidArgument(f"{where} is required: the adapter's name")
    if len(name) > MAX_NAME or not name.isprintable() or any(c.isspace() for c in name):
        raise InvalidArgument(
            f"{where} {clip(name)!r} is not a usable adapter name: 1 to {MAX_NAME} printable "
            "characters without whitespace"
        )
    return name


def linear_dims(layer: Any) -> tuple[int, int] | None:
    """(in, out) of a linear layer the engine serves adapters on; None for anything else."""
    if isinstance(layer, fused.FusedProjection):
        layer = layer.inner
    inner = getattr(layer, "linear", None)  # mlx-lm's LoRALinear (LoadModel.adapter_path)
    if inner is not None and hasattr(layer, "lora_a"):
        layer = inner
    if isinstance(layer, nn.QuantizedLinear):
        out, packed = layer["weight"].shape
        return packed * 32 // layer.bits, out
    if isinstance(layer, nn.Linear):
        out, inputs = layer["weight"].shape
        return inputs, out
    return None


def _targets(model: nn.Module, config: dict[str, Any], shown: str) -> dict[str, tuple[int, int]]:
    """Module path -> (in, out) of every layer the adapter applies to, as mlx-lm picks them."""
    blocks = getattr(model, "layers", None)
    if not blocks:
        raise InvalidArgument(f"AddLora: the model has no transformer blocks for adapter {shown}")
    names = {id(m): n for n, m in model.named_modules()}
    params = config.get("lora_parameters") or {}
    keys = params.get("keys")
    num_layers = config.get("num_layers", len(blocks))
    if not isinstance(num_layers, int):
        raise InvalidArgument(
            f"AddLora: {CONFIG} num_layers must be an integer, got {num_layers!r}"
        )
    chosen = blocks[-max(num_layers, 0) :]
    found: dict[str, tuple[int, int]] = {}
    for block in chosen:
        prefix = names[id(block)]
        inside = dict(block.named_modules())
        wanted = keys if keys is not None else _linear_keys(inside)
        if not isinstance(wanted, list | tuple) or not all(isinstance(k, str) for k in wanted):
            raise InvalidArgument(f"AddLora: {CONFIG} lora_parameters.keys must be a list of names")
        for key in wanted:
            layer = inside.get(key)
            if layer is None:
                continue  # as mlx-lm: keys name modules that some blocks have
            dims = linear_dims(layer)
            if dims is None:
                raise InvalidArgument(
                    f"AddLora: adapter {shown} targets {prefix}.{key}, a "
                    f"{type(layer).__name__}: only linear layers take adapters here"
                )
            found[f"{prefix}.{key}"] = dims
    if not found:
        raise InvalidArgument(
            f"AddLora: adapter {shown} targets no linear layer of the model "
            f"(lora_parameters.keys {keys!r}, num_layers {num_layers})"
        )
    return found


def _linear_keys(inside: dict[str, Any]) -> list[str]:
    """Every linear layer of a block (mlx-lm's default keys); a wrapped layer counts once."""
    keys = [k for k, m in inside.items() if k and linear_dims(m) is not None]
    return [k for k in keys if not any(k.startswith(f"{o}.") for o in keys if o != k)]


def _config(path: Path, shown: str) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"AddLora: {CONFIG} of {shown} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise InvalidArgument(f"AddLora: {CONFIG} of {shown} must hold a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise InvalidArgument(
            f"AddLora: {CONFIG} of {shown} fine_tune_type is {kind!r}; only 'lora' adapters are "
            "served (DoRA and full fine-tunes are not)"
        )
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise InvalidArgument(f"AddLora: {CONFIG} of {shown} has no lora_parameters object")
    if "scale" not in params:
        hint = " (it has 'alpha': mlx-lm's config uses 'scale')" if "alpha" in params else ""
        raise InvalidArgument(f"AddLora: {CONFIG} of {shown} lora_parameters lacks 'scale'{hint}")
    rank, scale = params.get("rank"), params["scale"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidArgument(f"AddLora: {CONFIG} of {shown} lora_parameters.rank must be >= 1")
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not math.isfinite(scale):
        raise InvalidArgument(
            f"AddLora: {CONFIG} of {shown} lora_parameters.scale must be a number"
        )
    return config


def _directory(path_text: str, shown: str) -> Path:
    if not path_text:
        raise InvalidArgument("AddLora.path is required: the adapter directory, on the worker")
    try:
        path = Path(path_text).expanduser()
        if not path.exists():
            raise NotFound(f"AddLora.path {shown} does not exist")
        if not path.is_dir():
            raise InvalidArgument(f"AddLora.path {shown} is a file; give the adapter directory")
        missing = [n for n in (CONFIG, WEIGHTS) if not (path / n).is_file()]
    except OSError as exc:
        raise InvalidArgument(f"AddLora.path {shown} is not a usable path: {exc}") from exc
    if missing:
        raise InvalidArgument(
            f"AddLora.path {shown} has no {' or '.join(missing)}: not an mlx-lm adapter "
            "directory (mlx_lm.lora writes both)"
        )
    return path.resolve()


def read(name: str, path_text: str, model: nn.Module) -> AdapterWeights:
    """Reads and checks one adapter directory against `model` (raises; keeps nothing)."""
    shown = repr(clip(path_text))
    path = _directory(path_text, shown)
    config = _config(path, shown)
    rank = int(config["lora_parameters"]["rank"])
    targets = _targets(model, config, shown)
    try:
        tensors = mx.load(str(path / WEIGHTS))
    except (OSError, ValueError, RuntimeError) as exc:
        raise InvalidArgument(f"AddLora: {WEIGHTS} of {shown} is not readable: {exc}") from exc
    assert isinstance(tensors, dict)
    expected = {f"{t}.{leaf}" for t in targets for leaf in ("lora_a", "lora_b")}
    extra = sorted(set(tensors) - expected)
    missing = sorted(expected - set(tensors))
    if extra or missing:
        what = [f"{clip(n)} is not an adapter matrix of a targeted layer" for n in extra[:3]]
        what += [f"{n} is missing" for n in missing[:3]]
        raise InvalidArgument(
            f"AddLora: {WEIGHTS} of {shown} does not match the model and {CONFIG} "
            f"(target modules, num_layers): {'; '.join(what)}"
        )
    a: dict[str, mx.array] = {}
    b: dict[str, mx.array] = {}
    for target, (inputs, out) in targets.items():
        la, lb = tensors[f"{target}.lora_a"], tensors[f"{target}.lora_b"]
        for leaf, got, want in (("lora_a", la, (inputs, rank)), ("lora_b", lb, (rank, out))):
            if tuple(got.shape) != want:
                raise InvalidArgument(
                    f"AddLora: {WEIGHTS} of {shown} {target}.{leaf} has shape {tuple(got.shape)}; "
                    f"the model's layer and the rank ({rank}) need {want}"
                )
            if not mx.issubdtype(got.dtype, mx.floating):
                raise InvalidArgument(f"AddLora: {target}.{leaf} is {got.dtype}, not floating")
        a[target], b[target] = la, lb
    mx.eval(list(a.values()), list(b.values()))
    scale = float(config["lora_parameters"]["scale"])
    return AdapterWeights(name, str(path), rank, scale, a, b)
