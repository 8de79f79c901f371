"""Section (i): one token a step through ExecuteStream against multi-step Execute.

On the tiny model, at each batch size, the same prompts run three ways: unary
Execute one decode step a call, unary Execute `decode_steps` (8) a call, and
ExecuteStream one decode step a call, `depth` (2) steps in flight. Decode tok/s
from the first token to the last, greedy, EOS ignored; every path must give
the same tokens. The stream is meant to stream every token at the multi-step
path's speed (target >= 0.9x). Every path must generate `tokens` (--stream-tokens)
for every request: a run where one did not stops with an error instead of
reporting a ratio over different work. Each size runs the three paths
`repeats` times, interleaved (so a drift of the machine's speed reaches every
path alike), and keeps each path's best run.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import Worker, ratio
from benchmarks.execute_client import run_execute, warm_up
from benchmarks.execute_stream import run_execute_stream


def section_i(
    worker: Worker,
    prompts: list[list[int]],
    batch_sizes: list[int],
    tokens: int,
    *,
    decode_steps: int = 8,
    depth: int = 2,
    repeats: int = 3,
) -> dict[str, Any]:
    warm_up(worker, batch_sizes, [len(prompts[0])])
    rows = []
    for size in batch_sizes:
        batch = prompts[:size]
        for warm in (run_execute, run_execute_stream):  # every path's shapes once
            warm(worker, batch, 4)
        run_execute(worker, batch, 4, decode_steps=decode_steps)
        runs: dict[str, list[dict[str, Any]]] = {}
        match = True
        for _ in range(repeats):
            one = run_execute(worker, batch, tokens)
            multi = run_execute(worker, batch, tokens, decode_steps=decode_steps)
            ahead = run_execute_stream(worker, batch, tokens, depth=depth)
            match = match and one.tokens == multi.tokens == ahead.tokens
            stats = {
                "execute_one_step": one.timeline.stats(),
                f"execute_{decode_steps}_steps": multi.timeline.stats(),
                f"stream_depth{depth}_one_step": ahead.timeline.stats(),
            }
            _check_tokens(stats, size, tokens)  # every repeat, not only the best runs
            for name, stat in stats.items():
                runs.setdefault(name, []).append(stat)
        paths = {name: max(r, key=lambda s: s["decode_tok_s"] or 0) for name, r in runs.items()}
        o, m, a = paths.values()
        rows.append(
            {
                "batch": size,
                **paths,
                "ratio_stream_vs_multi_step": ratio(a["decode_tok_s"] or 0, m["decode_tok_s"] or 0),
                "ratio_stream_vs_one_step": ratio(a["decode_tok_s"] or 0, o["decode_tok_s"] or 0),
                "tokens_match": match,  # in every repeat
                "decode_tok_s_runs": {
                    name: [r["decode_tok_s"] for r in path_runs] for name, path_runs in runs.items()
                },
            }
        )
    return {
        "model": "tiny",
        "prompt_tokens": len(prompts[0]),
        "generated_tokens_per_request": tokens,
        "decode_steps": decode_steps,
        "depth": depth,
        "repeats": repeats,
        "target_ratio_stream_vs_multi_step": 0.9,
        "rows": rows,
    }


def _check_tokens(paths: dict[str, dict[str, Any]], size: int, tokens: int) -> None:
    """Every path generated `tokens` for each of the `size` requests, or the run is void."""
    wrong = {
        name: stats["tokens"] for name, stats in paths.items() if stats["tokens"] != size * tokens
    }
    if wrong:
        raise RuntimeError(
            f"section (i), batch {size}: every path must generate {tokens} tokens a request "
            f"({size * tokens} in all); these did not: {wrong}"
        )
