"""Sections (c), (d) and (e): step overhead, the re-prefill baseline, time to first token.

(c) On the tiny model, where a forward takes well under a millisecond to a few,
    each decode step's client wall time minus the worker's `forward_ns` is the
    price of the Execute round trip (gRPC, protobuf, the engine-thread hop,
    validation, bookkeeping). `total_ns - forward_ns` is the part the worker
    itself reports.
(d) The seeds' approach (no KV cache: each token re-runs prompt + output so
    far) against the worker and mlx-lm's cached `generate_step`.
(e) Time to first token for a long prompt through Execute, prefilled in one
    step or in chunks over several steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from benchmarks.baselines import raw_generate_step, reprefill
from benchmarks.common import Worker, ratio, summary_ms
from benchmarks.execute_client import in_process_call, run_execute
from benchmarks.execute_stream import run_execute_stream
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

WARM_REPREFILL = 16


def _round_trips(count: int, call: Callable[[], object]) -> list[int]:
    times = []
    for _ in range(count):
        start = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - start)
    return times


def section_c(worker: Worker, prompt: list[int], steps: int) -> dict[str, Any]:
    direct = in_process_call(worker)
    run_execute(worker, [prompt], 4)
    run_execute(worker, [prompt], 4, call=direct)
    run = run_execute(worker, [prompt], steps)
    decode = [s for s in run.steps[1:] if s.decode_batch_size == 1]
    overhead = [s.wall_ns - s.forward_ns for s in decode]
    internal = [s.total_ns - s.forward_ns for s in decode]
    outside = [s.wall_ns - s.total_ns for s in decode]
    local = run_execute(worker, [prompt], steps, call=direct).steps[1:]
    run_execute_stream(worker, [prompt], 4)
    ahead = [s for s in run_execute_stream(worker, [prompt], steps).steps[1:]]
    ahead = [s for s in ahead if s.decode_batch_size == 1]
    count = max(20, min(steps, 200))
    pings = _round_trips(count, lambda: worker.stub.CheckHealth(pb.CheckHealthRequest()))
    empty = pb.ExecuteRequest(step_id=0, worker_epoch=worker.epoch)
    empties = _round_trips(count, lambda: worker.stub.Execute(empty))
    return {
        "model": "tiny",
        "decode_steps": len(decode),
        "client_wall": summary_ms([s.wall_ns for s in decode]),
        "forward": summary_ms([s.forward_ns for s in decode]),
        "overhead_wall_minus_forward": summary_ms(overhead),
        "worker_internal_total_minus_forward": summary_ms(internal),
        "outside_worker_timings_wall_minus_total": summary_ms(outside),
        "stream_depth2_client_wall": summary_ms([s.wall_ns for s in ahead]),
        "stream_depth2_wall_minus_forward": summary_ms([s.wall_ns - s.forward_ns for s in ahead]),
        "in_process_wall_minus_forward": summary_ms([s.wall_ns - s.forward_ns for s in local]),
        "checkhealth_round_trip": summary_ms(pings),
        "empty_execute_round_trip": summary_ms(empties),
        "target_p50_ms": 0.5,
        "target_p99_ms_stream": 2.0,
    }


def section_d(worker: Worker, model: Any, prompt: list[int], tokens: int) -> dict[str, Any]:
    # Warm: each path once. Every re-prefill step has a new shape, so its full warm-up would
    # cost as much as the run itself (minutes); its first WARM_REPREFILL steps are warmed.
    reprefill(model, prompt, min(tokens, WARM_REPREFILL))
    run_execute(worker, [prompt], tokens)
    raw_generate_step(model, prompt, tokens)
    seeds, seeds_tokens = reprefill(model, prompt, tokens)
    run = run_execute(worker, [prompt], tokens)
    cached, cached_tokens = raw_generate_step(model, prompt, tokens)
    s, w, c = seeds.stats(), run.timeline.stats(), cached.stats()
    return {
        "model": "tiny",
        "prompt_tokens": len(prompt),
        "generated_tokens": tokens,
        "reprefill_no_cache": s,
        "execute_grpc": w,
        "mlx_lm_generate_step": c,
        "speedup_execute_vs_reprefill_e2e": ratio(w["e2e_tok_s"] or 0, s["e2e_tok_s"] or 0),
        "speedup_execute_vs_reprefill_decode": ratio(
            w["decode_tok_s"] or 0, s["decode_tok_s"] or 0
        ),
        "tokens_match": seeds_tokens == run.tokens[0] == cached_tokens,
        "reprefill_warmed_steps": min(tokens, WARM_REPREFILL),
    }


def _ttft(worker: Worker, prompt: list[int], chunk: int | None) -> dict[str, Any]:
    run = run_execute(worker, [prompt], 1, chunk=chunk)
    stats = run.timeline.stats()
    return {
        "ttft_s": stats["ttft_s"],
        "steps": len(run.steps),
        "step_wall_s": [round(s.wall_ns / 1e9, 4) for s in run.steps],
        "forward_s": round(sum(s.forward_ns for s in run.steps) / 1e9, 4),
        "prefill_tok_s": round(len(prompt) / stats["ttft_s"], 3) if stats["ttft_s"] else None,
    }


def section_e(worker: Worker, prompt: list[int], chunk: int) -> dict[str, Any]:
    _ttft(worker, prompt[: 2 * chunk], chunk)  # warm the chunk shapes
    cold = _ttft(worker, prompt, None)  # the first one-step prefill warms that shape
    unchunked = _ttft(worker, prompt, None)
    chunked = _ttft(worker, prompt, chunk)
    return {
        "prompt_tokens": len(prompt),
        "chunk_tokens": chunk,
        "unchunked": unchunked,
        "chunked": chunked,
        "unchunked_cold_first_run": cold,
        "ratio_chunked_vs_unchunked_ttft": ratio(chunked["ttft_s"], unchunked["ttft_s"]),
    }
