"""The soak's workload and the scheduler loop that drives a worker through it (soak.py).

`make_workload` builds requests of mixed lengths, some sharing prefixes, some to
be cancelled or preempted; `Scheduler` runs them through Execute with continuous
batching and chunked prefill, and checks every response against what it expects
(computed-token counts, prefix-cache hits in whole blocks, one sampled token
exactly when a sequence is complete), raising `WorkerMisbehaved` otherwise.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from benchmarks.common import BLOCK_SIZE, Worker
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


class WorkerMisbehaved(RuntimeError):
    """A response disagreed with what the scheduler sent; the run stops."""


@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: pb.SamplingParams
    shared: bool
    # Computed-token counts at which the scheduler cancels / preempts it (None: never).
    cancel_at: int | None = None
    preempt_at: int | None = None
    output: list[int] = field(default_factory=list)
    computed: int = 0
    known: bool = False  # the worker has seen its NewRequest
    resuming: bool = False  # the next step resumes it from preemption
    resume_step: int = 0

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass
class Counts:
    steps: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    cancelled_mid_flight: int = 0
    preempted: int = 0
    resumed: int = 0
    prefix_hits: int = 0
    cached_tokens: int = 0
    resumed_hits: int = 0
    generated_tokens: int = 0
    computed_tokens: int = 0
    # After every step (in-process Worker.kv_usage()): how full the KV budget got, and
    # prefix-cache blocks that disappeared between two steps (evicted; nothing resets it).
    max_used_blocks: int = 0
    max_prefix_blocks: int = 0
    steps_budget_full: int = 0
    prefix_blocks_evicted: int = 0
    first_eviction_request: int | None = None
    last_prefix_blocks: int = 0


# ------------------------------------------------------------------ workload
def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    """Seeded: mixed prompt lengths and max_tokens, shared prefixes, cancel/preempt marks."""
    rng = random.Random(args.seed)
    low, high = args.min_prompt, args.max_prompt

    def tokens(count: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(count)]

    pool = [tokens(rng.randrange(2, high // BLOCK_SIZE) * BLOCK_SIZE) for _ in range(8)]
    out: list[Request] = []
    for i in range(args.requests):
        shared = rng.random() < args.shared_frac
        if shared:
            prefix = rng.choice(pool)
            prompt = prefix + tokens(rng.randint(max(1, low - len(prefix)), high - len(prefix)))
        else:
            prompt = tokens(rng.randint(low, high))
        max_tokens = rng.randint(args.min_tokens, args.max_tokens)
        if rng.random() < 0.5:
            params = pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = pb.SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=max_tokens)
        request = Request(rid=f"soak-{i}", prompt=prompt, params=params, shared=shared)
        # The last computed count before it finishes is len(prompt) + max_tokens - 1.
        last_live = len(prompt) + max_tokens - 2
        roll = rng.random()
        if last_live >= 1 and roll < args.cancel_frac:
            request.cancel_at = rng.randint(1, last_live)
        elif last_live >= 1 and roll < args.cancel_frac + args.preempt_frac:
            request.preempt_at = rng.randint(1, last_live)
        out.append(request)
    return out


def distinct_blocks(prompts: list[list[int]]) -> int:
    """Whole prompt blocks with distinct prefixes: what a prefix cache would have to hold."""
    seen: set[tuple[int, ...]] = set()
    for prompt in prompts:
        for end in range(BLOCK_SIZE, len(prompt) + 1, BLOCK_SIZE):
            seen.add(tuple(prompt[:end]))
    return len(seen)


# ----------------------------------------------------------------- scheduler
class Scheduler:
    """Continuous batching over Execute with chunked prefill, cancellation and preemption."""

    def __init__(self, worker: Worker, args: argparse.Namespace, workload: list[Request]) -> None:
        self.worker = worker
        self.args = args
        self.rng = random.Random(args.seed + 1)
        self.waiting = deque(workload)
        self.running: list[Request] = []
        self.preempted: list[Request] = []
        self.admitted = 0
        self.counts = Counts()

    @property
    def busy(self) -> bool:
        return bool(self.running or self.preempted)

    def drain_until(self, admitted: int) -> None:
        """Admits up to `admitted` requests in all and steps until every one has finished."""
        while self.busy or (self.waiting and self.admitted < admitted):
            self.step(admitted)

    def step(self, admit_limit: int) -> None:
        step_id = self.counts.steps
        finished_ids: list[str] = []
        preempted_ids: list[str] = []
        for req in list(self.running):
            if req.cancel_at is not None and req.computed >= req.cancel_at:
                finished_ids.append(req.rid)
                self.running.remove(req)
                self.counts.cancelled_mid_flight += 1
            elif req.preempt_at is not None and req.computed >= req.preempt_at:
                preempted_ids.append(req.rid)
                self.running.remove(req)
                req.preempt_at, req.computed = None, 0
                req.resume_step = step_id + self.rng.randint(2, 30)
                self.preempted.append(req)
                self.counts.preempted += 1
        for req in list(self.preempted):
            due = step_id >= req.resume_step or not self.running
            if due and len(self.running) < self.args.max_running and req.rid not in preempted_ids:
                self.preempted.remove(req)
                req.resuming = True
                self.running.append(req)
                self.counts.resumed += 1
        while self.waiting and self.admitted < admit_limit:
            if len(self.running) >= self.args.max_running:
                break
            self.running.append(self.waiting.popleft())
            self.admitted += 1
        self._execute(step_id, finished_ids, preempted_ids)

    def _execute(self, step_id: int, finished_ids: list[str], preempted_ids: list[str]) -> None:
        new: list[pb.NewRequest] = []
        cached: list[pb.CachedRequest] = []
        scheduled: dict[str, int] = {}
        before: dict[str, tuple[int, int, bool]] = {}  # rid -> (computed, length, fresh)
        for req in self.running:
            fresh = not req.known or req.resuming
            if not req.known:
                new.append(
                    pb.NewRequest(
                        req_id=req.rid, prompt_token_ids=req.prompt, sampling_params=req.params
                    )
                )
            else:
                cached.append(
                    pb.CachedRequest(
                        req_id=req.rid,
                        num_computed_tokens=req.computed,
                        resumed_from_preemption=req.resuming,
                    )
                )
            # For a fresh request the worker computes these tokens beyond its prefix-cache hit.
            scheduled[req.rid] = min(self.args.chunk, req.length - req.computed)
            before[req.rid] = (req.computed, req.length, fresh)
        response = self.worker.stub.Execute(
            pb.ExecuteRequest(
                step_id=step_id,
                worker_epoch=self.worker.epoch,
                new_requests=new,
                cached_requests=cached,
                num_scheduled_tokens=scheduled,
                finished_req_ids=finished_ids,
                preempted_req_ids=preempted_ids,
            )
        )
        self.counts.steps += 1
        self.counts.computed_tokens += response.timings.num_tokens
        self._watch_kv()
        by_id = {out.req_id: out for out in response.outputs}
        for req in list(self.running):
            out = by_id.get(req.rid)
            if out is None:
                raise WorkerMisbehaved(f"step {step_id}: no output for scheduled {req.rid}")
            self._check(step_id, req, out, scheduled[req.rid], before[req.rid])
            req.known, req.resuming = True, False
            req.computed = out.num_computed_tokens
            req.output.extend(out.sampled_token_ids)
            self.counts.generated_tokens += len(out.sampled_token_ids)
            if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                self.running.remove(req)
                self.counts.finished[pb.FinishReason.Name(out.finish_reason)] += 1

    def _watch_kv(self) -> None:
        assert self.worker.server is not None  # soak runs an in-process worker
        kv = self.worker.server.worker.kv_usage()
        c = self.counts
        c.max_used_blocks = max(c.max_used_blocks, kv.used_blocks)
        c.max_prefix_blocks = max(c.max_prefix_blocks, kv.prefix_cache_blocks)
        c.steps_budget_full += int(kv.used_blocks + kv.prefix_cache_blocks >= kv.num_blocks)
        if kv.prefix_cache_blocks < c.last_prefix_blocks:
            c.prefix_blocks_evicted += c.last_prefix_blocks - kv.prefix_cache_blocks
            if c.first_eviction_request is None:
                c.first_eviction_request = self.admitted
        c.last_prefix_blocks = kv.prefix_cache_blocks

    def _check(
        self,
        step_id: int,
        req: Request,
        out: pb.RequestOutput,
        count: int,
        before: tuple[int, int, bool],
    ) -> None:
        computed, length, fresh = before
        hit = out.num_cached_prompt_tokens
        where = f"step {step_id}, {req.rid} (length {length}, computed {computed})"
        if fresh:
            if hit % BLOCK_SIZE or hit > length - 1:
                raise WorkerMisbehaved(f"{where}: num_cached_prompt_tokens {hit}")
            if hit:
                self.counts.prefix_hits += 1
                self.counts.cached_tokens += hit
                self.counts.resumed_hits += int(req.resuming)
            start = hit
        elif hit:
            raise WorkerMisbehaved(f"{where}: num_cached_prompt_tokens {hit} on a running request")
        else:
            start = computed
        end = min(start + count, length)
        sampled = len(out.sampled_token_ids)
        if out.num_computed_tokens != end or sampled != int(end == length):
            raise WorkerMisbehaved(
                f"{where}: scheduled {count} from {start}; expected num_computed_tokens {end} "
                f"and {int(end == length)} sampled token(s), got {out.num_computed_tokens} and "
                f"{sampled} (num_cached_prompt_tokens {hit})"
            )
        reason = out.finish_reason
        generated, max_tokens = len(req.output) + sampled, req.params.max_tokens
        early = {pb.FINISH_REASON_EOS} if not req.params.ignore_eos else set()
        if generated >= max_tokens:
            right = reason == pb.FINISH_REASON_LENGTH or reason in early
        else:
            right = reason == pb.FINISH_REASON_UNSPECIFIED or reason in early
        if not right:
            raise WorkerMisbehaved(
                f"{where}: finish_reason {pb.FinishReason.Name(reason)} after {generated} "
                f"of max_tokens {max_tokens} (ignore_eos {req.params.ignore_eos})"
            )
