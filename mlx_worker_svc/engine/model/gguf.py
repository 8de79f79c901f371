"""Converting a llama-family GGUF file into an MLX model directory.

This module owns GGUF → MLX conversion: it reads the file with ``mx.load`` (which
hands back Q4_0/Q4_1/Q8_0 tensors already as MLX affine-quantized triplets),
checks that the architecture is one we can run, renames the tensors to the
``mlx_lm`` llama layout, and writes ``model.safetensors``, ``config.json``,
``generation_config.json`` and the tokenizer files (see ``gguf_tokenizer``). The
output directory is assembled beside its final location and renamed into place
at the end, so an interrupted conversion never leaves a half-written model. No
weights are re-quantized. llama.cpp's converter permutes the Q/K rows of each
head for its interleaved RoPE; the rows are put back in the Hugging Face order
(``_hf_rows``, packed weights, scales and biases alike), with the default
RoPE, so the directory has the original checkpoint's layout and a LoRA adapter
trained on that checkpoint (q_proj/k_proj included) applies to it unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_worker_svc.core.errors import InvalidArgument, NotFound
from mlx_worker_svc.engine.model.gguf_tokenizer import write_tokenizer_files

ProgressFn = Callable[[str, float], None]

SUPPORTED_ARCHITECTURES = frozenset({"llama"})
GGUF_GROUP_SIZE = 32  # every GGUF block quantization that mx.load keeps packed
_GGUF_MAGIC = b"GGUF"

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SUFFIXES = frozenset({"weight", "scales", "biases", "bias"})


def _noop(stage: str, fraction: float) -> None:
    del stage, fraction


def _meta_value(meta: Mapping[str, Any], key: str) -> Any:
    value = meta.get(key)
    if value is not None and hasattr(value, "item"):
        if getattr(value, "ndim", 0) != 0:
            raise InvalidArgument(f"GGUF metadata {key} is an array; only scalars are supported")
        return value.item()
    return value


def _meta_int(meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = _meta_value(meta, key)
    if value is None:
        if default is None:
            raise InvalidArgument(f"GGUF metadata lacks required key {key}")
        return default
    return int(value)


def _meta_float(meta: Mapping[str, Any], key: str, default: float) -> float:
    value = _meta_value(meta, key)
    return default if value is None else float(value)


def _read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    if path.is_dir():
        raise InvalidArgument(f"{path} is a directory: give a GGUF file")
    if not path.is_file():
        raise NotFound(f"GGUF file not found: {path}")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise InvalidArgument(f"cannot read GGUF file {path}: {exc}") from exc
    if magic != _GGUF_MAGIC:
        raise InvalidArgument(f"{path} is not a GGUF file (bad magic {magic!r})")
    try:
        weights, meta = mx.load(str(path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError, OSError) as exc:
        raise InvalidArgument(
            f"cannot read GGUF file {path}: {exc} (MLX reads tensors of types F32, F16, "
            "BF16, Q4_0, Q4_1 and Q8_0)"
        ) from exc
    if not isinstance(weights, dict) or not isinstance(meta, dict):
        raise InvalidArgument(f"cannot read GGUF file {path}: unexpected content")
    return weights, meta


def _architecture(meta: Mapping[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise InvalidArgument(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    return arch


def _mlx_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if suffix not in _SUFFIXES:
        raise InvalidArgument(f"unexpected GGUF tensor {name!r}")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    if base == "rope_freqs":
        raise InvalidArgument("GGUF uses per-frequency RoPE factors (rope_freqs), not supported")
    if "_exps" in base or "_inp" in base:
        raise InvalidArgument(f"GGUF tensor {name!r} belongs to a mixture-of-experts model")
    raise InvalidArgument(f"unexpected GGUF tensor {name!r}")


def _quantization(weights: Mapping[str, mx.array]) -> dict[str, Any] | None:
    """The mlx_lm ``quantization`` entry: most common (bits, group) plus per-module overrides."""
    per_module: dict[str, tuple[int, int]] = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        module = name[: -len(".scales")]
        packed = weights[f"{module}.weight"]
        bits = packed.shape[-1] // scales.shape[-1]  # 32-bit words per group of 32 values
        if packed.dtype != mx.uint32 or bits * scales.shape[-1] != packed.shape[-1]:
            raise InvalidArgument(f"GGUF tensor {module} has an unexpected quantized layout")
        per_module[module] = (bits, GGUF_GROUP_SIZE)
    if not per_module:
        return None
    (bits, group), _ = Counter(per_module.values()).most_common(1)[0]
    quant: dict[str, Any] = {"group_size": group, "bits": bits}
    for module, (m_bits, m_group) in sorted(per_module.items()):
        if (m_bits, m_group) != (bits, group):
            quant[module] = {"group_size": m_group, "bits": m_bits}
    return quant


def _model_config(meta: Mapping[str, Any], weights: Mapping[str, mx.array]) -> dict[str, Any]:
    arch = _architecture(meta)
    if _meta_int(meta, f"{arch}.expert_count", 0) > 0:
        raise InvalidArgument("mixture-of-experts GGUF models are not supported")
    hidden = _meta_int(meta, f"{arch}.embedding_length")
    heads = _meta_int(meta, f"{arch}.attention.head_count")
    embed = weights.get("model.embed_tokens.weight")
    if embed is None:
        raise InvalidArgument("GGUF file has no token_embd tensor")
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _meta_int(meta, f"{arch}.block_count"),
        "intermediate_size": _meta_int(meta, f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta_int(meta, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _meta_int(meta, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _meta_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "vocab_size": int(embed.shape[0]),
        "max_position_embeddings": _meta_int(meta, f"{arch}.context_length", 4096),
        "rope_theta": _meta_float(meta, f"{arch}.rope.freq_base", 10000.0),
        # The Q/K rows are back in the checkpoint's order (_hf_rows): RoPE as in HF.
        "rope_traditional": False,
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": any(".self_attn." in k and k.endswith(".bias") for k in weights),
        "mlp_bias": any(".mlp." in k and k.endswith(".bias") for k in weights),
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        factor = _meta_float(meta, f"{arch}.rope.scaling.factor", 1.0)
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling not in (None, "none"):
        raise InvalidArgument(f"GGUF RoPE scaling {scaling!r} is not supported")
    missing = [
        i
        for i in range(config["num_hidden_layers"])
        if f"model.layers.{i}.self_attn.q_proj.weight" not in weights
    ]
    if missing:
        raise InvalidArgument(f"GGUF file lacks tensors for layer(s) {missing[:5]}")
    quant = _quantization(weights)
    if quant is not None:
        config["quantization"] = quant
    return config


def _hf_rows(weights: dict[str, mx.array], heads: int, kv_heads: int) -> None:
    """Undoes llama.cpp's Q/K row permutation in place: within each head it interleaved
    the two halves of the rows (for interleaved RoPE); this splits them again. Packed
    rows, their scales and biases, and bias vectors move alike (a row is an output)."""
    for name, array in weights.items():
        if ".self_attn.q_proj." in name:
            n = heads
        elif ".self_attn.k_proj." in name:
            n = kv_heads
        else:
            continue
        shape = array.shape
        halves = array.reshape(n, shape[0] // n // 2, 2, *shape[1:])
        weights[name] = halves.swapaxes(1, 2).reshape(shape)


def _replace_dir(staged: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(staged, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
    os.rename(out_dir, old / out_dir.name)
    os.rename(staged, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: ProgressFn | None = None) -> Path:
    """Convert the llama GGUF at ``gguf_path`` into an mlx_lm model directory ``out_dir``.

    An existing ``out_dir`` is replaced. ``progress(stage, fraction)`` is called with
    stages ``read``, ``tensors``, ``write``, ``tokenizer`` and ``done``. Raises
    ``NotFound`` for a missing file and ``InvalidArgument`` for an unreadable file or an
    unsupported model; returns ``out_dir``.
    """
    report = progress or _noop
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    report("read", 0.0)
    raw, meta = _read_gguf(gguf_path)
    report("read", 1.0)
    _architecture(meta)

    weights: dict[str, mx.array] = {}
    names = sorted(raw)
    for index, name in enumerate(names):
        array = raw.pop(name)
        mx.eval(array)
        weights[_mlx_name(name)] = array
        report("tensors", (index + 1) / len(names))
    config = _model_config(meta, weights)
    _hf_rows(weights, config["num_attention_heads"], config["num_key_value_heads"])

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(
        tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent)
    )
    try:
        os.chmod(staged, 0o755)
        report("write", 0.0)
        mx.save_safetensors(str(staged / "model.safetensors"), weights, {"format": "mlx"})
        report("write", 1.0)
        report("tokenizer", 0.0)
        info = write_tokenizer_files(
            meta, staged, model_max_length=config["max_position_embeddings"]
        )
        report("tokenizer", 1.0)
        if info.bos_token_id is not None:
            config["bos_token_id"] = info.bos_token_id
        generation: dict[str, Any] = {}
        if info.eos_token_ids:
            eos: int | list[int] = info.eos_token_ids
            if len(info.eos_token_ids) == 1:
                eos = info.eos_token_ids[0]
            config["eos_token_id"] = eos
            generation["eos_token_id"] = eos
        if info.bos_token_id is not None:
            generation["bos_token_id"] = info.bos_token_id
        _write_json(staged / "config.json", config)
        _write_json(staged / "generation_config.json", generation)
        _replace_dir(staged, out_dir)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    report("done", 1.0)
    return out_dir
