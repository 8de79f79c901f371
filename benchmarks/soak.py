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
import sys
import tempfile
import time
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
from benchmarks.soak_loop import Scheduler, WorkerMisbehaved, distinct_blocks, make_workload
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

TOLERANCE = 0.05


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
