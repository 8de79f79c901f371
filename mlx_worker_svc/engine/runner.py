"""The model runner: per-request state, and running one validated step.

The runner owns every request's `Sequence`, the decode batch and the KV
budget. `plan()` validates a scheduler step without changing anything;
`run()` applies it: removals, additions, private prefill chunks, then ONE
batched forward for every request that samples in this step. Requests from
Generate (Origin.GENERATE) live beside Execute's in their own id space and are
scheduled by `internal_work()`, so both kinds share the same forward passes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_worker_svc.domain import (
    KVUsage,
    Origin,
    RequestOutput,
    SamplingParams,
    StepPlan,
    StepTimings,
    TokenLogprobs,
)
from mlx_worker_svc.engine.batch import DecodeBatch
from mlx_worker_svc.engine.kv_budget import KVBudget
from mlx_worker_svc.engine.loader import LoadedModel
from mlx_worker_svc.engine.planning import Limits, check_prompt, check_sampling, plan_step
from mlx_worker_svc.engine.sampling import RequestSampler, prompt_logprobs, sample_rows
from mlx_worker_svc.engine.sequence import RequestKey, Sequence, Work
from mlx_worker_svc.errors import InvalidArgument, ResourceExhausted

# How many finished request ids are remembered, so that a scheduler naming a
# request the worker already finished (EOS) in finished_req_ids is not an error.
_REMEMBER_FINISHED = 65536
# Longest forward a prefill chunk runs at once, like mlx-lm's prefill_step_size.
PREFILL_STEP = 2048


@dataclass
class StepOutcome:
    outputs: dict[RequestKey, RequestOutput]
    timings: StepTimings


class ModelRunner:
    """Runs validated steps over one loaded model."""

    def __init__(self, loaded: LoadedModel, budget: KVBudget) -> None:
        self.model = loaded.model
        self.info = loaded.info
        self.limits = Limits(loaded.info.vocab_size, loaded.info.max_context_length)
        self.eos_ids = frozenset(loaded.info.eos_token_ids)
        self.budget = budget
        self.seqs: dict[RequestKey, Sequence] = {}
        self.batch: DecodeBatch[RequestKey] = DecodeBatch()
        self._finished: OrderedDict[RequestKey, None] = OrderedDict()

    # ----------------------------------------------------------------- views
    def kv_usage(self) -> KVUsage:
        return self.budget.usage(s.num_computed for s in self.seqs.values() if not s.preempted)

    def count(self, origin: Origin | None = None) -> tuple[int, int]:
        """(running, preempted) requests, optionally of one origin."""
        running = preempted = 0
        for key, seq in self.seqs.items():
            if origin is not None and key[0] is not origin:
                continue
            if seq.preempted:
                preempted += 1
            else:
                running += 1
        return running, preempted

    def has(self, origin: Origin) -> bool:
        return any(key[0] is origin for key in self.seqs)

    # ------------------------------------------------------------ validation
    def plan(self, plan: StepPlan) -> Work:
        """Validates a scheduler step (raises; changes nothing)."""
        work = plan_step(plan, self.seqs, self._finished, self.limits)
        self.budget.check(self._projected(work).values(), f"step {plan.step_id}")
        return work

    def _projected(self, work: Work) -> dict[RequestKey, int]:
        gone = set(work.finished) | set(work.preempted)
        tokens = {
            key: seq.num_computed
            for key, seq in self.seqs.items()
            if key not in gone and not seq.preempted
        }
        for new in work.new:
            tokens[new.key] = 0
        for key, _, resumed in work.appends:
            if resumed:
                tokens[key] = 0
        for key, count in work.scheduled.items():
            tokens[key] = tokens.get(key, 0) + count
        return tokens

    def add_generate(self, req_id: str, prompt: tuple[int, ...], params: SamplingParams) -> None:
        """Registers a Generate request; the engine schedules it from now on."""
        key = (Origin.GENERATE, req_id)
        if key in self.seqs:
            raise InvalidArgument(f"request_id {req_id!r} is already running")
        check_prompt(prompt, "prompt", self.limits)
        check_sampling(params, "sampling_params", self.limits)
        if self.budget.blocks_for(len(prompt) + 1) > self.budget.num_blocks:
            raise ResourceExhausted(
                f"the prompt ({len(prompt)} tokens) does not fit the KV budget of "
                f"{self.budget.num_blocks} blocks of {self.budget.block_size} tokens"
            )
        self.seqs[key] = self._new_sequence(key, prompt, params)

    def internal_work(self, prefill_chunk: int, base: Work | None = None) -> tuple[Work, bool]:
        """Schedules every Generate request that fits the KV budget beside `base`.

        Returns the work and whether some Generate request is starved (none
        could be scheduled while some wait).
        """
        base = base or Work()
        projected = self._projected(base)
        used = sum(self.budget.blocks_for(t) for t in projected.values())
        work = Work()
        waiting = False
        for key, seq in self.seqs.items():
            if key[0] is not Origin.GENERATE or key in base.scheduled:
                continue
            count = min(len(seq.tokens) - seq.num_computed, prefill_chunk)
            before = projected.get(key, seq.num_computed)
            extra = self.budget.blocks_for(before + count) - self.budget.blocks_for(before)
            if used + extra > self.budget.num_blocks:
                waiting = True
                continue
            used += extra
            work.scheduled[key] = count
        return work, waiting and not work.scheduled

    # ------------------------------------------------------------- mutation
    def _new_sequence(
        self, key: RequestKey, prompt: tuple[int, ...], params: SamplingParams
    ) -> Sequence:
        sampler = RequestSampler(params, eos_ids=self.eos_ids, vocab_size=self.limits.vocab_size)
        return Sequence(
            key=key, tokens=list(prompt), prompt_len=len(prompt), params=params, sampler=sampler
        )

    def free(self, key: RequestKey) -> None:
        """Forgets a request and frees its KV (no error if it is unknown)."""
        if key in self.batch:
            self.batch.remove({key})
        if self.seqs.pop(key, None) is not None:
            self._finished[key] = None
            while len(self._finished) > _REMEMBER_FINISHED:
                self._finished.popitem(last=False)

    def _preempt(self, key: RequestKey) -> None:
        if key in self.batch:
            self.batch.remove({key})
        seq = self.seqs[key]
        seq.cache = None
        seq.num_computed = 0
        seq.preempted = True

    def run(self, work: Work) -> StepOutcome:
        """Applies a validated step and computes it."""
        start = time.perf_counter_ns()
        for key in work.finished:
            self.free(key)
        for key in work.preempted:
            self._preempt(key)
        for new in work.new:
            self.seqs[new.key] = self._new_sequence(new.key, new.prompt, new.params)
        for key, tokens, resumed in work.appends:
            seq = self.seqs[key]
            seq.tokens.extend(tokens)
            if resumed:
                seq.preempted = False
        outputs = {key: RequestOutput(req_id=key[1]) for key in work.touched}
        forward_start = time.perf_counter_ns()
        sampling: list[RequestKey] = []
        num_tokens = 0
        for key, count in work.scheduled.items():
            seq = self.seqs[key]
            end = seq.num_computed + count
            num_tokens += count
            samples = end == len(seq.tokens)
            private_end = end - 1 if samples else end
            if private_end > seq.num_computed:
                scored = self._prefill(seq, private_end)
                if scored:
                    outputs[key].prompt_logprobs.extend(scored)
            if samples:
                sampling.append(key)
        finished = self._decode(sampling, outputs) if sampling else []
        forward_ns = time.perf_counter_ns() - forward_start
        for key, output in outputs.items():
            live = self.seqs.get(key)
            if live is not None:
                output.num_computed_tokens = live.num_computed
        for key in finished:
            self.free(key)
        timings = StepTimings(
            total_ns=time.perf_counter_ns() - start,
            forward_ns=forward_ns,
            num_tokens=num_tokens,
            decode_batch_size=len(sampling),
        )
        return StepOutcome(outputs=outputs, timings=timings)

    def _prefill(self, seq: Sequence, end: int) -> list[TokenLogprobs]:
        """Computes KV for tokens [num_computed, end) into the request's private cache.

        Returns the prompt logprobs these positions produce, when the request
        asked for them (the logits at position i score prompt token i + 1).
        """
        if seq.key in self.batch:
            seq.cache = self.batch.extract({seq.key})[seq.key]
        if seq.cache is None:
            seq.cache = make_prompt_cache(self.model)
        scored: list[TokenLogprobs] = []
        want = seq.params.prompt_logprobs
        while seq.num_computed < end:
            start, stop = seq.num_computed, min(end, seq.num_computed + PREFILL_STEP)
            chunk = mx.array(seq.tokens[start:stop], dtype=mx.uint32)[None]
            logits = self.model(chunk, cache=seq.cache)
            # Score prompt tokens once: not again when a preempted request recomputes.
            last = min(stop, seq.prompt_len - 1)
            first = max(start, seq.prompt_scored)
            if want is not None and first < last:
                rows = logits[0, first - start : last - start]
                scored += prompt_logprobs(rows, seq.tokens[first + 1 : last + 1], want)
                seq.prompt_scored = last
            mx.eval([c.state for c in seq.cache])
            seq.num_computed = stop
        return scored

    def _decode(
        self, keys: list[RequestKey], outputs: dict[RequestKey, RequestOutput]
    ) -> list[RequestKey]:
        """One batched forward for `keys` (their last token each), then sampling."""
        wanted = set(keys)
        stray = {key for key in self.batch.keys if key not in wanted}
        for key, cache in self.batch.extract(stray).items():
            self.seqs[key].cache = cache
        joining: list[tuple[RequestKey, list[Any]]] = []
        for key in keys:
            if key not in self.batch:
                seq = self.seqs[key]
                joining.append((key, seq.cache or make_prompt_cache(self.model)))
                seq.cache = None
        self.batch.join(joining)
        rows = [self.seqs[key] for key in self.batch.keys]
        logits = self.batch.forward(self.model, [seq.tokens[-1] for seq in rows])
        tokens, infos = sample_rows(
            logits, [s.sampler for s in rows], [(s.tokens, s.prompt_len) for s in rows]
        )
        finished: list[RequestKey] = []
        for seq, token, info in zip(rows, tokens, infos, strict=True):
            seq.num_computed = len(seq.tokens)
            seq.tokens.append(token)
            output = outputs.setdefault(seq.key, RequestOutput(req_id=seq.key[1]))
            output.sampled_token_ids.append(token)
            if info is not None:
                output.logprobs.append(info)
            reason = seq.finish_reason(self.eos_ids, self.limits.max_context)
            if reason is not None:
                output.finish_reason = reason
                output.num_computed_tokens = seq.num_computed
                finished.append(seq.key)
        if finished:
            self.batch.remove(set(finished))
        rows = [self.seqs[key] for key in self.batch.keys]
        self.batch.prefetch(self.model, [seq.tokens[-1] for seq in rows])
        return finished

    def abort_all(self, origin: Origin | None = None) -> list[RequestKey]:
        """Frees every request (of one origin); returns their keys."""
        keys = [k for k in self.seqs if origin is None or k[0] is origin]
        for key in keys:
            self.free(key)
        return keys
