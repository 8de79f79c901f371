"""Loading a model through `mlx_lm.load` and describing what was loaded.

Owns the mapping from "what the caller asked for" (a local directory or a hub
id) to a loaded model and tokenizer, the errors a bad path or a broken model
directory turns into, and the model facts the worker reports (sizes, heads,
context length, EOS ids, quantization, weight bytes). In a worker group each
rank loads lazily and keeps only its shard (sharding.py) before the weights
are read.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_worker_svc.core.errors import InvalidArgument, NotFound, Unavailable, WorkerError
from mlx_worker_svc.core.limits import declared_context
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.core.reports import LoadSpec, ModelInfo, Parallelism, Quantization
from mlx_worker_svc.engine.lora.registry import AdapterSet
from mlx_worker_svc.engine.model import sharding

log = logging.getLogger(__name__)
# A model without a declared context length gets this one.
DEFAULT_CONTEXT_LENGTH = 4096
# What mlx-lm's load_adapters reads from an adapter directory.
ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    info: ModelInfo
    load_seconds: float
    # Its resident LoRA adapters (AddLora), beside the weights.
    adapters: AdapterSet = field(init=False)

    def __post_init__(self) -> None:
        self.adapters = AdapterSet(self.model)


def local_path(model: str) -> str:
    """A model given as a path, made absolute (`~` expanded; symlinks kept, so the
    directory's name stays the one given); anything else (a hub id) as it is."""
    try:
        path = Path(model).expanduser()
        return os.path.abspath(path) if path.exists() else model
    except (OSError, RuntimeError):  # name too long, unknown ~user: no local path
        return model


def same_load(spec: LoadSpec, held: LoadSpec | None) -> bool:
    """Whether `spec` asks for the model held: the same arguments once `canonical`."""
    return held is not None and (spec == held or canonical(spec) == canonical(held))


def canonical(spec: LoadSpec) -> LoadSpec:
    """`spec` with its defaults filled in: a local path written one way ("m", "./m/"
    and its absolute path are one) and, for a local directory, no revision (it has
    none to read) and max_model_len 0 when it does not cap the model's own context."""
    model = local_path(spec.model)
    if not (os.path.isabs(model) and os.path.exists(model)):
        return replace(spec, model=model)
    cap = spec.max_model_len
    if cap and cap >= (declared_context(model) or DEFAULT_CONTEXT_LENGTH):  # as _info reads it
        cap = 0
    return replace(spec, model=model, revision="", max_model_len=cap)


def _resolve(spec: LoadSpec) -> str:
    try:
        return _resolve_path(spec)
    except (OSError, RuntimeError) as exc:  # name too long, unknown ~user, ...
        raise InvalidArgument(f"model {clip(spec.model)!r} is not a usable path: {exc}") from exc


def _resolve_path(spec: LoadSpec) -> str:
    if not spec.model:
        raise InvalidArgument("LoadModel.model is required: a local model directory or a hub id")
    path = Path(spec.model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InvalidArgument(f"model {clip(spec.model)!r} is a file; give a model directory")
        if not (path / "config.json").is_file():
            raise InvalidArgument(
                f"model directory {clip(spec.model)!r} has no config.json: not an MLX/HF model"
            )
        return local_path(spec.model)
    if _HUB_ID.match(spec.model) is None:
        raise NotFound(f"model path {clip(spec.model)!r} does not exist")
    return spec.model


def _check_adapter(adapter_path: str) -> None:
    """Refuses an adapter_path that is not an mlx-lm adapter directory."""
    shown = clip(adapter_path)
    try:
        path = Path(adapter_path).expanduser()
        if not path.exists():
            raise NotFound(f"LoadModel.adapter_path {shown!r} does not exist")
        if not path.is_dir():
            raise InvalidArgument(
                f"LoadModel.adapter_path {shown!r} is a file; give the adapter directory "
                f"(holding {ADAPTER_FILES[0]} and {ADAPTER_FILES[1]})"
            )
        missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    except (OSError, RuntimeError) as exc:  # RuntimeError: "~user" with no such home
        raise InvalidArgument(f"LoadModel.adapter_path is not a usable path: {exc}") from exc
    if missing:
        raise InvalidArgument(
            f"LoadModel.adapter_path {shown!r} has no {' or '.join(missing)}: not an mlx-lm "
            "adapter directory (mlx_lm.lora writes both)"
        )


def load(spec: LoadSpec, group: Any = None) -> LoadedModel:
    """Loads `spec` with mlx_lm.load; raises NotFound/InvalidArgument/Unavailable.

    With an `mx.distributed` group of more than one rank, loads this rank's shard.
    """
    from mlx_lm import load as mlx_load

    source = _resolve(spec)
    if spec.adapter_path:
        _check_adapter(spec.adapter_path)
    start = time.perf_counter()
    sharded = group is not None and group.size() > 1
    parallelism = Parallelism.NONE
    try:
        model, tokenizer, config = mlx_load(
            source,
            adapter_path=spec.adapter_path or None,
            lazy=sharded,
            revision=spec.revision or None,
            trust_remote_code=spec.trust_remote_code,
            return_config=True,
        )
        if spec.adapter_path and not _adapted(model):
            raise InvalidArgument(
                f"LoadModel.adapter_path {clip(spec.adapter_path)!r} targets no layer of the "
                "model (its lora_parameters.keys name none of the model's linear layers): "
                "it would change nothing"
            )
        if sharded:
            parallelism = sharding.shard(model, group)
            mx.eval(model.parameters())  # reads this rank's share of the weights only
    except WorkerError:
        raise
    except Exception as exc:
        raise _load_error(spec, exc) from exc
    seconds = time.perf_counter() - start
    info = describe(spec, source, model, tokenizer, config, parallelism=parallelism)
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, load_seconds=seconds)


def _adapted(model: nn.Module) -> bool:
    """Whether mlx-lm's adapter loading put a LoRA (or DoRA) layer into the model."""
    return any(type(m).__module__.startswith("mlx_lm.tuner") for _, m in model.named_modules())


# The hub client's errors for a connection that failed (httpx's, requests'), by name:
# neither library is imported here.
_NETWORK_ERRORS = frozenset(
    {"ConnectError", "ConnectionError", "ConnectTimeout", "NetworkError", "TimeoutException"}
)
# huggingface_hub's word for a file it could not fetch and has no copy of (no network,
# or HF_HUB_OFFLINE): a FileNotFoundError, wrapping the connection error when there is one.
_NOT_FETCHED = frozenset({"LocalEntryNotFoundError", "OfflineModeIsEnabled"})


def _kinds(exc: BaseException) -> set[str]:
    """The class names of `exc`, and of the errors it was raised from or during."""
    names: set[str] = set()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names |= {kind.__name__ for kind in type(current).__mro__}
        current = current.__cause__ or current.__context__
    return names


def _load_error(spec: LoadSpec, exc: Exception) -> WorkerError:
    """What a failed `mlx_lm.load` means to the caller: a network failure fetching a
    hub id is UNAVAILABLE (not the caller's mistake), an unknown repository NOT_FOUND,
    anything else about the files INVALID_ARGUMENT (naming adapter_path when given)."""
    names = _kinds(exc)
    what = f"model {clip(spec.model)!r}"
    if spec.adapter_path:
        what += f" with LoadModel.adapter_path {clip(spec.adapter_path)!r}"
    if names & (_NETWORK_ERRORS | _NOT_FETCHED):
        return Unavailable(
            f"{what} could not be fetched (no connection to the model hub?): {exc}; "
            "retry, or give a local model directory"
        )
    if isinstance(exc, FileNotFoundError):  # a file of the model directory
        return InvalidArgument(f"{what} could not be loaded: {exc}")
    # RepositoryNotFound and its kind; not an architecture mlx-lm has no module for (its
    # "Model type X not supported." chains a ModuleNotFoundError): the files are there.
    if any("NotFound" in name for name in names - {"FileNotFoundError", "ModuleNotFoundError"}):
        return NotFound(f"{what} was not found: {exc}")
    if isinstance(exc, OSError):
        return Unavailable(f"{what} could not be fetched: {exc}")
    return InvalidArgument(f"{what} could not be loaded: {exc}")


def _dominant_float_dtype(params: list[tuple[str, mx.array]]) -> str:
    counts: dict[str, int] = {}
    for _, value in params:
        if mx.issubdtype(value.dtype, mx.floating):
            key = str(value.dtype).removeprefix("mlx.core.")
            counts[key] = counts.get(key, 0) + value.size
    return max(counts, key=lambda k: counts[k]) if counts else "unknown"


def loaded_quantization(model: nn.Module) -> Quantization:
    """The quantization of most of the model's quantized weights, as loaded.

    Read from the layers themselves (their bits, group size and mode), not from
    config.json; models mix them (an 8-bit embedding beside 4-bit layers), and
    the one covering the most weights is reported.
    """
    counts: dict[Quantization, int] = {}
    for _, module in model.named_modules():
        bits, group_size = getattr(module, "bits", None), getattr(module, "group_size", None)
        weight = module.get("weight") if isinstance(module, nn.Module) else None
        if isinstance(bits, int) and isinstance(group_size, int) and weight is not None:
            key = Quantization(bits, group_size, str(getattr(module, "mode", "affine")))
            counts[key] = counts.get(key, 0) + int(weight.size) * 32 // bits
    return max(counts, key=lambda q: counts[q]) if counts else Quantization()


def _warn_if_config_differs(spec: LoadSpec, cfg: dict[str, Any], loaded: Quantization) -> None:
    """Logs a config.json whose top-level quantization disagrees with the weights.

    mlx-lm infers each layer's bits and group size from its packed weights, so
    such a model loads and runs correctly; the worker reports what was loaded.
    """
    declared = cfg.get("quantization")
    if not isinstance(declared, dict) or not loaded.bits:
        return
    said = (declared.get("bits"), declared.get("group_size"))
    if said != (loaded.bits, loaded.group_size):
        log.warning(
            "config.json says quantization bits %s, group size %s, but the weights loaded are "
            "%d-bit with group size %d; reporting the weights",
            *said,
            loaded.bits,
            loaded.group_size,
            extra={"model": clip(spec.model)},
        )


def describe(
    spec: LoadSpec,
    source: str,
    model: nn.Module,
    tokenizer: TokenizerWrapper,
    config: Any,
    *,
    parallelism: Parallelism = Parallelism.NONE,
) -> ModelInfo:
    """The facts a scheduler needs about a loaded model."""
    cfg: dict[str, Any] = dict(config) if isinstance(config, dict) else {}
    args = getattr(model, "args", None)

    def arg(*names: str, default: int = 0) -> int:
        for name in names:
            value = getattr(args, name, None)
            if value is None:
                value = cfg.get(name)
            if isinstance(value, int) and value > 0:
                return value
        return default

    layers = getattr(model, "layers", None)
    num_layers = len(layers) if layers is not None else arg("num_hidden_layers")
    if parallelism is Parallelism.PIPELINE:  # `layers` are this rank's stage only
        num_layers = arg("num_hidden_layers", default=num_layers)
    hidden = arg("hidden_size", "d_model", "dim")
    heads = arg("num_attention_heads", "n_heads")
    kv_heads = arg("num_key_value_heads", "n_kv_heads", default=heads)
    head_dim = arg("head_dim", default=hidden // heads if heads else 0)
    context = arg("max_position_embeddings", "max_seq_len", default=DEFAULT_CONTEXT_LENGTH)
    if spec.max_model_len:
        context = min(context, spec.max_model_len)
    quantization = loaded_quantization(model)
    _warn_if_config_differs(spec, cfg, quantization)
    params = tree_flatten(model.parameters())
    weight_bytes = sum(int(v.nbytes) for _, v in params)
    eos = sorted(int(t) for t in (tokenizer.eos_token_ids or []))
    bos = tokenizer.bos_token_id
    vocab = arg("vocab_size", default=len(tokenizer.vocab))
    return ModelInfo(
        model=spec.model,
        model_path=source,
        model_type=str(cfg.get("model_type", getattr(args, "model_type", "unknown"))),
        vocab_size=vocab,
        num_layers=num_layers,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        max_context_length=context,
        eos_token_ids=tuple(eos),
        bos_token_id=int(bos) if bos is not None else -1,
        quantization=quantization,
        weight_bytes=weight_bytes,
        dtype=_dominant_float_dtype(params),
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        adapter_path=spec.adapter_path,
        parallelism=parallelism,
    )
