"""Section (f): time to first token with and without a prefix-cache hit.

One prompt shape, `prefix` shared tokens + `suffix` tokens of its own, sent
through Execute and prefilled in one step on a worker whose prefix cache is on:

- cold: right after ResetPrefixCache, so the worker computes the whole prompt;
- warm: right after a cold request with the same prefix and another suffix, so
  the worker takes the prefix's blocks from its cache and computes the suffix.

Each repeat is a (cold, warm) pair, measured side by side; the medians are
reported. One untimed pair runs first, with the two prompts swapped: it warms
both shapes and gives the warm prompt's first token computed cold, which the
timed warm runs are compared with (`first_token_matches_cold`).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import BLOCK_SIZE, Worker, ratio
from benchmarks.execute_client import run_execute
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


def _ttft(worker: Worker, prompt: list[int]) -> dict[str, Any]:
    """One request, max_tokens 1, prefilled in one Execute step."""
    run = run_execute(worker, [prompt], 1)
    return {
        "ttft_s": run.timeline.stats()["ttft_s"],
        "forward_s": round(sum(s.forward_ns for s in run.steps) / 1e9, 4),
        "steps": len(run.steps),
        "num_cached_prompt_tokens": run.cached_prompt_tokens[0],
        "first_token": run.tokens[0][0],
    }


def _reset(worker: Worker) -> int:
    return int(worker.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest()).freed_blocks)


def _median_ms(runs: list[dict[str, Any]]) -> float:
    return round(statistics.median(float(r["ttft_s"]) for r in runs) * 1000, 1)


def section_f(
    worker: Worker, prefix: list[int], suffixes: tuple[list[int], list[int]], repeats: int
) -> dict[str, Any]:
    cold_prompt, warm_prompt = prefix + suffixes[0], prefix + suffixes[1]
    # Untimed: warms the cold shape (whole prompt) and the warm one (suffix after a hit).
    _reset(worker)
    reference = _ttft(worker, warm_prompt)
    _ttft(worker, cold_prompt)
    colds: list[dict[str, Any]] = []
    warms: list[dict[str, Any]] = []
    freed: list[int] = []
    for _ in range(repeats):
        freed.append(_reset(worker))
        colds.append(_ttft(worker, cold_prompt))
        warms.append(_ttft(worker, warm_prompt))
    kv = worker.stub.CheckHealth(pb.CheckHealthRequest()).kv
    cold_ms, warm_ms = _median_ms(colds), _median_ms(warms)
    expected_hit = len(prefix) // BLOCK_SIZE * BLOCK_SIZE
    warm_hits = [w["num_cached_prompt_tokens"] for w in warms]
    first = reference["first_token"]
    return {
        "prefix_tokens": len(prefix),
        "suffix_tokens": len(suffixes[0]),
        "repeats": repeats,
        "cold_ttft_ms": cold_ms,
        "warm_ttft_ms": warm_ms,
        "ratio_cold_vs_warm": ratio(cold_ms, warm_ms),
        "target_ratio": 5.0,
        "warm_num_cached_prompt_tokens": warm_hits[len(warm_hits) // 2],
        "warm_num_cached_prompt_tokens_all": warm_hits,
        "cold_num_cached_prompt_tokens_all": [c["num_cached_prompt_tokens"] for c in colds],
        "expected_warm_cached_tokens": expected_hit,
        "cached_tokens_as_expected": all(h == expected_hit for h in warm_hits)
        and all(c["num_cached_prompt_tokens"] == 0 for c in colds),
        "first_token_matches_cold": all(w["first_token"] == first for w in warms),
        "reset_freed_blocks": freed,
        "prefix_cache_blocks_at_end": int(kv.prefix_cache_blocks),
        "cold_runs": colds,
        "warm_runs": warms,
    }
