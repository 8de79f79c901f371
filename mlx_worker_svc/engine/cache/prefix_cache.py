"""The prefix cache: KV of prompt prefixes, reused across requests by blocks.

A block is `block_size` consecutive tokens. Block i of a sequence is keyed by
(the key of block i - 1, its own tokens), so a block is found only behind the
exact same prefix; keys are compared exactly (no hashing), so a hit is never
a collision. Each block holds its own copy of the KV (keys and values of every
layer stacked: `[layers, 1, kv_heads, block_size, head_dim]`): MLX caches are
contiguous per request, so a hit copies the blocks into the new request's cache
rather than sharing them as a paged cache would. Blocks are stored whole, but
a hit takes, after its whole blocks, the leading tokens that the next cached
block shares with the request: a prompt that shares 24 tokens with a cached one
reuses 24, not 16 (a system prompt rarely ends on a block boundary).

Blocks count in the KV budget. The runner evicts the least recently used
blocks, leaves first, whenever a request needs the room, so cached blocks are
always available to running requests. Only plain `KVCache` layers are cached;
models with sliding-window or recurrent layers run without a prefix cache
(`supported`). With quantized KV (`--kv-bits`) a block holds the quantized
triplets (packed words, scales, biases) exactly as the request's cache held
them, and a hit gives back quantized caches (engine/cache/quantized.py).
Each LoRA adapter's KV hangs from its own root (`root`, negative; 0 is the base
model's), so KV is never shared across adapters; `drop_root` frees one.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_reduce
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_worker_svc.core.domain import FLOAT_KV, KVFormat
from mlx_worker_svc.engine.cache import quantized

LayerCaches = list[Any]
Parts = tuple[mx.array, ...]  # a float array, or the quantized triplet
_ROOT = 0


@dataclass(eq=False)
class _Block:
    id: int
    parent: int
    tokens: tuple[int, ...]
    keys: Parts
    values: Parts
    children: int = 0
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = int(tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0))


def _parts(x: Any) -> Parts:
    """A layer's keys or values as a tuple of arrays."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _slice(parts: Parts, start: int, end: int) -> Parts:
    return tuple(p[..., start:end, :] for p in parts)


def _copy(parts: Parts) -> Parts:
    # `* 1` copies (a view would pin the whole stacked buffer); exact for packed words too.
    return tuple(p * 1 for p in parts)


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def supported(model: nn.Module) -> bool:
    """Whether every layer of the model's cache is a plain, sliceable KVCache."""
    return all(type(layer) is KVCache for layer in make_prompt_cache(model))


class PrefixCache:
    """Blocks of prompt KV keyed by their exact token prefix, evicted LRU."""

    def __init__(self, block_size: int, kv: KVFormat = FLOAT_KV) -> None:
        self.block_size = block_size
        self.kv = kv  # the format of every block (the requests' caches)
        self._index: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._kids: dict[int, dict[int, _Block]] = {}  # parent id -> its child blocks
        self._lru: OrderedDict[int, _Block] = OrderedDict()
        self._ids = itertools.count(1)
        self.nbytes = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._lru)

    # ---------------------------------------------------------------- lookup
    def match(self, tokens: Sequence[int], limit: int, root: int = _ROOT) -> int:
        """Tokens of the longest cached prefix of `tokens`, at most `limit` (read-only)."""
        chain = self._chain(tokens, limit, root)
        return len(chain) * self.block_size + self._head(tokens, chain, limit, root)[1]

    def _chain(self, tokens: Sequence[int], limit: int, root: int = _ROOT) -> list[_Block]:
        bs, parent = self.block_size, root
        chain: list[_Block] = []
        for start in range(0, min(limit, len(tokens)) - bs + 1, bs):
            block = self._index.get((parent, tuple(tokens[start : start + bs])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def _head(
        self, tokens: Sequence[int], chain: list[_Block], limit: int, root: int = _ROOT
    ) -> tuple[_Block | None, int]:
        """The cached block after `chain` sharing the most leading tokens with `tokens`."""
        start = len(chain) * self.block_size
        want = tokens[start : min(limit, len(tokens), start + self.block_size)]
        best: _Block | None = None
        shared = 0
        for block in self._kids.get(chain[-1].id if chain else root, {}).values():
            same = _common_length(block.tokens, want)
            if same > shared:
                best, shared = block, same
        return best, shared

    def load(
        self, tokens: Sequence[int], limit: int, root: int = _ROOT
    ) -> tuple[int, LayerCaches | None]:
        """A new private cache holding the longest cached prefix; (tokens, cache)."""
        chain = self._chain(tokens, limit, root)
        head, shared = self._head(tokens, chain, limit, root)
        if not chain and head is None:
            return 0, None
        # Leaves are touched first, so parents stay more recent than children.
        for block in reversed([*chain, *([head] if head is not None else [])]):
            self._lru.move_to_end(block.id)
        parts = [(b.keys, b.values) for b in chain]
        if head is not None:
            parts.append((_slice(head.keys, 0, shared), _slice(head.values, 0, shared)))
        width = len(parts[0][0])
        keys = [mx.concatenate([k[i] for k, _ in parts], axis=3) for i in range(width)]
        values = [mx.concatenate([v[i] for _, v in parts], axis=3) for i in range(width)]
        held = int(keys[0].shape[3])
        caches: LayerCaches = []
        for layer in range(keys[0].shape[0]):
            if self.kv.quantized:
                mine = tuple(k[layer] for k in keys), tuple(v[layer] for v in values)
                caches.append(quantized.row(*mine, self.kv))
                continue
            cache = KVCache()
            cache.state = (keys[0][layer], values[0][layer], held)
            caches.append(cache)
        self.hits += 1
        self.hit_tokens += held
        return held, caches

    # ------------------------------------------------------------- insertion
    def insert(
        self, tokens: Sequence[int], cache: LayerCaches, capacity: int, root: int = _ROOT
    ) -> list[int]:
        """Caches the whole blocks of `tokens` whose KV `cache` holds.

        `cache` holds the KV of `tokens[:offset]`. Blocks already cached are
        only touched; new ones may push out least recently used blocks, but
        the cache never holds more than `capacity` blocks (the room requests
        leave in the budget). Returns the ids of the blocks added, first to last.
        """
        bs = self.block_size
        whole = min(int(cache[0].offset), len(tokens)) // bs * bs
        known = self._chain(tokens, whole, root)
        start = len(known) * bs
        wanted = (whole - start) // bs
        over = len(self) + wanted - capacity
        if over > 0:
            self.evict(over, keep={b.id for b in known})
        end = start + max(min(wanted, capacity - len(self)), 0) * bs
        made: list[_Block] = []
        if end > start:
            width = len(_parts(cache[0].keys))
            keys = tuple(
                mx.stack([_parts(layer.keys)[i][..., start:end, :] for layer in cache])
                for i in range(width)
            )
            values = tuple(
                mx.stack([_parts(layer.values)[i][..., start:end, :] for layer in cache])
                for i in range(width)
            )
            parent = known[-1].id if known else root
            for at in range(start, end, bs):
                lo = at - start
                block = _Block(
                    id=next(self._ids),
                    parent=parent,
                    tokens=tuple(tokens[at : at + bs]),
                    keys=_copy(_slice(keys, lo, lo + bs)),
                    values=_copy(_slice(values, lo, lo + bs)),
                )
                made.append(block)
                parent = block.id
            mx.eval([(b.keys, b.values) for b in made])
            for block in made:
                self._index[(block.parent, block.tokens)] = block
                self._kids.setdefault(block.parent, {})[block.id] = block
                self._lru[block.id] = block
                if block.parent > _ROOT:
                    self._lru[block.parent].children += 1
                self.nbytes += block.nbytes
        # Deepest first, so parents stay more recent than their children.
        for block in reversed(known + made):
            self._lru.move_to_end(block.id)
        return [block.id for block in made]

    def discard(self, ids: Sequence[int]) -> None:
        """Drops the blocks `ids` that are still cached and now leaves, last first (a
        failed step's insertions: engine/recovery.py)."""
        for block_id in reversed(ids):
            block = self._lru.get(block_id)
            if block is not None and block.children == 0:
                self._drop(block)

    # -------------------------------------------------------------- eviction
    def evict(self, count: int, keep: set[int] | None = None) -> int:
        """Drops up to `count` least recently used leaf blocks (not in `keep`)."""
        dropped = 0
        while dropped < count:
            victim = next(
                (b for b in self._lru.values() if b.children == 0 and b.id not in (keep or ())),
                None,
            )
            if victim is None:
                break
            self._drop(victim)
            dropped += 1
        return dropped

    def _drop(self, block: _Block) -> None:
        del self._lru[block.id]
        del self._index[(block.parent, block.tokens)]
        siblings = self._kids[block.parent]
        del siblings[block.id]
        if not siblings:
            del self._kids[block.parent]
        if block.parent > _ROOT:
            self._lru[block.parent].children -= 1
        self.nbytes -= block.nbytes

    def drop_root(self, root: int) -> int:
        """Drops every block under `root` (an adapter's KV); returns how many."""
        under, frontier = [], list(self._kids.get(root, {}).values())
        while frontier:
            block = frontier.pop()
            under.append(block)
            frontier += self._kids.get(block.id, {}).values()
        for block in reversed(under):  # leaves first
            self._drop(block)
        return len(under)

    def clear(self) -> int:
        """Drops every block; returns how many there were."""
        count = len(self._lru)
        self._index.clear()
        self._kids.clear()
        self._lru.clear()
        self.nbytes = 0
        return count
