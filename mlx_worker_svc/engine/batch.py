"""The persistent decode batch: one batched KV cache shared by decoding requests.

Requests whose prompt is computed live here as rows of mlx-lm's batch caches
(`BatchKVCache` and friends, built through each layer cache's `merge`). Every
decode step runs all rows in ONE forward pass. A request joins with its own
cache (an `extend` of the batch, once per request) and leaves by `filter`;
the other rows are never recomputed. A row that a step does not schedule is
taken out with `extract` first, so a forward never advances a request the
scheduler did not ask for.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Generic, TypeVar

import mlx.core as mx
from mlx import nn

LayerCaches = list[Any]
K = TypeVar("K", bound=Hashable)


def merge_caches(caches: Sequence[LayerCaches]) -> LayerCaches:
    """Merges per-request layer caches into one batch cache per layer."""
    merged = []
    for layer in range(len(caches[0])):
        first = caches[0][layer]
        if not hasattr(first, "merge"):
            raise TypeError(f"{type(first).__name__} cannot be batched")
        merged.append(first.merge([c[layer] for c in caches]))
    return merged


class DecodeBatch(Generic[K]):
    """Rows of decoding requests, keyed by any hashable request key."""

    def __init__(self) -> None:
        self.keys: list[K] = []
        self._cache: LayerCaches = []

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: K) -> bool:
        return key in self.keys

    def join(self, entries: Sequence[tuple[K, LayerCaches]]) -> None:
        """Adds requests with their private caches as new rows."""
        if not entries:
            return
        merged = merge_caches([cache for _, cache in entries])
        if not self.keys:
            self._cache = merged
        else:
            for mine, theirs in zip(self._cache, merged, strict=True):
                mine.extend(theirs)
        self.keys.extend(key for key, _ in entries)

    def remove(self, keys: set[K]) -> None:
        """Drops rows (their KV is freed)."""
        keep = [i for i, key in enumerate(self.keys) if key not in keys]
        if len(keep) == len(self.keys):
            return
        if not keep:
            self.keys, self._cache = [], []
            return
        index = mx.array(keep)
        for layer in self._cache:
            layer.filter(index)
        self.keys = [self.keys[i] for i in keep]

    def extract(self, keys: set[K]) -> dict[K, LayerCaches]:
        """Takes rows out of the batch, returning each as a private cache."""
        out: dict[K, LayerCaches] = {}
        for i, key in enumerate(self.keys):
            if key in keys:
                out[key] = [layer.extract(i) for layer in self._cache]
        if out:
            mx.eval([c.state for caches in out.values() for c in caches])
            self.remove(set(out))
        return out

    def forward(self, model: nn.Module, last_tokens: Sequence[int]) -> mx.array:
        """Runs one token per row; returns logits [B, V] in row order."""
        inputs = mx.array(list(last_tokens), dtype=mx.uint32)[:, None]
        logits: mx.array = model(inputs, cache=self._cache)
        return logits[:, -1, :]

    def state(self) -> list[Any]:
        return [layer.state for layer in self._cache]

    @property
    def nbytes(self) -> int:
        return sum(int(layer.nbytes) for layer in self._cache)
