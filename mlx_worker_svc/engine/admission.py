"""Admission: what a step would need, checked before it changes anything.

`Admission` reads an `EngineState` (requests, KV budget, prefix cache) and
answers three questions about a step: the KV blocks every request holds
after it (prefix-cache hits included), the memory its largest forward needs
(against the `MemoryGuard`), and which Generate requests fit beside a
scheduler's step. Invariant: nothing here changes a request; the only state
it changes is the prefix cache, whose blocks it may evict to make room in
memory (evictable by contract: they never refuse a step).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq

import mlx.core as mx

from mlx_worker_svc.core.domain import Origin, SamplingParams, StepPlan
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.engine.grammar_mask import plan_structured
from mlx_worker_svc.engine.lora.registry import check_adapter
from mlx_worker_svc.engine.memory.guard import MemoryGuard
from mlx_worker_svc.engine.planning import Limits, plan_step
from mlx_worker_svc.engine.sequence import RequestKey, Work
from mlx_worker_svc.engine.state import EngineState
from mlx_worker_svc.engine.structured import GrammarCompiler

# Per scheduled request: (tokens computed before the step, computed after it, length).
Spans = dict[RequestKey, tuple[int, int, int]]

# Longest forward a prefill chunk runs at once, like mlx-lm's prefill_step_size.
PREFILL_STEP = 2048


class Admission:
    """The checks a step passes before it runs, over one runner's state."""

    def __init__(
        self,
        state: EngineState,
        limits: Limits,
        guard: MemoryGuard,
        grammars: GrammarCompiler,
        *,
        batch_prefill: bool,
    ) -> None:
        self.state = state
        self.limits = limits
        self.guard = guard
        self.grammars = grammars
        # Whether equally long prompts prefill together (batch.batchable).
        self.batch_prefill = batch_prefill

    def plan(self, plan: StepPlan) -> Work:
        """Validates a scheduler step (raises; changes nothing but the prefix cache)."""
        state = self.state
        work = plan_step(plan, state.seqs, state.recently_finished, self.limits)
        for i, new in enumerate(work.new):
            where = f"new_requests[{i}] (req_id {clip(new.key[1])!r}).lora_name"
            check_adapter(state.adapters, new.adapter, where)
        spans = self._spans(work)  # once: the checks below all read it
        plan_structured(
            plan, work, state.seqs, lambda key: spans[key][1] == spans[key][2], self.grammars
        )
        what = f"step {plan.step_id}"
        after = self.projected(work, spans)
        state.budget.check(after.values(), what, lambda: self._growth(after))
        self.check_memory(work, what, spans)
        return work

    def hit(self, tokens: Seq[int], params: SamplingParams, adapter: str = "") -> int:
        """Tokens a fresh request (of `adapter`) would take from the prefix cache (read-only)."""
        prefix = self.state.prefix
        if prefix is None or params.prompt_logprobs is not None:
            return 0
        return prefix.match(tokens, len(tokens) - 1, self.state.root(adapter))

    def _spans(self, work: Work) -> Spans:
        """(computed before, end, length) of each request after `work`'s changes."""
        seqs = self.state.seqs
        lengths = {new.key: len(new.prompt) for new in work.new}
        starts = {new.key: self.hit(new.prompt, new.params, new.adapter) for new in work.new}
        for key, tokens, resumed in work.appends:
            held = seqs[key]
            lengths[key] = len(held.tokens) + len(tokens)
            if resumed:
                starts[key] = self.hit([*held.tokens, *tokens], held.params, held.adapter)
        spans = {}
        for key, count in work.scheduled.items():
            seq = seqs.get(key)
            length = lengths.get(key, len(seq.tokens) if seq else 0)
            if key not in starts and seq is not None:
                fresh = seq.fresh and not seq.preempted
                starts[key] = (
                    self.hit(seq.tokens, seq.params, seq.adapter) if fresh else seq.num_computed
                )
            start = starts[key]
            spans[key] = (start, min(start + count, length), length)
        return spans

    def projected(self, work: Work, spans: Spans | None = None) -> dict[RequestKey, int]:
        """KV tokens each request holds after `work` (at most, with its decode steps).

        `spans` is `_spans(work)` where the caller has it already.
        """
        gone = set(work.finished) | set(work.preempted)
        tokens = {
            key: seq.num_computed
            for key, seq in self.state.seqs.items()
            if key not in gone and not seq.preempted
        }
        for new in work.new:
            tokens[new.key] = 0
        for key, _, resumed in work.appends:
            if resumed:
                tokens[key] = 0
        more = work.decode_steps - 1  # each sampling request's further decode steps
        for key, (_, end, length) in (spans or self._spans(work)).items():
            tokens[key] = end + more if end == length else end
        return tokens

    def _growth(self, after: Mapping[RequestKey, int]) -> str:
        """Which requests a refused step would give more blocks, the most first (at most 4)."""
        budget, seqs = self.state.budget, self.state.seqs
        grows = []
        for key, tokens in after.items():
            held = seqs[key].num_computed if key in seqs and not seqs[key].preempted else 0
            more = budget.blocks_for(tokens) - budget.blocks_for(held)
            if more > 0:
                grows.append((more, key[1]))
        grows.sort(key=lambda g: -g[0])
        shown = ", ".join(f"{n} for req_id {clip(r)!r}" for n, r in grows[:4])
        others = len(grows) - 4
        rest = f" and {others} more request{'s' if others > 1 else ''}" if others > 0 else ""
        return f" (it adds {sum(n for n, _ in grows)}: {shown}{rest})" if grows else ""

    def check_memory(self, work: Work, what: str, spans: Spans | None = None) -> None:
        """Refuses `work` if its largest forward would not fit under the memory limit.

        `spans` is `_spans(work)` where the caller has it already.
        """
        forwards: list[tuple[int, int]] = []
        decode_rows, decode_context = 0, 0
        whole: dict[RequestKey, int] = {}  # prompts prefilled from token 0 (batchable)
        params = {new.key: new.params for new in work.new}
        for key, (start, end, length) in (spans or self._spans(work)).items():
            seq = self.state.seqs.get(key)
            if seq is not None and seq.kv_lost:
                forwards += _chunks(0, seq.num_computed)
            samples = end == length
            private = end - 1 if samples else end
            asked = params[key] if seq is None else seq.params
            if self.batch_prefill and start == 0 and asked.prompt_logprobs is None:
                whole[key] = private
            elif private > start:  # a decode row computes no prompt chunk
                forwards += _chunks(start, private)
            if samples:
                decode_rows += 1
                decode_context = max(decode_context, end + work.decode_steps - 1)
        together = prefill_groups(whole)
        for group in together:
            tokens = whole[group[0]]
            forwards.append((tokens * len(group), tokens))
        alone = set(whole).difference(*together)
        forwards += [chunk for key in alone for chunk in _chunks(0, whole[key])]
        if decode_rows:
            forwards.append((decode_rows, decode_context))
        prefix = self.state.prefix
        reclaimable = prefix.nbytes if prefix is not None else 0
        self.guard.check(self.guard.estimate(forwards), what, self._evict_bytes, reclaimable)

    def _evict_bytes(self, wanted: int) -> int:
        prefix = self.state.prefix
        freed = 0
        while prefix is not None and freed < wanted and len(prefix):
            before = prefix.nbytes
            prefix.evict(1)
            freed += before - prefix.nbytes
        mx.clear_cache()
        return freed

    def internal_work(self, prefill_chunk: int, base: Work | None = None) -> tuple[Work, bool]:
        """Schedules every Generate request that fits the KV budget beside `base`.

        Returns the work and whether some Generate request is starved (none
        could be scheduled while some wait).
        """
        base = base or Work()
        budget = self.state.budget
        projected = self.projected(base)
        used = budget.used(projected.values())
        work = Work()
        waiting = False
        for key, seq in self.state.seqs.items():
            if key[0] is not Origin.GENERATE or key in base.scheduled:
                continue
            before = (
                self.hit(seq.tokens, seq.params, seq.adapter) if seq.fresh else seq.num_computed
            )
            count = min(len(seq.tokens) - before, prefill_chunk)
            # Beside a multi-step Execute, a request that samples decodes its steps too.
            more = base.decode_steps - 1 if before + count == len(seq.tokens) else 0
            extra = budget.blocks_for(before + count + more) - budget.blocks_for(
                projected.get(key, seq.num_computed)
            )
            if used + extra > budget.num_blocks:
                waiting = True
                continue
            used += extra
            work.scheduled[key] = count
        return work, waiting and not work.scheduled


def prefill_groups(ends: Mapping[RequestKey, int]) -> list[list[RequestKey]]:
    """Which prompts prefill together: `ends` are the tokens each prefills from token 0.

    Prompts of the same length (at most PREFILL_STEP tokens) form groups of
    up to PREFILL_STEP tokens in all, in the order given; a group has two
    prompts or more, and the others prefill alone.
    """
    by_length: dict[int, list[RequestKey]] = {}
    for key, tokens in ends.items():
        if 0 < tokens <= PREFILL_STEP:
            by_length.setdefault(tokens, []).append(key)
    groups = []
    for tokens, keys in by_length.items():
        size = PREFILL_STEP // tokens
        groups += [keys[i : i + size] for i in range(0, len(keys), size)]
    return [group for group in groups if len(group) > 1]


def _chunks(start: int, end: int) -> list[tuple[int, int]]:
    """The prefill forwards over tokens [start, end): (tokens, context) each."""
    return [
        (min(PREFILL_STEP, end - at), min(at + PREFILL_STEP, end))
        for at in range(start, end, PREFILL_STEP)
    ]
