"""All-or-nothing steps: what a step changed, and how to put it back.

Before a step runs, `StepJournal.begin` records the Python-side state of
every request the step can touch (cheap: counts, flags, references) and puts
its `StepMarks` in the `EngineState`, where the running step marks what it
frees and which KV it writes. If the step fails, an MLX allocation in the
middle of a forward for instance, `roll_back` restores that state, so the
scheduler sees exactly the worker it had before the step.

KV cannot be copied cheaply before each step, so it is not restored: a
request whose cache the failed step may have written (a prefill it ran, or
every row of the decode batch once the batched forward began) keeps its
tokens and `num_computed` but has its KV marked lost; the runner rebuilds it
(from the prefix cache and a prefill) the next time the request computes.
A decode row the step took out of the batch before its forward keeps the KV
it was taken out with, and the prefix-cache blocks the step added
(`StepMarks.cached`) are dropped again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx

from mlx_worker_svc.engine.sequence import RequestKey, Sequence, Work
from mlx_worker_svc.engine.state import EngineState, StepMarks


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
    marks: StepMarks  # filled in by the step while it runs (state.step)
    batch: frozenset[RequestKey]  # the decode batch's rows before the step

    @classmethod
    def begin(cls, state: EngineState, work: Work) -> StepJournal:
        """Records what `work` can change and starts marking (`state.step`)."""
        keys = {*work.finished, *work.preempted, *work.scheduled, *state.batch.keys}
        keys.update(key for key, _, _ in work.appends)
        saved = [_Saved.of(state.seqs[key]) for key in keys if key in state.seqs]
        state.step = StepMarks()
        batch = frozenset(state.batch.keys)
        return cls(seqs=dict(state.seqs), saved=saved, marks=state.step, batch=batch)

    def roll_back(self, state: EngineState) -> None:
        """Puts every request back as it was before the step; lost KV is marked."""
        # Rows the step's decode took out of the batch before its forward (not in the
        # step) hold their own KV, untouched: they keep it.
        kept = {
            key: seq.cache
            for key in self.batch - self.marks.touched
            if (seq := state.seqs.get(key)) is not None and seq.cache is not None
        }
        state.seqs = self.seqs
        for saved in self.saved:
            saved.restore()
        for key in self.marks.freed:
            state.recently_finished.pop(key, None)
        if state.prefix is not None:
            state.prefix.discard(self.marks.cached)
        lost = set(self.marks.touched)
        if self.marks.decoding:
            lost.update(state.batch.keys)
            state.batch.clear()  # its rows' adapters stay in scope
        for key in lost:
            seq = state.seqs.get(key)
            if seq is not None:
                seq.cache = None
        for key, cache in kept.items():
            if key not in lost and key in state.seqs:
                state.seqs[key].cache = cache
        in_batch = set(state.batch.keys)
        for stale in in_batch - set(state.seqs):
            state.batch.remove({stale})
        for key, seq in state.seqs.items():
            if key in lost and key in in_batch:
                state.batch.remove({key})
            has_kv = seq.cache is not None or key in state.batch
            if not seq.preempted and seq.num_computed > 0 and not has_kv:
                seq.kv_lost = True
        mx.clear_cache()
