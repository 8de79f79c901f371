"""`python -m benchmarks.soak`: a bounded soak run through Execute; memory must stay flat.

A small scheduler loop drives a live worker (gRPC on loopback, prefix cache on,
a small KV budget) through `--requests` requests of mixed lengths: continuous
batching up to `--max-running` requests, prefill in `--chunk`-token chunks,
some requests cancelled mid-flight (finished_req_ids before they finish), some
preempted and resumed later, and some prompts sharing prefixes so the prefix
cache hits, fills up and evicts.

Every `--sample-every` requests the loop stops admitting, lets every request
finish, and samples the worker at that idle point (CheckHealth: MLX active
memory, KV used blocks, prefix-cache blocks). The verdict compares the level
after warm-up (the first idle sample after `--warmup-requests` requests) with
the final one, and fits a least-squares line through the post-warm-up samples:

- PASS if the final level is within 5 % of the warm-up level, the fitted slope
  extrapolated over the whole run is under 5 % of that level, and no KV blocks
  are held by requests at any idle point;
- otherwise FAIL, exit code 1.

Each response is checked against what the scheduler expects (computed-token
counts, prefix-cache hits in whole blocks, one sampled token exactly when the
sequence is complete); a mismatch stops the run with the details, exit code 2.

Writes `benchmarks/results/<YYYY-MM-DD>-soak-<machine>.json` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BLOCK_SIZE,
    MIB,
    RESULTS,
    Worker,
    build_tiny,
    live_worker,
    machine_facts,
    machine_name,
    rss_bytes,
    slope,
    temp_dir,
)
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

TOLERANCE = 0.05


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


# ------------------------------------------------------------------- samples
def sample(worker: Worker, scheduler: Scheduler, started: float) -> dict[str, Any]:
    health = worker.stub.CheckHealth(pb.CheckHealthRequest())
    prefix_bytes = int(health.kv.prefix_cache_blocks) * worker.bytes_per_block
    return {
        "requests": scheduler.admitted,
        "steps": scheduler.counts.steps,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "active_bytes": int(health.memory.active_bytes),
        # For information: what the prefix cache holds (blocks x bytes per block) taken off.
        "active_minus_prefix_cache_bytes": int(health.memory.active_bytes) - prefix_bytes,
        "peak_bytes": int(health.memory.peak_bytes),
        "cache_bytes": int(health.memory.cache_bytes),
        "rss_bytes": rss_bytes(),
        "kv_used_blocks": int(health.kv.used_blocks),
        "prefix_cache_blocks": int(health.kv.prefix_cache_blocks),
        "num_running_requests": int(health.num_running_requests),
        "num_preempted_requests": int(health.num_preempted_requests),
        "prefix_hits": scheduler.counts.prefix_hits,
    }


def verdict(samples: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    idle = [s for s in samples if s["requests"] > 0]
    post = [s for s in idle if s["requests"] >= args.warmup_requests] or idle[-1:]
    level = post[0]["active_bytes"]
    final = post[-1]["active_bytes"]
    per_request = slope([s["requests"] for s in post], [s["active_bytes"] for s in post])
    trend = per_request * args.requests
    drift = (final - level) / level if level else 0.0
    net = [s["active_minus_prefix_cache_bytes"] for s in post]
    net_trend = slope([s["requests"] for s in post], [float(v) for v in net]) * args.requests
    leaked_blocks = [s["requests"] for s in idle if s["kv_used_blocks"] != 0]
    still_live = [
        s["requests"] for s in idle if s["num_running_requests"] or s["num_preempted_requests"]
    ]
    checks = {
        "final_within_5pct_of_warmup": abs(drift) <= TOLERANCE,
        "no_upward_trend": trend < TOLERANCE * level,
        "kv_used_blocks_zero_when_idle": not leaked_blocks,
        "no_requests_left_when_idle": not still_live,
    }
    return {
        "warmup_sample_requests": post[0]["requests"],
        "warmup_level_bytes": level,
        "final_level_bytes": final,
        "final_vs_warmup": round(drift, 5),
        "slope_bytes_per_request": round(per_request, 3),
        "slope_extrapolated_bytes": round(trend),
        "slope_extrapolated_vs_level": round(trend / level, 5) if level else None,
        "post_warmup_samples": len(post),
        "without_prefix_cache": {
            "note": "for information: active bytes minus prefix-cache blocks x bytes per block",
            "warmup_level_bytes": net[0],
            "final_level_bytes": net[-1],
            "final_vs_warmup": round((net[-1] - net[0]) / net[0], 5) if net[0] else None,
            "slope_extrapolated_bytes": round(net_trend),
        },
        "idle_samples_with_kv_used_blocks": leaked_blocks,
        "idle_samples_with_live_requests": still_live,
        "checks": checks,
        "pass": all(checks.values()),
    }


def table(samples: list[dict[str, Any]], level: int) -> str:
    head = (
        "| requests | steps | elapsed s | active MiB | vs warm-up | active - prefix cache MiB "
        "| peak MiB | MLX cache MiB | RSS MiB | KV used blocks | prefix cache blocks "
        "| prefix hits |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for s in samples:
        delta = f"{(s['active_bytes'] - level) / level * 100:+.2f} %" if level else "n/a"
        rows.append(
            f"| {s['requests']} | {s['steps']} | {s['elapsed_s']} "
            f"| {s['active_bytes'] / MIB:.3f} | {delta} "
            f"| {s['active_minus_prefix_cache_bytes'] / MIB:.3f} | {s['peak_bytes'] / MIB:.2f} "
            f"| {s['cache_bytes'] / MIB:.2f} | {s['rss_bytes'] / MIB:.1f} | {s['kv_used_blocks']} "
            f"| {s['prefix_cache_blocks']} | {s['prefix_hits']} |"
        )
    return head + "\n".join(rows)


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    p.add_argument("--model", help="model directory; default: the tiny random llama")
    p.add_argument("--requests", type=int, help="requests in all (default 2000)")
    p.add_argument("--sample-every", type=int, help="idle sample every N requests (default 100)")
    p.add_argument("--warmup-requests", type=int, help="requests before the level (default 200)")
    p.add_argument("--max-running", type=int, default=16, help="running requests at most (16)")
    p.add_argument("--chunk", type=int, default=64, help="prefill tokens per request-step (64)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV budget in blocks (512)")
    p.add_argument("--min-prompt", type=int, default=8, help="shortest prompt (8)")
    p.add_argument("--max-prompt", type=int, default=300, help="longest prompt (300)")
    p.add_argument("--min-tokens", type=int, default=1, help="smallest max_tokens (1)")
    p.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens (64)")
    p.add_argument("--cancel-frac", type=float, default=0.1, help="cancelled mid-flight (0.1)")
    p.add_argument("--preempt-frac", type=float, default=0.1, help="preempted, resumed (0.1)")
    p.add_argument("--shared-frac", type=float, default=0.3, help="shared-prefix prompts (0.3)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument(
        "--kv-bits",
        type=int,
        default=0,
        help="quantized KV, group 64 (0: float; the default tiny model then has head_dim 64)",
    )
    p.add_argument("--quick", action="store_true", help="300 requests: a smoke run")
    p.add_argument("--out", type=Path, help="results directory (default benchmarks/results)")
    args = p.parse_args(argv)
    sizes = (300, 50, 100) if args.quick else (2000, 100, 200)
    for key, value in zip(("requests", "sample_every", "warmup_requests"), sizes, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "mlx-worker-bench" if args.quick else RESULTS
    if not 1 <= args.min_prompt <= args.max_prompt or not 1 <= args.min_tokens <= args.max_tokens:
        p.error("need 1 <= --min-prompt <= --max-prompt and 1 <= --min-tokens <= --max-tokens")
    if args.max_prompt < 3 * BLOCK_SIZE:
        p.error(f"--max-prompt must be at least {3 * BLOCK_SIZE} (shared prefixes)")
    return args


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def soak(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    started = time.perf_counter()
    with live_worker(
        model, num_blocks=args.num_blocks, prefix_caching=True, kv_bits=args.kv_bits
    ) as worker:
        workload = make_workload(args, int(worker.info.vocab_size))
        scheduler = Scheduler(worker, args, workload)
        samples = [sample(worker, scheduler, started)]
        log(f"worker up; {args.requests} requests, idle sample every {args.sample_every}")
        target = 0
        while target < args.requests:
            target = min(target + args.sample_every, args.requests)
            scheduler.drain_until(target)
            samples.append(sample(worker, scheduler, started))
            s = samples[-1]
            log(
                f"{s['requests']} requests, {s['steps']} steps, {s['elapsed_s']} s: active "
                f"{s['active_bytes'] / MIB:.3f} MiB, KV used {s['kv_used_blocks']}, "
                f"prefix cache {s['prefix_cache_blocks']} blocks"
            )
        counts = scheduler.counts
    warm_prompts = [r.prompt for r in workload[: args.warmup_requests]]
    return {
        "samples": samples,
        "counts": {
            "steps": counts.steps,
            "finished": dict(counts.finished),
            "cancelled_mid_flight": counts.cancelled_mid_flight,
            "preempted": counts.preempted,
            "resumed": counts.resumed,
            "prefix_hits": counts.prefix_hits,
            "prefix_hits_on_resume": counts.resumed_hits,
            "cached_prompt_tokens": counts.cached_tokens,
            "computed_tokens": counts.computed_tokens,
            "generated_tokens": counts.generated_tokens,
            "shared_prefix_requests": sum(r.shared for r in workload),
            "distinct_prompt_blocks_before_warmup": distinct_blocks(warm_prompts),
            "max_kv_used_blocks": counts.max_used_blocks,
            "max_prefix_cache_blocks": counts.max_prefix_blocks,
            "steps_with_kv_budget_full": counts.steps_budget_full,
            "prefix_blocks_evicted_at_least": counts.prefix_blocks_evicted,
            "first_eviction_after_requests": counts.first_eviction_request,
        },
        "run_seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    from mlx_worker_svc.cli import envs
    from mlx_worker_svc.engine.model.embedded import ensure_default_model

    args = parse_args(argv)
    with temp_dir() as tmp:
        if args.model:
            model, model_name = Path(args.model), args.model
        else:
            embedded = ensure_default_model(envs.cache_root(), show_progress=False)
            model = build_tiny(tmp, embedded, head_dim=64 if args.kv_bits else None)
            model_name = "tiny random llama (tests/tiny_model.py), float32"
            model_name += ", head_dim 64" if args.kv_bits else ""
        try:
            run = soak(args, model)
        except WorkerMisbehaved as exc:
            log(f"the worker misbehaved: {exc}")
            return 2
    result = verdict(run["samples"], args)
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_facts(),
        "model": model_name,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "block_size": BLOCK_SIZE,
        **run,
        "verdict": result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{results['date']}-soak-{machine_name()}" + ("-quick" if args.quick else "")
    stem += f"-kv{args.kv_bits}" if args.kv_bits else ""
    path = args.out / f"{stem}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    level = result["warmup_level_bytes"]
    print(table(run["samples"], level))
    print()
    print(", ".join(f"{key} {value}" for key, value in run["counts"].items()))
    failed = [name for name, ok in result["checks"].items() if not ok]
    final, drift = result["final_level_bytes"], result["final_vs_warmup"]
    trend, share = result["slope_extrapolated_bytes"], result["slope_extrapolated_vs_level"] or 0
    print(
        f"\n{'PASS' if result['pass'] else 'FAIL'}: warm-up level {level / MIB:.3f} MiB (after "
        f"{result['warmup_sample_requests']} requests), final {final / MIB:.3f} MiB "
        f"({drift * 100:+.2f} %), slope x {args.requests} requests = {trend / MIB:+.3f} MiB "
        f"({share * 100:+.2f} % of the level)"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    net = result["without_prefix_cache"]
    print(
        f"(for information, the prefix cache's blocks taken off: warm-up "
        f"{net['warmup_level_bytes'] / MIB:.3f} MiB, final {net['final_level_bytes'] / MIB:.3f} "
        f"MiB, slope x {args.requests} requests = {net['slope_extrapolated_bytes'] / MIB:+.3f} MiB)"
    )
    print(f"run time {run['run_seconds']} s; wrote {path}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
