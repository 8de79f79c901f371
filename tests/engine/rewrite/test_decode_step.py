"""A llama's own decode step (engine/rewrite/decode_step.py): the model's logits, bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
from tiny_model import random_llama

from mlx_worker_svc.core.domain import KVFormat
from mlx_worker_svc.engine.cache import quantized
from mlx_worker_svc.engine.cache.batch import AlignedBatchKVCache, merge_caches
from mlx_worker_svc.engine.rewrite import decode_step, fused, transposed

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [2, 7, 1, 8, 2]]


def worker_model(kind: str, **overrides: Any) -> llama.Model:
    """The tiny llama as a runner prepares it: fused, transposed views, then its step."""
    model = random_llama(kind, **overrides)
    fused.install(model)
    transposed.install(model)
    decode_step.install(model)
    return model


def prefilled(model: llama.Model, prompts: Sequence[list[int]]) -> list[Any]:
    """One cache per layer holding `prompts`: a request's own, or a batch of them."""
    rows = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([prompt]), cache=cache))
        rows.append(cache)
    return rows[0] if len(rows) == 1 else merge_caches(rows)


def decode(model: llama.Model, prompts: Sequence[list[int]], steps: int, own: bool) -> list[Any]:
    """Greedy decode steps' logits, through the step (`own`) or the model's forward."""
    cache = prefilled(model, prompts)
    tokens = mx.array([p[-1] for p in prompts], dtype=mx.uint32)
    out = []
    for _ in range(steps):
        if own:
            logits = decode_step.logits(model, tokens, cache)
        else:
            logits = model(tokens[:, None], cache=cache)[:, -1, :]
        mx.eval(logits)
        out.append(logits)
        tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
    return out


def assert_same(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, step
        assert mx.array_equal(a, b), f"step {step}"


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16"])
def test_a_single_stream_gets_the_unchanged_models_logits(kind: str) -> None:
    model = worker_model(kind)
    assert decode_step.install(model)
    # mlx-lm's model as loaded (no fused products, no views): single rows are bit-equal.
    assert_same(
        decode(model, PROMPTS[:1], 10, True), decode(random_llama(kind), PROMPTS[:1], 10, False)
    )


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths", ["equal", "padded"])
def test_batches_get_the_models_own_logits(kind: str, lengths: str) -> None:
    prompts = [PROMPTS[0], PROMPTS[3]] if lengths == "equal" else PROMPTS
    model = worker_model(kind)
    cache = prefilled(model, prompts)
    # Equal lengths decode without a mask; left-padded rows with mlx-lm's array mask.
    assert isinstance(cache[0], AlignedBatchKVCache)
    assert cache[0].padded == (lengths == "padded")
    assert (cache[0].make_mask(1) is None) == (lengths == "equal")
    # The same model's forward (fused products included): the step changes nothing.
    assert_same(decode(model, prompts, 8, True), decode(model, prompts, 8, False))


def test_mlx_lms_batch_cache_works_too() -> None:
    model = worker_model("float32")

    def batch() -> list[Any]:
        rows = [prefilled(model, [p]) for p in PROMPTS]
        return [BatchKVCache.merge(layer) for layer in zip(*rows, strict=True)]

    cache, other = batch(), batch()
    tokens = mx.array([p[-1] for p in PROMPTS], dtype=mx.uint32)
    ours = decode_step.logits(model, tokens, cache)
    theirs = model(tokens[:, None], cache=other)[:, -1, :]
    assert mx.array_equal(ours, theirs)
    assert ours.shape == (len(PROMPTS), 256)


def test_an_untied_output_head_is_used() -> None:
    model = worker_model("float32", tie_word_embeddings=False)
    assert "lm_head" in model
    assert_same(decode(model, PROMPTS[:1], 6, True), decode(model, PROMPTS[:1], 6, False))


@pytest.mark.parametrize(
    ("why", "build"),
    [
        ("quantized", lambda: worker_model("4bit")),
        ("biased projections", lambda: worker_model("float32", attention_bias=True)),
        ("mlp biases", lambda: worker_model("float32", mlp_bias=True)),
    ],
)
def test_models_it_does_not_cover_keep_their_forward(why: str, build: Any) -> None:
    model = build()
    assert getattr(model, decode_step._ATTRIBUTE, None) is None, why
    # logits() still answers, through the model itself.
    assert_same(decode(model, PROMPTS[:2], 4, True), decode(model, PROMPTS[:2], 4, False))


def test_without_fused_products_nothing_is_installed() -> None:
    model = random_llama("float32")
    transposed.install(model)
    assert not decode_step.install(model)
    assert_same(decode(model, PROMPTS[:1], 3, True), decode(model, PROMPTS[:1], 3, False))


def test_a_sliding_window_layer_keeps_the_models_forward() -> None:
    model = worker_model(
        "float32", layer_types=["full_attention", "sliding_attention"], sliding_window=4
    )
    assert getattr(model, decode_step._ATTRIBUTE, None) is None


def test_the_step_has_fewer_graph_nodes(tmp_path: Any) -> None:
    """What it is for: the same step in fewer primitives (no flatten, unflatten, transpose)."""
    model = worker_model("float32")
    tokens = mx.array([p[-1] for p in PROMPTS], dtype=mx.uint32)

    def nodes(own: bool) -> int:
        cache = prefilled(model, PROMPTS)
        if own:
            out = decode_step.logits(model, tokens, cache)
        else:
            out = model(tokens[:, None], cache=cache)[:, -1, :]
        path = tmp_path / f"{own}.dot"
        mx.export_to_dot(str(path), out)
        return int(path.read_text().count("shape=rectangle"))

    ours, theirs = nodes(True), nodes(False)
    assert ours < theirs, (ours, theirs)


@pytest.mark.parametrize("rows", [1, 4])
def test_quantized_kv_gets_the_models_own_logits(rows: int) -> None:
    """KV stored as mlx-lm's quantized triplets (kv_bits 8): the step changes nothing."""
    model = worker_model("float32", head_dim=64)
    kv = KVFormat(8, 64)

    def decode_quantized(own: bool) -> list[Any]:
        caches = []
        for prompt in PROMPTS[:rows]:
            cache = make_prompt_cache(model)
            model(mx.array([prompt]), cache=cache)
            caches.append(quantized.quantize(cache, kv))
        cache = caches[0] if rows == 1 else merge_caches(caches)
        assert hasattr(cache[0], "bits")
        tokens = mx.array([p[-1] for p in PROMPTS[:rows]], dtype=mx.uint32)
        out = []
        for _ in range(6):
            if own:
                logits = decode_step.logits(model, tokens, cache)
            else:
                logits = model(tokens[:, None], cache=cache)[:, -1, :]
            mx.eval(logits)
            out.append(logits)
            tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
        return out

    assert decode_step.install(model)
    assert_same(decode_quantized(True), decode_quantized(False))
