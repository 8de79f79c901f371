"""Quantized KV attended dequantized (EngineOptions.kv_dequant_min_batch) in decode batches.

A batch of at least the threshold's rows hands mlx-lm's attention dequantized
K/V and no `bits`, so it runs MLX's fused float attention; fewer rows keep
mlx-lm's quantized attention. The two agree within rounding on random
tensors and the stored triplets are the same; test_quantized.py and
tests/e2e/test_smollm_kv.py run such batches through a worker.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_worker_svc.core.domain import KVFormat
from mlx_worker_svc.engine.cache import quantized
from mlx_worker_svc.engine.cache.batch import merge_caches

BITS, GROUP = 8, 64
HEADS, KV_HEADS, DIM = 6, 2, 64


def _rows(lengths: list[int], dtype: mx.Dtype) -> list[list[Any]]:
    """One-layer quantized row caches of random KV, `lengths` tokens each."""
    kv = KVFormat(BITS, GROUP)
    rows = []
    for n in lengths:
        keys, values = (mx.random.normal((1, KV_HEADS, n, DIM)).astype(dtype) for _ in "kv")
        triplets = [mx.quantize(x, group_size=GROUP, bits=BITS) for x in (keys, values)]
        rows.append([quantized.row(tuple(triplets[0]), tuple(triplets[1]), kv)])
    return rows


def _attend(
    rows: list[list[Any]], step: tuple[mx.array, ...], from_rows: int
) -> tuple[mx.array, Any]:
    """One decode step of one layer over `rows` merged: (output, the batch cache)."""
    cache = merge_caches(rows, dequant_rows=lambda _dtype: from_rows)[0]
    q, k, v = (mx.array(x) for x in step)  # mlx-lm's attention scales its queries in place
    mask = cache.make_mask(1, return_array=False)  # before the update, as a model makes it
    keys, values = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q, keys, values, cache=cache, scale=DIM**-0.5, mask=mask)
    return out, cache


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(mx.float32, 1e-5), (mx.float16, 5e-3), (mx.bfloat16, 3e-2)]
)
@pytest.mark.parametrize("lengths", [[40, 40, 40], [40, 17, 3]])
def test_dequantized_attention_equals_the_quantized_within_rounding(
    dtype: mx.Dtype, tolerance: float, lengths: list[int]
) -> None:
    mx.random.seed(3)
    rows = _rows(lengths, dtype)
    b = len(lengths)
    step = tuple(
        mx.random.normal((b, heads, 1, DIM)).astype(dtype) for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    quant, q_cache = _attend(rows, step, 0)  # never dequantized: mlx-lm's quantized attention
    deq, d_cache = _attend(rows, step, b)
    assert hasattr(q_cache, "bits") and not hasattr(d_cache, "bits")
    assert quant.dtype == deq.dtype == dtype
    gap = mx.abs(quant.astype(mx.float32) - deq.astype(mx.float32))
    widest = mx.max(gap).item()
    assert isinstance(widest, float)
    assert widest <= tolerance
    assert widest > 0 or dtype == mx.float32  # the kernels do differ in rounding
    # Either way the batch stores the same triplets: only the attention differs.
    held = [tree_flatten(c.keys_and_values()) for c in (d_cache, q_cache)]
    assert len(held[0]) == 6
    for (_, ours), (_, theirs) in zip(*held, strict=True):
        assert mx.array_equal(ours, theirs).item()


def test_the_threshold_follows_the_rows_and_the_dtype() -> None:
    rows = _rows([8, 8, 8], mx.float16)
    seen: list[str] = []

    def from_three(dtype: str) -> int:
        seen.append(dtype)
        return 3

    cache = merge_caches(rows[:2], dequant_rows=from_three)[0]
    assert cache.bits == BITS and not cache.dequantizing()
    cache.extend(merge_caches(rows[2:])[0])  # a third row joins: 3 rows now
    assert cache.dequantizing() and not hasattr(cache, "bits")
    cache.filter(mx.array([0, 2]))
    assert cache.bits == BITS
    assert set(seen) == {"float16"}
    # A batch merged without a threshold never dequantizes.
    assert not merge_caches(rows)[0].dequantizing()
