"""Rebuilding a Hugging Face tokenizer from the vocabulary embedded in a GGUF file.

This module owns the tokenizer half of GGUF conversion: it turns the
``tokenizer.ggml.*`` metadata (tokens, merges, token types, special ids, chat
template) into ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` that ``transformers``/``mlx_lm`` load offline. Only
byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) with a known
pre-tokenizer are supported; anything else raises ``InvalidArgument`` rather
than producing a tokenizer that silently splits text differently from llama.cpp.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from mlx_worker_svc.core.errors import InvalidArgument

# llama.cpp token types (tokenizer.ggml.token_type).
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# tokenizer.ggml.pre values whose split rule we reproduce: GPT-2 style byte-level
# BPE, optionally preceded by splitting every digit on its own (StarCoder family,
# SmolLM).
_PRE_BYTE_LEVEL = frozenset({"gpt2"})
_PRE_DIGITS_THEN_BYTE_LEVEL = frozenset({"smollm", "starcoder", "refact"})


@dataclass(frozen=True)
class TokenizerInfo:
    """What the model config needs to know about the rebuilt tokenizer."""

    bos_token_id: int | None
    eos_token_ids: list[int]
    num_tokens: int


def _scalar(meta: Mapping[str, Any], key: str) -> Any:
    value = meta.get(key)
    if value is None:
        return None
    if hasattr(value, "item"):
        return value.item()
    return value


def _token_id(meta: Mapping[str, Any], key: str, num_tokens: int) -> int | None:
    value = _scalar(meta, key)
    if value is None:
        return None
    token_id = int(value)
    if not 0 <= token_id < num_tokens:
        raise InvalidArgument(f"GGUF {key}={token_id} is outside the vocabulary ({num_tokens})")
    return token_id


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _PRE_BYTE_LEVEL:
        return byte_level
    if pre in _PRE_DIGITS_THEN_BYTE_LEVEL:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    known = sorted(_PRE_BYTE_LEVEL | _PRE_DIGITS_THEN_BYTE_LEVEL)
    raise InvalidArgument(
        f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: {', '.join(known)})"
    )


def _build_tokenizer(
    tokens: list[str], merges: list[str], token_types: list[int], pre: str, bos: int | None
) -> Tokenizer:
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise InvalidArgument(f"GGUF tokenizer merge {merge!r} is not of the form 'a b'")
        pairs.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    if bos is not None:
        bos_text = tokens[bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_text} $A",
            pair=f"{bos_text} $A {bos_text} $B",
            special_tokens=[(bos_text, bos)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(token_types)
        if kind == _TOKEN_CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(token_types)
        if kind == _TOKEN_USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    return tokenizer


def write_tokenizer_files(
    meta: Mapping[str, Any], out_dir: Path, *, model_max_length: int | None
) -> TokenizerInfo:
    """Write the tokenizer files for the GGUF metadata ``meta`` into ``out_dir``."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise InvalidArgument(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not isinstance(merges, list):
        raise InvalidArgument("GGUF file lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    raw_types = meta.get("tokenizer.ggml.token_type")
    token_types = (
        [int(t) for t in raw_types.tolist()]
        if raw_types is not None
        else [_TOKEN_NORMAL] * len(tokens)
    )
    if len(token_types) != len(tokens):
        raise InvalidArgument("GGUF tokenizer.ggml.token_type length differs from the token list")
    n = len(tokens)
    bos = _token_id(meta, "tokenizer.ggml.bos_token_id", n)
    eos = _token_id(meta, "tokenizer.ggml.eos_token_id", n)
    unk = _token_id(meta, "tokenizer.ggml.unknown_token_id", n)
    pad = _token_id(meta, "tokenizer.ggml.padding_token_id", n)
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token") or False)
    if add_bos and bos is None:
        raise InvalidArgument("GGUF asks to add a BOS token but has no bos_token_id")
    pre = str(meta.get("tokenizer.ggml.pre", "gpt2"))

    tokenizer = _build_tokenizer(tokens, merges, token_types, pre, bos if add_bos else None)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    special_map: dict[str, str] = {}
    for name, token_id in (("bos", bos), ("eos", eos), ("unk", unk), ("pad", pad)):
        if token_id is not None:
            special_map[f"{name}_token"] = tokens[token_id]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps(special_map, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )

    eos_ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        token_id = _token_id(meta, f"tokenizer.ggml.{key}_token_id", n)
        if token_id is not None and token_id not in eos_ids:
            eos_ids.append(token_id)
    return TokenizerInfo(bos_token_id=bos, eos_token_ids=eos_ids, num_tokens=n)
