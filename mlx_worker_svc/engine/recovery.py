"""All-or-nothing steps: what a step changed, and how to put it back.

Before a step runs, the runner records the Python-side state of every request
the step can touch (cheap: counts, flags, references). If the step fails, an
MLX allocation in the middle of a forward for instance, `roll_back` restores
that state, so the scheduler sees exactly the worker it had before the step.

KV cannot be copied cheaply before each step, so it is not restored: a
request whose cache the failed step may have written (a prefill it ran, or
every row of the decode batch once the batched forward began) keeps its
tokens and `num_computed` but has its KV marked lost; the runner rebuilds it
(from the prefix cache and a prefill) the next time the request computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx

from mlx_worker_svc.engine.cache.batch import DecodeBatch
from mlx_worker_svc.engine.sequence import RequestKey, Sequence, Work

if TYPE_CHECKING:
    from mlx_worker_svc.engine.runner import ModelRunner


class _Saved(NamedTuple):
    """A request's Python-side state before a step (a tuple: this runs per request per step)."""

    seq: Sequence
    num_tokens: int
    num_computed: int
    preempted: bool
    prompt_scored: int
    fresh: bool
    kv_lost: bool
    cache: list[Any] | None
    rng: mx.array | None

    @classmethod
    def of(cls, seq: Sequence) -> _Saved:
        return cls(
            seq,
            len(seq.tokens),
            seq.num_computed,
            seq.preempted,
            seq.prompt_scored,
            seq.fresh,
            seq.kv_lost,
            seq.cache,
            seq.sampler.rng_state(),
        )

    def restore(self) -> None:
        seq = self.seq
        del seq.tokens[self.num_tokens :]
        seq.num_computed = self.num_computed
        seq.preempted = self.preempted
        seq.prompt_scored = self.prompt_scored
        seq.fresh = self.fresh
        seq.kv_lost = self.kv_lost
        seq.cache = self.cache
        seq.sampler.restore_rng(self.rng)


@dataclass
class StepJournal:
    seqs: dict[RequestKey, Sequence]
    saved: list[_Saved]
    # Filled in while the step runs.
    freed: list[RequestKey] = field(default_factory=list)
    touched: set[RequestKey] = field(default_factory=set)
    decoding: bool = False

    @classmethod
    def begin(cls, runner: ModelRunner, work: Work) -> StepJournal:
        keys = {*work.finished, *work.preempted, *work.scheduled, *runner.batch.keys}
        keys.update(key for key, _, _ in work.appends)
        saved = [_Saved.of(runner.seqs[key]) for key in keys if key in runner.seqs]
        return cls(seqs=dict(runner.seqs), saved=saved)

    def roll_back(self, runner: ModelRunner) -> None:
        runner.seqs = self.seqs
        for saved in self.saved:
            saved.restore()
        for key in self.freed:
            runner.recently_finished.pop(key, None)
        lost = set(self.touched)
        if self.decoding:
            lost.update(runner.batch.keys)
            runner.batch = DecodeBatch()
        for key in lost:
            seq = runner.seqs.get(key)
            if seq is not None:
                seq.cache = None
        in_batch = set(runner.batch.keys)
        for stale in in_batch - set(runner.seqs):
            runner.batch.remove({stale})
        for key, seq in runner.seqs.items():
            if key in lost and key in in_batch:
                runner.batch.remove({key})
            has_kv = seq.cache is not None or key in runner.batch
            if not seq.preempted and seq.num_computed > 0 and not has_kv:
                seq.kv_lost = True
        mx.clear_cache()
