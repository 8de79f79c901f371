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

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Generic, NamedTuple, TypeVar

import mlx.core as mx
from mlx import nn
from mlx_lm.models.cache import BatchKVCache, KVCache, create_attention_mask, make_prompt_cache

from mlx_worker_svc.engine import sampling
from mlx_worker_svc.engine.rewrite import decode_step, dequant

LayerCaches = list[Any]
K = TypeVar("K", bound=Hashable)
# A KV dtype's name ("float16") to the decode rows from which quantized KV of that dtype
# is attended dequantized (0: never): EngineOptions.kv_dequant_rows, for one backend.
DequantRows = Callable[[str], int]


class AlignedBatchKVCache(BatchKVCache):  # type: ignore[misc]
    """mlx-lm's BatchKVCache, knowing on the host whether any row is left-padded.

    While no row is (every request's KV is equally long: requests that
    started together, or prompts prefilled together), every row attends
    exactly as a single request's `KVCache` would, so it takes that cache's
    mask: none for a one-token decode step, MLX's fused causal attention for
    several tokens. Without an array mask MLX runs its fused attention
    kernels, which on CUDA it does not use with one (the unfused fallback
    then runs instead). The attention is the same: the mask would only have
    kept every position it allows.
    """

    padded = True

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> AlignedBatchKVCache:
        merged: AlignedBatchKVCache = super().merge(caches)
        merged.padded = len({c.size() for c in caches}) > 1
        return merged

    def extend(self, other: Any) -> None:
        padded = self.padded or getattr(other, "padded", True) or self._idx != other._idx
        super().extend(other)
        self.padded = padded

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:  # noqa: N803
        if not self.padded:
            window = kwargs.get("window_size")
            return create_attention_mask(N, self._idx, return_array, window)
        return super().make_mask(N, return_array=return_array, **kwargs)

    @classmethod
    def empty(cls, rows: int) -> AlignedBatchKVCache:
        """A cache for `rows` prompts of one length, prefilled together."""
        cache = cls([0] * rows)
        cache.padded = False
        return cache


Scope = Callable[[Sequence[Any]], AbstractContextManager[bool]]
"""Opens a forward's construction for rows (their LoRA adapters, engine/lora/forward.py)."""


def _bare(_rows: Sequence[Any]) -> AbstractContextManager[bool]:
    return nullcontext(False)


def prefill_together(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    scope: AbstractContextManager[bool] | None = None,
) -> list[LayerCaches]:
    """Prefills equally long prompts in one batched forward; returns each one's own cache.

    Every row attends as it would alone (no padding, the single request's
    causal mask), and each row's cache is then taken out as a plain
    `KVCache`, the cache a prefill of that prompt alone leaves up to
    rounding: a batched matrix product may round differently from a single
    row's (OpenBLAS does, in float32's last digit), as in batched decode.
    """
    layers = len(make_prompt_cache(model))
    cache = [AlignedBatchKVCache.empty(len(prompts)) for _ in range(layers)]
    with scope or nullcontext(False):
        model(mx.array([list(p) for p in prompts], dtype=mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    rows = [[layer.extract(i) for layer in cache] for i in range(len(prompts))]
    mx.eval([c.state for row in rows for c in row])
    return rows


def batchable(model: nn.Module, *, aligned: bool = True) -> bool:
    """Whether the model's requests can share batch caches without masks (plain KV caches).

    `aligned` False (EngineOptions.aligned_decode) says they never do.
    """
    return aligned and all(type(c) is KVCache for c in make_prompt_cache(model))


def merge_caches(
    caches: Sequence[LayerCaches], *, aligned: bool = True, dequant_rows: DequantRows | None = None
) -> LayerCaches:
    """Merges per-request layer caches into one batch cache per layer.

    Plain KV caches merge into `AlignedBatchKVCache`s unless `aligned` is False
    (EngineOptions.aligned_decode): then mlx-lm's masks run on every step.
    Quantized rows merge into batches that attend dequantized K/V from
    `dequant_rows` rows (quantized.QuantizedBatchKVCache; None: never).
    """
    merged = []
    for layer in range(len(caches[0])):
        first = caches[0][layer]
        if not hasattr(first, "merge"):
            raise TypeError(f"{type(first).__name__} cannot be batched")
        group = [c[layer] for c in caches]
        if aligned and all(type(c) is KVCache for c in group):
            merged.append(AlignedBatchKVCache.merge(group))
        else:
            batch = first.merge(group)
            if isinstance(batch, AlignedBatchKVCache):  # quantized rows (quantized.py)
                if not aligned:
                    batch.padded = True  # masks on every step
                batch.dequant_rows = dequant_rows
            merged.append(batch)
    return merged


class _Ahead(NamedTuple, Generic[K]):
    """A queued look-ahead forward."""

    keys: tuple[K, ...]  # its rows
    tokens: tuple[int, ...] | None  # its input tokens (None until the host reads them)
    logits: mx.array  # [B, V]
    choice: sampling.Choice | None  # greedy tokens of `logits`, if every row samples greedily


class DecodeBatch(Generic[K]):
    """Rows of decoding requests, keyed by any hashable request key.

    A batch of one row keeps that request's own (unbatched) cache, so a single
    stream runs exactly mlx-lm's single-sequence computation, with no mask or
    per-row offsets; a second row turns it into batch caches.

    Look-ahead: the next decode forward of every row is queued on the device
    before the host waits for this step's tokens. `speculate` runs it on the
    sampled tokens while they are still device arrays (as mlx-lm's generate
    loop does), so the device computes step t+1 while the host reads step t's
    tokens, answers and waits for the scheduler's next step; `prefetch` does
    the same from known tokens where no speculation is pending. If the next
    step asks for exactly that forward, its logits are ready. Rows that leave
    keep the look-ahead of the others (their rows are filtered out of it);
    any other change first rolls the caches back by the one speculative
    token, so what runs is always what was asked. When every row samples
    greedily (`greedy=True`), the look-ahead launches the tokens' choice with
    the forward: one launch a step, as mlx-lm's generate loop does.
    `aligned`: rows merge into aligned caches (`merge_caches`); `scope` opens
    every forward for its rows' keys (their adapters); `dequant_rows`: from how many
    rows quantized KV is attended dequantized (`merge_caches`).
    """

    def __init__(
        self,
        *,
        aligned: bool = True,
        scope: Scope = _bare,
        dequant_rows: DequantRows | None = None,
    ) -> None:
        self.aligned = aligned
        self.scope = scope
        self.dequant_rows = dequant_rows
        self.clear()

    def clear(self) -> None:
        """Drops every row, its cache and the look-ahead; the settings stay."""
        self.keys: list[K] = []
        self._members: set[K] = set()  # the keys, for O(1) membership
        self._cache: LayerCaches = []
        self._batched = False
        self._ahead: _Ahead[K] | None = None
        # The greedy tokens of the logits the last `forward` returned, launched with
        # them by the look-ahead (None: not computed; the caller samples).
        self.choice: sampling.Choice | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: K) -> bool:
        return key in self._members

    def join(self, entries: Sequence[tuple[K, LayerCaches]]) -> None:
        """Adds requests with their private caches as new rows."""
        if not entries:
            return
        self._drop_ahead()
        if not self.keys and len(entries) == 1:
            self._cache, self._batched = list(entries[0][1]), False
        elif not self._batched:
            # The lone row's cache (if any) merges with the newcomers in one go.
            mine = [self._cache] if self.keys else []
            self._cache = merge_caches(
                [*mine, *(cache for _, cache in entries)],
                aligned=self.aligned,
                dequant_rows=self.dequant_rows,
            )
            self._batched = True
        else:
            merged = merge_caches(
                [cache for _, cache in entries],
                aligned=self.aligned,
                dequant_rows=self.dequant_rows,
            )
            for layer, theirs in zip(self._cache, merged, strict=True):
                layer.extend(theirs)
        self.keys.extend(key for key, _ in entries)
        self._members.update(key for key, _ in entries)

    def remove(self, keys: set[K]) -> None:
        """Drops rows (their KV is freed); the others keep their look-ahead."""
        keep = [i for i, key in enumerate(self.keys) if key not in keys]
        if len(keep) == len(self.keys):
            return
        if not keep:
            self._ahead = None
            self.keys, self._cache, self._batched = [], [], False
            self._members = set()
            return
        if len(keep) == 1:
            # Back to one row: give it its own cache again (it then computes
            # exactly as a single stream, so its look-ahead is recomputed).
            self._drop_ahead()
            self._cache = [layer.extract(keep[0]) for layer in self._cache]
            mx.eval([c.state for c in self._cache])
            self._batched = False
        else:
            index = mx.array(keep)
            for layer in self._cache:
                layer.filter(index)
            if self._ahead is not None:
                # The kept rows' logits; their choice is made again from those (as
                # choose_tokens makes it for that many rows).
                tokens = self._ahead.tokens
                kept = tuple(tokens[i] for i in keep) if tokens is not None else None
                rows = tuple(self.keys[i] for i in keep)
                self._ahead = _Ahead(rows, kept, self._ahead.logits[index], None)
        self.keys = [self.keys[i] for i in keep]
        self._members = set(self.keys)

    def extract(self, keys: set[K]) -> dict[K, LayerCaches]:
        """Takes rows out of the batch, returning each as a private cache."""
        if not self._batched:
            if self.keys and self.keys[0] in keys:
                self._drop_ahead()
                lone = {self.keys[0]: self._cache}
                self.keys, self._cache = [], []
                self._members = set()
                return lone
            return {}
        out: dict[K, LayerCaches] = {}
        for i, key in enumerate(self.keys):
            if key in keys:
                out[key] = [layer.extract(i) for layer in self._cache]
        if out:
            if self._ahead is not None:
                # Their copies hold the speculative token: take it off them only.
                for caches in out.values():
                    for layer in caches:
                        layer.trim(1)
            mx.eval([c.state for caches in out.values() for c in caches])
            self.remove(set(out))
        return out

    def forward(self, model: nn.Module, last_tokens: Sequence[int]) -> mx.array:
        """Runs one token per row; returns logits [B, V] in row order (sets `choice`)."""
        tokens = tuple(last_tokens)
        ahead, self._ahead, self.choice = self._ahead, None, None
        if ahead is not None:
            if ahead.keys == tuple(self.keys) and ahead.tokens == tokens:
                self.choice = ahead.choice
                return ahead.logits
            self._rollback()
        inputs = mx.array(list(tokens), dtype=mx.uint32)
        with dequant.rows(model, len(tokens)), self.scope(self.keys) as adapted:
            return decode_step.logits(model, inputs, self._cache, adapted=adapted)

    def speculate(self, model: nn.Module, sampled: mx.array, *, greedy: bool = False) -> None:
        """Queues the next forward on this step's sampled tokens (a lazy [B] array).

        Launch `sampled` (`mx.async_eval`) first, so that reading the tokens
        waits for them only, not for the forward queued behind them; then
        `confirm` with the tokens `sampled` held, once they are read.
        `greedy`: every row samples greedily, so the next tokens' choice is
        launched with the forward.
        """
        self._drop_ahead()
        if not self.keys or not self._trimmable():
            return
        with dequant.rows(model, len(self.keys)), self.scope(self.keys) as adapted:
            logits = decode_step.logits(
                model, sampled.astype(mx.uint32), self._cache, adapted=adapted
            )
        self._ahead = self._launch(None, logits, greedy)

    def confirm(self, tokens: Sequence[int]) -> None:
        """Records the tokens the pending `speculate` ran on."""
        if self._ahead is not None and self._ahead.tokens is None:
            self._ahead = self._ahead._replace(tokens=tuple(tokens))

    def prefetch(
        self, model: nn.Module, last_tokens: Sequence[int], *, greedy: bool = False
    ) -> None:
        """Starts the next decode forward now, unless it is already under way."""
        tokens = tuple(last_tokens)
        ahead = self._ahead
        if ahead is not None and ahead.keys == tuple(self.keys) and ahead.tokens == tokens:
            return
        if not self.keys or not self._trimmable():
            return
        self._drop_ahead()
        self._ahead = self._launch(tokens, self.forward(model, tokens), greedy)

    def _launch(self, tokens: tuple[int, ...] | None, logits: mx.array, greedy: bool) -> _Ahead[K]:
        choice = sampling.greedy_choice(logits) if greedy else None
        mx.async_eval([logits, *(choice.arrays() if choice else [])])  # type: ignore[no-untyped-call]
        return _Ahead(tuple(self.keys), tokens, logits, choice)

    def _trimmable(self) -> bool:
        return all(layer.is_trimmable() for layer in self._cache)

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self._ahead = None
            self._rollback()

    def _rollback(self) -> None:
        for layer in self._cache:
            layer.trim(1)

    def state(self) -> list[Any]:
        return [layer.state for layer in self._cache]

    @property
    def nbytes(self) -> int:
        return sum(int(layer.nbytes) for layer in self._cache)
