"""Where a request's KV goes when it leaves the batch: into the prefix cache, or nowhere.

`KVRelease` holds the rules the runner applies when a request finishes, is
freed or preempted, and when a step reserves its blocks: a request's whole
blocks go to the prefix cache (when it is on, the KV was not lost, and there
is room), and the cache never takes blocks a running step's requests need.
During a step, `state.reserved` holds the blocks each request has at the end
of the step (`reserve`), so an insertion never takes room a later forward of
the same step needs; blocks the step adds are noted in `state.step.cached`,
which a failed step takes out again (engine/recovery.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_worker_svc.engine.sequence import RequestKey, Sequence, Work
from mlx_worker_svc.engine.state import EngineState

# The KV tokens each request holds after a step (Admission.projected).
Projected = Callable[[Work], dict[RequestKey, int]]


class KVRelease:
    def __init__(self, state: EngineState, projected: Projected) -> None:
        self.state = state
        self._projected = projected

    def capacity(self, leaving: RequestKey | None = None) -> int:
        """Blocks the prefix cache may hold now without crowding out requests.

        The blocks of a request `leaving` (finished or preempted) count as
        free: its own KV may fill them.
        """
        state = self.state
        requests = max(state.request_blocks(leaving=leaving), sum(state.reserved.values()))
        return max(state.budget.num_blocks - requests, 0)

    def release(self, seq: Sequence, keep: bool) -> None:
        """Drops a request's KV, giving its whole blocks to the prefix cache if `keep`."""
        state = self.state
        keep = keep and state.prefix is not None and not seq.kv_lost
        state.reserved.pop(seq.key, None)  # it ends this step holding nothing
        capacity = self.capacity(leaving=seq.key)
        keep = keep and seq.num_computed >= state.budget.block_size and capacity > 0
        cache = seq.cache
        if seq.key in state.batch:
            if keep:
                cache = state.batch.extract({seq.key})[seq.key]
            else:
                state.batch.remove({seq.key})
        seq.cache = None
        if keep and cache is not None:
            self.to_prefix(seq, cache, capacity)

    def preempt(self, seq: Sequence) -> None:
        """Takes a request's KV (to the prefix cache where it fits); it recomputes later."""
        self.release(seq, True)
        seq.num_computed = 0
        seq.preempted, seq.kv_lost = True, False

    def to_prefix(self, seq: Sequence, cache: list[Any], capacity: int) -> None:
        """Caches the whole blocks of `seq`'s KV `cache`, at most `capacity` in all."""
        state = self.state
        if state.prefix is not None:
            added = state.prefix.insert(seq.tokens, cache, capacity, state.root(seq.adapter))
            if state.step is not None:
                state.step.cached += added

    def reserve(self, work: Work) -> None:
        """Reserves each request's blocks at the end of `work` and evicts the prefix blocks
        that would crowd them out (nothing to do, and nothing computed, without a prefix
        cache)."""
        state = self.state
        if state.prefix is None:
            return
        projected = self._projected(work)
        state.reserved = {key: state.budget.blocks_for(n) for key, n in projected.items()}
        excess = sum(state.reserved.values()) + len(state.prefix) - state.budget.num_blocks
        if excess > 0:
            state.prefix.evict(excess)
