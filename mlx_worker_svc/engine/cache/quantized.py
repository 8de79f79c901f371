"""Quantized KV (`--kv-bits`): mlx-lm's `QuantizedKVCache` layout, per request and batched.

A quantized layer holds keys and values as MLX's affine triplets (packed
uint32 words, scales, biases; scales and biases in the model's dtype), one
group of `group_size` values along head_dim per token, exactly as mlx-lm's
`QuantizedKVCache`; mlx-lm's `scaled_dot_product_attention` sees the
cache's `bits` and runs `quantized_scaled_dot_product_attention` on it.
Slicing by token or by row keeps the triplets exact, so a batch row, a
prefix-cache block and an extracted row hold the very bytes the request
wrote: `QuantizedBatchKVCache` is mlx-lm's left-padded `BatchKVCache`
applied to each array of the triplets.

A batch of at least `dequant_rows` rows (EngineOptions.kv_dequant_min_batch:
on the CPU, float16/bfloat16 KV, from 2 rows) attends instead with MLX's fused
float attention on a dequantized copy of its K/V, made per layer per step and
dropped once the layer has attended: MLX's CPU quantized product is several
times slower in those dtypes. Such rows round differently from the same
request alone (which keeps mlx-lm's quantized attention); the stored triplets
are the same either way.

When KV is quantized follows mlx-lm's generate with `quantized_kv_start=0`:
a forward into an empty cache (a prompt's first chunk) runs on a float cache,
which is quantized right after it (`quantize`); every later token is stored
and attended quantized. A one-token prompt is the exception: it decodes
straight into a quantized cache (mlx-lm runs that token on a float cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlx_worker_svc.core.domain import KVFormat
from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.engine.cache.batch import AlignedBatchKVCache, DequantRows
from mlx_worker_svc.engine.options import KV_GROUP_SIZES

LayerCaches = list[Any]


def check_head_dims(kv: KVFormat, dims: Sequence[int], where: str) -> None:
    """Raises InvalidArgument unless `kv`'s group divides every head size in `dims`."""
    for dim in dims:
        if kv.quantized and dim % kv.group_size:
            fits = [g for g in KV_GROUP_SIZES if all(d % g == 0 for d in dims)]
            hint = (
                f"use {' or '.join(map(str, fits))}"
                if fits
                else f"none of MLX's group sizes {KV_GROUP_SIZES} does: leave kv_bits 0"
            )
            raise InvalidArgument(
                f"{where}.kv_group_size {kv.group_size} does not divide the model's "
                f"head_dim {dim}: {hint}"
            )


def supported(cache: LayerCaches) -> bool:
    """Whether every layer of a model's cache is a plain KVCache, the one mlx-lm quantizes."""
    return all(type(layer) is KVCache for layer in cache)


def head_dims(cache: LayerCaches) -> tuple[int, ...]:
    """The key and value head sizes a filled plain cache holds."""
    return tuple(sorted({int(a.shape[-1]) for c in cache for a in (c.keys, c.values)}))


class RowKVCache(QuantizedKVCache):  # type: ignore[misc]
    """One request's quantized cache: mlx-lm's, plus the `merge` the decode batch calls."""

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> QuantizedBatchKVCache:
        return QuantizedBatchKVCache.merge(caches)

    def size(self) -> int:
        return int(self.offset)


def quantize(cache: LayerCaches, kv: KVFormat) -> LayerCaches:
    """`cache` with its float KV layers quantized to `kv` (as mlx-lm's maybe_quantize_kv_cache)."""
    if not kv.quantized:
        return cache
    out: LayerCaches = []
    for layer in cache:
        if type(layer) is KVCache:
            row = RowKVCache(group_size=kv.group_size, bits=kv.bits)
            row.offset = layer.offset
            if layer.keys is not None:
                # Only the tokens held: the float buffer grows in steps of 256.
                keys = layer.keys[..., : layer.offset, :]
                values = layer.values[..., : layer.offset, :]
                row.keys = mx.quantize(keys, group_size=kv.group_size, bits=kv.bits)
                row.values = mx.quantize(values, group_size=kv.group_size, bits=kv.bits)
            out.append(row)
            continue
        out.append(layer)
    return out


def empty(model: nn.Module, kv: KVFormat) -> LayerCaches:
    """A fresh cache that stores `kv` from its first token (a one-token prompt's)."""
    return quantize(make_prompt_cache(model), kv)


def row(keys: tuple[mx.array, ...], values: tuple[mx.array, ...], kv: KVFormat) -> RowKVCache:
    """A request's quantized layer holding the triplets `keys`, `values` ([1, H, T, ...])."""
    cache = RowKVCache(group_size=kv.group_size, bits=kv.bits)
    cache.keys, cache.values = keys, values
    cache.offset = int(keys[0].shape[2])
    return cache


def _justified(cache: Any, rows: int, held: int, top: int, ref: Any) -> tuple[Any, Any]:
    """`cache`'s (keys, values) triplets holding `held` tokens, left-padded to end at `top`.

    `cache` is a batch of `rows` rows or a row cache; an empty one (no keys)
    gives zeros shaped like those of `ref`, a cache that holds KV.
    """

    def one(x: mx.array | None, like: mx.array) -> mx.array:
        if x is None:
            x = mx.zeros((rows, like.shape[1], 0, like.shape[3]), dtype=like.dtype)
        kept = x[..., :held, :]
        return mx.pad(kept, [(0, 0), (0, 0), (top - kept.shape[2], 0), (0, 0)])

    def triplet(mine: Any, theirs: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        return tuple(one(None if mine is None else mine[i], r) for i, r in enumerate(theirs))

    return triplet(cache.keys, ref.keys), triplet(cache.values, ref.values)


class QuantizedBatchKVCache(AlignedBatchKVCache):
    """Left-padded batch rows of quantized KV: BatchKVCache over each array of the triplets."""

    # From how many rows attention reads dequantized K/V, by KV dtype (merge_caches sets
    # it from EngineOptions.kv_dequant_min_batch); None: never.
    dequant_rows: DequantRows | None = None

    def __init__(self, left_padding: list[int], group_size: int, bits: int) -> None:
        super().__init__(left_padding)
        # BatchKVCache's fields, typed: no KV yet, rows left-padded by `left_padding`.
        self.keys: Any = None
        self.values: Any = None
        self.left_padding: mx.array = mx.array(left_padding)
        self.offset: mx.array = -self.left_padding
        self._idx: int = 0
        self.group_size = group_size
        self._bits = bits

    @property
    def bits(self) -> int:
        """The KV's width; absent while `update_and_fetch` hands out dequantized K/V.

        mlx-lm's `scaled_dot_product_attention` runs its quantized attention
        for a cache with `bits` and MLX's fused attention for one without, so
        every model's attention (and the llama decode step) follows the cache.
        """
        if self.dequantizing():
            raise AttributeError("bits: this batch attends dequantized K/V")
        return self._bits

    def dequantizing(self) -> bool:
        """Whether this many rows of this dtype attend dequantized K/V (`dequant_rows`)."""
        if self.dequant_rows is None or self.keys is None:
            return False
        rows = self.dequant_rows(str(self.keys[1].dtype).removeprefix("mlx.core."))
        return 0 < rows <= self.offset.shape[0]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        prev, steps = self._idx, keys.shape[2]
        if self.keys is None or prev + steps > self.keys[0].shape[2]:
            grow = (self.step + steps - 1) // self.step * self.step
            if self.keys is None:
                self.keys = self._zeros(keys, grow)
                self.values = self._zeros(values, grow)
            else:
                self.keys, self.values = tree_map(
                    lambda x: mx.concatenate(
                        [x[..., :prev, :], mx.zeros((*x.shape[:2], grow, x.shape[3]), x.dtype)],
                        axis=2,
                    ),
                    (self.keys, self.values),
                )
        self.offset = self.offset + steps
        self._idx += steps
        q_keys = mx.quantize(keys, group_size=self.group_size, bits=self._bits)
        q_values = mx.quantize(values, group_size=self.group_size, bits=self._bits)
        for i in range(len(self.keys)):
            self.keys[i][..., prev : self._idx, :] = q_keys[i]
            self.values[i][..., prev : self._idx, :] = q_values[i]
        held = self.keys_and_values()
        if not self.dequantizing():
            return held
        # Transient: this layer's attention reads them, then MLX frees them.
        return tuple(self._dequantized(x) for x in held)

    def _dequantized(self, triplet: tuple[mx.array, ...]) -> mx.array:
        packed, scales, biases = triplet
        return mx.dequantize(packed, scales, biases, group_size=self.group_size, bits=self._bits)

    def _zeros(self, x: mx.array, steps: int) -> tuple[mx.array, ...]:
        rows, heads, _, dim = x.shape
        shape = (rows, heads, steps)
        return (
            mx.zeros((*shape, dim * self._bits // 32), dtype=mx.uint32),
            mx.zeros((*shape, dim // self.group_size), dtype=x.dtype),
            mx.zeros((*shape, dim // self.group_size), dtype=x.dtype),
        )

    def keys_and_values(self) -> Any:
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def filter(self, batch_indices: mx.array) -> None:
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = cast(int, mx.min(self.left_padding).item())
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(
                    lambda x: x[..., shift:, :], (self.keys, self.values)
                )
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: Any) -> None:
        padded = self.padded or getattr(other, "padded", True) or self._idx != other._idx
        top = max(self._idx, other._idx)
        ref = self if self.keys is not None else other
        if ref.keys is not None:
            mine = _justified(self, self.offset.shape[0], self._idx, top, ref)
            theirs = _justified(other, other.offset.shape[0], other._idx, top, ref)
            self.keys, self.values = tree_map(lambda a, b: mx.concatenate([a, b]), mine, theirs)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate(
            [self.left_padding + (top - self._idx), other.left_padding + (top - other._idx)]
        )
        self._idx = top
        self.padded = padded

    def extract(self, idx: int) -> RowKVCache:
        mx.eval(self.left_padding)
        pad = cast(int, self.left_padding[idx].item())
        keys, values = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx]), (self.keys, self.values)
        )
        return row(tuple(keys), tuple(values), KVFormat(self._bits, self.group_size))

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> QuantizedBatchKVCache:
        """Rows of per-request quantized caches (`RowKVCache`s), right-justified."""
        lengths = [int(c.offset) for c in caches]
        top = max(lengths)
        first = caches[0]
        merged = cls([top - n for n in lengths], first.group_size, first.bits)
        ref = next((c for c in caches if c.keys is not None), None)
        if ref is not None:
            parts = [_justified(c, 1, n, top, ref) for c, n in zip(caches, lengths, strict=True)]
            merged.keys, merged.values = tree_map(lambda *xs: mx.concatenate(xs), *parts)
        merged.offset = merged.offset + top
        merged._idx = top
        merged.padded = len(set(lengths)) > 1
        return merged

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return int(tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0))
