"""Builds the tiny random llama the fast tests use.

Two layers, hidden size 64, 4 query / 2 KV heads, float32, with the SmolLM2
tokenizer files so that text and chat templates behave like the real model.
It loads through the same `mlx_lm.load` path as any model directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# SmolLM2's tokenizer (TOKENIZER_FILES) and the config entries that go with it.
SMOLLM_VOCAB: dict[str, Any] = {
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "eos_token_id": 2,
    "bos_token_id": 1,
}
# A ChatML template that renders tools the Hermes/Qwen way (SmolLM2's own has no tools).
TOOL_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls is defined %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls %}
            {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- (call.function.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content }}
        {{- '\n</tool_response><|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


def build_tiny_model(
    out: Path,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    head_dim: int | None = None,
    max_position_embeddings: int = 512,
    overrides: Mapping[str, Any] | None = None,
    dtype: mx.Dtype | None = None,
    tool_template: bool = False,
) -> Path:
    """Writes a random tiny llama into `out` (config, weights, tokenizer).

    `overrides` replaces config entries (another shape, e.g. the GPU benchmark's
    Llama-3.2-1B); `dtype` casts the weights before they are saved;
    `tool_template` replaces the chat template with `TOOL_TEMPLATE`.
    """
    config = tiny_config(
        **SMOLLM_VOCAB
        | {"tie_word_embeddings": False, "max_position_embeddings": max_position_embeddings}
    )
    if head_dim is not None:
        config["head_dim"] = head_dim
    config.update(overrides or {})
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    if not config["tie_word_embeddings"]:
        # Default init gives near-uniform logits; sharpen them so greedy has clear winners.
        model.update({"lm_head": {"weight": model.lm_head.weight * 8.0}})
    if dtype is not None:
        model.set_dtype(dtype)
    _save(model, config, tokenizer_dir, out, TOKENIZER_FILES)
    if tool_template:
        set_chat_template(out, TOOL_TEMPLATE)
    return out


def build_tiny_gemma2(out: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """Writes a random tiny gemma2 (4 query heads over 2 KV heads) into `out`.

    mlx-lm's gemma2 groups the query heads of a KV head in an axis of their own,
    the one attention whose batch masks need the worker's rewrite (grouped_mask).
    """
    from mlx_lm.models import gemma2

    config = tiny_config(**SMOLLM_VOCAB, model_type="gemma2", head_dim=64, query_pre_attn_scalar=64)
    mx.random.seed(seed)
    model = gemma2.Model(gemma2.ModelArgs.from_dict(config))
    # Tied embeddings: sharpened, so that greedy has clear winners.
    embed = model.model.embed_tokens
    model.update({"model": {"embed_tokens": {"weight": embed.weight * 4.0}}})
    return _save(model, config, tokenizer_dir, out, TOKENIZER_FILES)


def set_chat_template(model_dir: Path, template: str) -> None:
    """Replaces the chat template in a model directory's tokenizer_config.json."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))


def tool_model_copy(source: Path, out: Path) -> Path:
    """A copy of the model directory `source` whose chat template renders tools."""
    shutil.copytree(source, out)
    set_chat_template(out, TOOL_TEMPLATE)
    return out


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The tiny llama's config (2 layers, hidden 64, 4/2 heads), with `overrides` applied."""
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
    }
    config.update(overrides)
    return config


def random_llama(kind: str = "float32", *, seed: int = 11, **overrides: Any) -> llama.Model:
    """The tiny llama in memory (vocabulary 256): a dtype's name, or "4bit" (affine, group 64)."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(tiny_config(vocab_size=256, **overrides)))
    if kind == "4bit":
        nn.quantize(model, group_size=64, bits=4)
    else:
        model.set_dtype(getattr(mx, kind))
    mx.eval(model.parameters())
    return model


def _save(
    model: Any, config: Mapping[str, Any], source: Path, out: Path, files: tuple[str, ...]
) -> Path:
    """Writes weights and config into `out` and copies `files` that exist in `source`."""
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in files:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    return out


def dequantized_copy(source: Path, out: Path, dtype: mx.Dtype = mx.float32) -> Path:
    """Writes `source` (a quantized model dir) as float weights (`dtype`) into `out`.

    The same model, numerically (in float32): every quantized weight is
    expanded to the values it stands for. On a Linux CPU this runs through
    BLAS, which makes the long SmolLM2 parity runs affordable.
    """
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    model, _, config = load(str(source), return_config=True)
    model = dequantize_model(model)
    model.set_dtype(dtype)
    config = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    return _save(model, config, source, out, (*TOKENIZER_FILES, "generation_config.json"))


def quantized_copy(source: Path, out: Path, *, bits: int = 4, group_size: int = 64) -> Path:
    """Writes `source` quantized with mlx-lm's `quantize_model` (affine) into `out`."""
    from mlx_lm.utils import load_model, quantize_model

    model, config = load_model(source)
    model, config = quantize_model(model, config, group_size, bits)
    return _save(model, config, source, out, (*TOKENIZER_FILES, "generation_config.json"))
