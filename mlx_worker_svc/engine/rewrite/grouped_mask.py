"""Batch masks for mlx-lm's gemma2 attention, whose query heads share KV heads in an axis.

mlx-lm's gemma2 `Attention` reshapes its queries to (B, kv_heads, repeats, L, D)
when several query heads share a KV head, and adds the mask to scores of that
shape. A batch cache's mask is (B, 1, L, S): against five axes its batch axis
lines up with the KV heads, so rows of a batch whose KV lengths differ attend with
another row's mask (two rows, two KV heads: silently wrong tokens) or fail to
broadcast (four rows: ValueError); mlx-lm's own batched generation does the same.
The rewrite gives such an attention its batch mask with the group axis, (B, 1, 1,
L, S), each row its own; a single request's mask (none, or a 2-D causal one) is
left alone, so its tokens are mlx-lm's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models import gemma2


class _GroupedMaskAttention(gemma2.Attention):  # type: ignore[misc]  # mlx-lm is untyped
    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)  # (B, 1, L, S) -> (B, 1, 1, L, S)
        out: mx.array = super().__call__(x, mask, cache)
        return out


def install(model: nn.Module) -> int:
    """Gives every gemma2 attention of grouped query heads its batch mask; the count."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is gemma2.Attention and module.repeats > 1:
            module.__class__ = _GroupedMaskAttention
            count += 1
    return count
