"""Sections (a) and (b): decode speed through the worker against mlx-lm in-process.

(a) one stream: Generate (gRPC streaming), Execute (one step per token) and
    ExecuteStream (one step per token, one step ahead) vs
    `mlx_lm.stream_generate`, the same prompt and token count, greedy, no EOS.
(b) batches of 1, 4, 8, 16 prompts: Execute vs mlx-lm's `BatchGenerator`,
    decode tokens/s after every request has its first token (prefill apart).

Every path runs each shape it uses (prefill and decode) once, untimed, first.
"""

from __future__ import annotations

from typing import Any

from benchmarks.baselines import raw_batch, raw_stream
from benchmarks.common import Worker, ratio
from benchmarks.execute_client import run_execute, run_generate, warm_up
from benchmarks.execute_stream import run_execute_stream


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the highest decode rate (the least disturbed by other load)."""
    return max(runs, key=lambda r: r.get("decode_tok_s") or 0.0)


def section_a(
    worker: Worker, model: Any, tokenizer: Any, prompt: list[int], tokens: int, *, repeats: int
) -> dict[str, Any]:
    raw_stream(model, tokenizer, prompt, 2)
    run_generate(worker, prompt, 2)
    run_execute(worker, [prompt], 2)
    run_execute_stream(worker, [prompt], 2)
    raw_runs, gen_runs, exe_runs, ahead_runs = [], [], [], []
    raw_tokens: list[int] = []
    gen_tokens: list[int] = []
    exe_tokens: list[int] = []
    ahead_tokens: list[int] = []
    for _ in range(repeats):  # interleaved, so slow drifts in machine load hit all three
        timeline, raw_tokens = raw_stream(model, tokenizer, prompt, tokens)
        raw_runs.append(timeline.stats())
        timeline, gen_tokens = run_generate(worker, prompt, tokens)
        gen_runs.append(timeline.stats())
        run = run_execute(worker, [prompt], tokens)
        exe_tokens = run.tokens[0]
        exe_runs.append(run.timeline.stats())
        run = run_execute_stream(worker, [prompt], tokens, depth=2)
        ahead_tokens = run.tokens[0]
        ahead_runs.append(run.timeline.stats())
    raw, gen, exe = _best(raw_runs), _best(gen_runs), _best(exe_runs)
    ahead = _best(ahead_runs)
    return {
        "prompt_tokens": len(prompt),
        "generated_tokens": tokens,
        "repeats": repeats,
        "raw_stream_generate": raw,
        "generate_grpc": gen,
        "execute_grpc": exe,
        "execute_stream_depth2_grpc": ahead,
        "ratio_generate_vs_raw": ratio(gen["decode_tok_s"] or 0, raw["decode_tok_s"] or 0),
        "ratio_execute_vs_raw": ratio(exe["decode_tok_s"] or 0, raw["decode_tok_s"] or 0),
        "ratio_execute_stream_vs_raw": ratio(ahead["decode_tok_s"] or 0, raw["decode_tok_s"] or 0),
        "target_ratio": 0.95,
        "target_ratio_execute_stream": 1.0,
        "token_counts": [len(raw_tokens), len(gen_tokens), len(exe_tokens), len(ahead_tokens)],
        "tokens_match": raw_tokens == gen_tokens == exe_tokens == ahead_tokens,
        "all_runs": {
            "raw": raw_runs,
            "generate": gen_runs,
            "execute": exe_runs,
            "execute_stream": ahead_runs,
        },
    }


def section_b(
    worker: Worker, model: Any, prompts: list[list[int]], batch_sizes: list[int], tokens: int
) -> dict[str, Any]:
    # The worker prefills each new request on its own ([1, prompt - 1]), then decodes the
    # batch ([B, 1]); BatchGenerator prefills [B, prompt - 1] at once, then decodes [B, 1].
    warm_up(worker, batch_sizes, [len(prompts[0]) - 1])
    rows = []
    for size in batch_sizes:
        batch = prompts[:size]
        raw_batch(model, batch, 1)  # warm: its prefill and decode shapes at this size
        run = run_execute(worker, batch, tokens)
        timeline, raw_tokens = raw_batch(model, batch, tokens)
        exe, raw = run.timeline.stats(), timeline.stats()
        same = sum(a == b for a, b in zip(run.tokens, raw_tokens, strict=True))
        rows.append(
            {
                "batch": size,
                "execute": exe,
                "batch_generator": raw,
                "execute_prefill_step_s": round(run.steps[0].wall_ns / 1e9, 4),
                "ratio_execute_vs_batch_generator": ratio(
                    exe["decode_tok_s"] or 0, raw["decode_tok_s"] or 0
                ),
                "requests_with_identical_tokens": same,
            }
        )
    return {
        "prompt_tokens": len(prompts[0]),
        "generated_tokens_per_request": tokens,
        "target_ratio": 1.0,
        "rows": rows,
    }
