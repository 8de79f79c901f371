"""Random-weight models for the GPU benchmark, built offline (no hub, no download).

The weights come from `tests/tiny_model.py` (`build_tiny_model` with another
shape, `quantized_copy` for 4-bit); the tokenizer is a synthetic byte-level BPE
with exactly the model's vocabulary, written by the GGUF converter's own
tokenizer writer (`engine.gguf_tokenizer.write_tokenizer_files`), so every id
the model can produce decodes and `mlx_lm.load` / the worker load it as usual.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from tokenizers import pre_tokenizers

from benchmarks.common import tiny_model_module
from mlx_worker_svc.engine.model.gguf_tokenizer import write_tokenizer_files

# Llama-3.2-1B's shape (config.json of meta-llama/Llama-3.2-1B), random weights.
LLAMA_1B: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
}

# The same architecture, small enough for a CPU smoke run.
SMOKE: dict[str, Any] = {
    **LLAMA_1B,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # mlx-lm's KV quantization group (64) divides it: the kv8 variant runs
    "vocab_size": 2048,
}

_NORMAL, _CONTROL = 1, 3  # llama.cpp token types, as gguf_tokenizer reads them
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")


def synthetic_vocab(size: int) -> tuple[list[str], list[str]]:
    """Tokens and merges of a byte-level BPE with exactly `size` tokens.

    Ids 0-255 are the 256 byte symbols; then two-symbol tokens, then
    three-symbol ones, each the merge of two earlier tokens; the last two ids
    are BOS and EOS.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    wanted = size - len(SPECIAL_TOKENS)
    if wanted < len(alphabet):
        raise ValueError(f"a byte-level vocabulary needs at least {len(alphabet) + 2} tokens")
    tokens = list(alphabet)
    merges: list[str] = []
    pairs = [a + b for a in alphabet for b in alphabet]
    for pair in pairs:
        if len(tokens) == wanted:
            break
        tokens.append(pair)
        merges.append(f"{pair[0]} {pair[1]}")
    for pair in pairs:
        for symbol in alphabet:
            if len(tokens) == wanted:
                break
            tokens.append(pair + symbol)
            merges.append(f"{pair} {symbol}")
        if len(tokens) == wanted:
            break
    if len(tokens) != wanted:
        raise ValueError(f"vocabulary size {size} is larger than this generator makes")
    return [*tokens, *SPECIAL_TOKENS], merges


def write_tokenizer(out: Path, vocab_size: int) -> tuple[int, int]:
    """Writes the synthetic tokenizer files into `out`; returns (BOS id, EOS id)."""
    tokens, merges = synthetic_vocab(vocab_size)
    bos, eos = vocab_size - 2, vocab_size - 1
    types = [_NORMAL] * vocab_size
    types[bos] = types[eos] = _CONTROL
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": bos,
        "tokenizer.ggml.eos_token_id": eos,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(meta, out, model_max_length=None)
    return bos, eos


def build_models(root: Path, shape: dict[str, Any], dtypes: list[str]) -> dict[str, Path]:
    """Builds the random model in bf16 and/or 4-bit under `root`; returns dtype -> dir."""
    tiny = tiny_model_module()
    vocab = int(shape["vocab_size"])
    tokenizer_dir = root / "tokenizer"
    bos, eos = write_tokenizer(tokenizer_dir, vocab)
    config = {**shape, "bos_token_id": bos, "eos_token_id": eos}
    bf16 = root / "bf16"
    tiny.build_tiny_model(bf16, tokenizer_dir, overrides=config, dtype=mx.bfloat16)
    (bf16 / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    mx.clear_cache()
    out = {"bf16": bf16}
    if "4bit" in dtypes:
        out["4bit"] = tiny.quantized_copy(bf16, root / "4bit", bits=4, group_size=64)
        mx.clear_cache()
    return {name: path for name, path in out.items() if name in dtypes}
