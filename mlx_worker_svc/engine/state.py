"""The runner's state: every request, the decode batch, the KV budget and the prefix cache.

One `EngineState` per runner, passed to the parts that read or change it
(admission, prefill, the step journal and the runner itself), so each part
can be built and driven on its own. It holds data only; the rules live in
those parts. Invariants: a request's KV is in exactly one place (its
`Sequence.cache`, a row of `batch`, or nowhere while preempted or lost); a
key is in `recently_finished` only once freed; `step` is set exactly while
a step runs, and `reserved` is non-empty only then. Readers on other threads
(CheckHealth, metrics) copy `seqs` before iterating it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from mlx_worker_svc.engine.cache.batch import DecodeBatch
from mlx_worker_svc.engine.cache.prefix_cache import PrefixCache
from mlx_worker_svc.engine.lora.registry import AdapterSet
from mlx_worker_svc.engine.memory.kv_budget import KVBudget
from mlx_worker_svc.engine.sequence import RequestKey, Sequence


@dataclass
class StepMarks:
    """What the running step did that its journal cannot snapshot (engine/recovery.py)."""

    freed: list[RequestKey] = field(default_factory=list)  # requests the step freed
    touched: set[RequestKey] = field(default_factory=set)  # requests whose KV it prefilled
    decoding: bool = False  # whether the batched decode forward began
    cached: list[int] = field(default_factory=list)  # prefix-cache blocks it added


@dataclass
class EngineState:
    budget: KVBudget  # the blocks InitCache set, requests and prefix cache together
    prefix: PrefixCache | None  # None: prefix caching off
    seqs: dict[RequestKey, Sequence] = field(default_factory=dict)  # every live request
    batch: DecodeBatch[RequestKey] = field(default_factory=DecodeBatch)  # decoding rows
    # Requests freed lately, so that naming one in finished_req_ids is no error.
    recently_finished: OrderedDict[RequestKey, None] = field(default_factory=OrderedDict)
    # The blocks each request holds at the end of the running step (a request
    # leaving it mid-step gives its share back).
    reserved: dict[RequestKey, int] = field(default_factory=dict)
    step: StepMarks | None = None  # set while a step runs
    adapters: AdapterSet | None = None  # the model's LoRA adapters (None: a bare state)

    def root(self, adapter: str) -> int:
        """The prefix-cache root of a request's adapter (0: the base model)."""
        return self.adapters.root(adapter) if adapter and self.adapters is not None else 0

    def request_blocks(self, *, leaving: RequestKey | None = None) -> int:
        """Blocks the requests' KV takes now (preempted requests hold none), but for
        the request `leaving` (being freed or preempted)."""
        # A copy first (one C call, so atomic under the GIL): CheckHealth and the
        # metrics endpoint read this from their own threads while steps run.
        seqs = list(self.seqs.values())
        return self.budget.used(
            s.num_computed for s in seqs if not s.preempted and s.key != leaving
        )
