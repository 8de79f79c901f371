"""The resident adapters of one loaded model: names, pins, an LRU cap, slots.

What: `AdapterSet` loads adapters (`files.read`), keeps at most `max_loras`
of them, evicting the least recently used one that is neither pinned nor in
use when another arrives, and gives each its slot in the batched forward
(`forward.Deltas`) and its own prefix-cache root (`root`), new at every load,
so KV computed under one adapter is never found under another or under an
adapter later loaded with the same name. `in_use` (set by the runner) counts
the live requests of each adapter; `on_drop` frees a gone root's KV.
Invariants: a failed `add` changes nothing (the new adapter is read and
checked, the eviction chosen and the memory checked before anything is
dropped or kept); an adapter in use is never evicted or removed; names are
unique (the same name and path again is the adapter already loaded).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from mlx import nn

from mlx_worker_svc.core.adapters import AdapterAdded, AdapterInfo
from mlx_worker_svc.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.engine.lora import files
from mlx_worker_svc.engine.lora.forward import Deltas, stack_bytes

DEFAULT_MAX_LORAS = 8


@dataclass
class _Entry:
    weights: files.AdapterWeights
    root: int  # its prefix-cache root (negative: 0 is the base model's)
    pinned: bool = False
    load_seconds: float = 0.0


class AdapterSet:
    """One model's resident LoRA adapters (see above)."""

    def __init__(self, model: nn.Module, max_loras: int = DEFAULT_MAX_LORAS) -> None:
        self.model = model
        self.max_loras = max_loras
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.deltas = Deltas(model)
        self._roots = itertools.count(1)
        self.in_use: Callable[[], Counter[str]] = Counter
        # Frees the prefix-cache blocks of a root that is gone (set by the runner).
        self.on_drop: Callable[[int], object] = lambda _root: None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    @property
    def nbytes(self) -> int:
        """Bytes every resident adapter takes: its matrices and the batched stacks."""
        return sum(e.weights.nbytes for e in self._entries.values()) + self.deltas.nbytes

    def bytes_with(self, weights: Sequence[files.AdapterWeights]) -> int:
        return sum(w.nbytes for w in weights) + stack_bytes(list(weights))

    def add(self, name: str, path: str, room: Callable[[int], None] | None = None) -> AdapterAdded:
        """Loads an adapter (or finds it loaded with this path already).

        `room(bytes)` raises if the adapters would no longer fit (the memory check).
        """
        files.check_name(name, "AddLora.name")
        held = self._entries.get(name)
        if held is not None:
            if _same_path(held.weights.path, path):
                self._entries.move_to_end(name)
                return AdapterAdded(self.info(name), already_loaded=True)
            raise AlreadyExists(
                f"AddLora: an adapter named {clip(name)!r} is loaded already, from "
                f"{held.weights.path!r}; RemoveLora it first or choose another name"
            )
        start = time.perf_counter()
        weights = files.read(name, path, self.model)
        victim = self._victim() if len(self._entries) >= self.max_loras else None
        kept = [e.weights for n, e in self._entries.items() if n != victim] + [weights]
        if room is not None:
            room(self.bytes_with(kept) - self.nbytes)
        self.deltas.restack(kept)
        if victim is not None:
            self.on_drop(self._entries.pop(victim).root)
        root = -next(self._roots)
        self._entries[name] = _Entry(weights, root, load_seconds=time.perf_counter() - start)
        return AdapterAdded(self.info(name), evicted=victim or "")

    def _victim(self) -> str:
        users = self.in_use()
        for name, entry in self._entries.items():
            if not entry.pinned and not users[name]:
                return name
        raise ResourceExhausted(
            f"AddLora: {len(self._entries)} adapters are resident (--max-loras "
            f"{self.max_loras}) and every one is pinned or in use: remove or unpin one, or "
            "wait for its requests to finish"
        )

    def remove(self, name: str) -> str:
        """Unloads an adapter; returns its path. Refused while requests use it."""
        entry = self._need(name, "RemoveLora.name")
        users = self.in_use()[name]
        if users:
            raise FailedPrecondition(
                f"RemoveLora: adapter {clip(name)!r} is used by {users} live request"
                f"{'s' if users != 1 else ''}; finish or abort them first"
            )
        kept = [e.weights for n, e in self._entries.items() if n != name]
        self.deltas.restack(kept)
        del self._entries[name]
        self.on_drop(entry.root)
        return entry.weights.path

    def pin(self, name: str, pinned: bool) -> AdapterInfo:
        self._need(name, "PinLora.name").pinned = pinned
        return self.info(name)

    def _need(self, name: str, where: str) -> _Entry:
        if not name:
            raise InvalidArgument(f"{where} is required: a resident adapter's name")
        entry = self._entries.get(name)
        if entry is None:
            loaded = ", ".join(repr(n) for n in self._entries) or "none"
            raise NotFound(f"{where}: no adapter {clip(name)!r} is loaded (loaded: {loaded})")
        return entry

    def check(self, name: str, where: str) -> None:
        """Raises NotFound unless `name` is empty (the base model) or a resident adapter."""
        if name:
            self._need(name, where)

    def touch(self, name: str) -> None:
        """Marks an adapter used now (LRU)."""
        if name in self._entries:
            self._entries.move_to_end(name)

    def root(self, name: str) -> int:
        """The prefix-cache root of an adapter's KV (0: the base model)."""
        return self._entries[name].root if name else 0

    def slots(self, names: Sequence[str]) -> list[int]:
        """Each row's slot in the stacks (0: the base model)."""
        index = {w.name: i + 1 for i, w in enumerate(self.deltas.slots)}
        return [index[n] if n else 0 for n in names]

    def rows(self, names: Sequence[str]) -> AbstractContextManager[bool]:
        """Opens a forward's construction for rows of these adapters (forward.Deltas.rows)."""
        if not any(names):
            return nullcontext(False)
        return self.deltas.rows(self.slots(names))

    def info(self, name: str) -> AdapterInfo:
        entry = self._entries[name]
        w = entry.weights
        share = self.deltas.nbytes // max(len(self._entries), 1)
        return AdapterInfo(
            name=name,
            path=w.path,
            rank=w.rank,
            scale=w.scale,
            nbytes=w.nbytes + share,
            pinned=entry.pinned,
            num_requests=self.in_use()[name],
            num_modules=len(w.a),
            load_seconds=entry.load_seconds,
        )

    def infos(self) -> list[AdapterInfo]:
        return [self.info(name) for name in sorted(self._entries)]

    def specs(self) -> list[tuple[str, str, bool]]:
        """(name, path, pinned) of every adapter, to load them again (WakeUp)."""
        return [(n, e.weights.path, e.pinned) for n, e in self._entries.items()]


def check_adapter(adapters: AdapterSet | None, name: str, where: str) -> None:
    """Raises NotFound unless `name` is empty (the base model) or a resident adapter."""
    if not name:
        return
    if adapters is None:
        raise NotFound(f"{where}: no adapter {clip(name)!r} is loaded (loaded: none)")
    adapters.check(name, where)


def _same_path(held: str, asked: str) -> bool:
    try:
        return Path(asked).expanduser().resolve() == Path(held)
    except OSError:
        return False
