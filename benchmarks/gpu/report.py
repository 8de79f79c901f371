"""The GPU benchmark's results as Markdown: machine, decode table, prefill, parity."""

from __future__ import annotations

import statistics
from typing import Any


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _p50(step: dict[str, Any], key: str) -> str:
    return _num(step.get(key, {}).get("p50_ms"), 2)


# Worker paths (bench_gpu --paths): Execute from the benchmarks' Python scheduler,
# one decode step a call or several (num_decode_steps), one decode step a call
# through ExecuteStream with steps in flight, and one Generate stream
# per request, the worker scheduling them itself.
PATHS = {
    "execute": "Execute",
    "multistep": "Execute, n steps a call",
    "stream": "ExecuteStream, 1 step a call, --stream-depth steps in flight",
    "generate": "Generate streams",
}


def _rate(stats: dict[str, Any] | None) -> Any:
    return (stats or {}).get("decode_tok_s")


def _best_path(row: dict[str, Any]) -> tuple[str, Any]:
    """The worker path with the higher decode rate in a row (or a variant's entry)."""
    rates = [(_rate(row.get(f"worker_{p}")) or 0, name) for p, name in PATHS.items()]
    rate, name = max(rates)
    return (name, rate) if rate else ("-", None)


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    options = results["options"]
    others = sorted({v for rows in results["rows"].values() for r in rows for v in r["variants"]})
    first = options.get("variants", "").split(",")[0]
    used = [p for p in options.get("paths", "execute,generate").split(",") if p in PATHS]
    steps = options.get("decode_steps")
    path_head = "".join(f" | worker {PATHS[p]} tok/s | ratio" for p in used)
    extra_head = "".join(f" | worker tok/s, {v} (best path) | ratio" for v in others)
    names = " / ".join(PATHS[p] for p in used)
    lines = [
        f"GPU: {m.get('gpu')}, driver {m.get('driver')} (CUDA {m.get('cuda_driver_api')}), "
        f"MLX {m.get('mlx')}, mlx-lm {m.get('mlx_lm')}, device {m.get('mlx_device')}, "
        f"Python {m.get('python')}; model: {results['model']['shape']}; "
        f"options: prompt {options['prompt_tokens']} tokens, "
        f"{options['new_tokens']} new tokens, repeats {options['repeats']}, "
        f"stream depth {options.get('stream_depth', '-')}",
        "",
        f"Worker variant {first}. Execute: one Execute RPC per step from the benchmarks' Python "
        f"scheduler; Execute, n steps a call: the same scheduler asking for n = {steps} decode "
        "steps a call once every request decodes (num_decode_steps); ExecuteStream: the same "
        "schedule, one decode step a call, sent ahead of the replies through one "
        "ExecuteStream; Generate streams: one "
        "Generate stream per request, all started together, scheduled by the worker. Decode "
        "tok/s: tokens after each request's first over the time from the first token to the "
        "last; prefill tok/s: prompt tokens over the time until every request has its first "
        "token. Raw is measured two ways, the timeline's decode rate and BatchGenerator's own "
        "statistics (`generation_tps`); ratios are to the faster.",
        "",
        f"| dtype | batch | raw path | raw decode tok/s: timeline / generation_tps{path_head} "
        "| best worker path: ratio "
        "| Execute step p50 ms: client wall / worker total / forward "
        f"| prefill tok/s raw / {names} "
        f"| identical requests {names}{extra_head} |",
        "|---|---|---|---|"
        + "---|---|" * len(used)
        + "---|---|---|---|"
        + "---|---|" * len(others),
    ]
    for dtype, rows in results["rows"].items():
        for row in rows:
            step_ms = row.get("worker_step_ms", {})
            prefill = row["prefill_tok_s"]
            same = row["requests_with_identical_tokens"]
            raw = row.get("raw_baseline_tok_s") or _rate(row["raw"])
            raw_cell = f"{_num(_rate(row['raw']))} / {_num(row['raw'].get('generation_tps'))}"
            best = row.get("worker_best") or {}
            cells = "".join(
                f" | {_num(_rate(row.get(f'worker_{p}')))} "
                f"| {_num(row.get(f'ratio_{p}_vs_raw'), 3)}"
                for p in used
            )
            extra = ""
            for v in others:
                name, got = _best_path(row["variants"].get(v, {}))
                extra += f" | {_num(got)} ({name}) | {_num(got / raw if got and raw else None, 3)}"
            prefills = " / ".join(_num(prefill.get(f"worker_{p}")) for p in used)
            identical = " / ".join(str(same.get(p, "-")) for p in used)
            lines.append(
                f"| {dtype} | {row['batch']} | {row['raw_path']} | {raw_cell}{cells} "
                f"| {best.get('path', '-')}: {_num(best.get('ratio_vs_raw'), 3)} "
                f"| {_p50(step_ms, 'client_wall')} / {_p50(step_ms, 'worker_total')} / "
                f"{_p50(step_ms, 'worker_forward')} "
                f"| {_num(prefill.get('raw'))} / {prefills} "
                f"| {identical} of {row['batch']}{extra} |"
            )
    singles = [
        (dtype, row) for dtype, rows in results["rows"].items() for row in rows if row["batch"] == 1
    ]
    if singles:
        lines += ["", "Batch 1, BatchGenerator (decode tok/s):", ""]
        for dtype, row in singles:
            lines.append(f"- {dtype}: {_num(_rate(row.get('batch_generator')))}")
    lines += _runs(results, used)
    parity = results.get("parity")
    if parity:
        lines += [
            "",
            f"Greedy parity (bf16, {parity['prompts']} prompts x {parity['tokens']} tokens): "
            f"worker batch 1 == mlx-lm stream_generate: {'OK' if parity['ok'] else 'FAILED'} "
            f"(Execute {parity['single_matches_generate']}, Execute n steps a call "
            f"{parity.get('multistep_single_matches_generate')}, ExecuteStream "
            f"{parity.get('stream_single_matches_generate')}, Generate "
            f"{parity.get('generate_single_matches_generate')}); worker batched == "
            f"BatchGenerator: Execute "
            f"{parity['batched_matches_batch_generator']}, Generate streams "
            f"{parity.get('generate_streams_match_batch_generator')} "
            f"(Execute's tokens agreeing before a difference: "
            f"{parity['batched_tokens_agreeing_before_first_difference']}).",
        ]
    for note in results.get("skipped", []):
        lines.append(f"- skipped: {note}")
    for error in results.get("errors", []):
        lines.append(f"- ERROR: {error}")
    if "run_seconds" in results:
        lines += [
            "",
            f"Run time {results['run_seconds']} s (models built in "
            f"{results.get('build_seconds')} s).",
        ]
    return "\n".join(lines)


def _runs(results: dict[str, Any], used: list[str]) -> list[str]:
    """Every timed run's decode rate per row, and each path's median over raw's median."""
    lines: list[str] = []
    for dtype, rows in results["rows"].items():
        for row in rows:
            runs = row.get("decode_tok_s_runs")
            if not runs or not runs.get("raw"):
                continue
            raw = statistics.median(runs["raw"])
            cells = [f"raw {', '.join(_num(x) for x in runs['raw'])}"]
            for path in used:
                got = runs.get(path) or []
                if got:
                    median = _num(statistics.median(got) / raw if raw else None, 3)
                    cells.append(
                        f"{PATHS[path]} {', '.join(_num(x) for x in got)} (median ratio {median})"
                    )
            lines.append(f"- {dtype} batch {row['batch']}: {'; '.join(cells)}")
    if lines:
        lines = [
            "",
            "Every timed run's decode tok/s in run order (each repeat runs raw and the "
            "worker's paths: raw first in the 1st, 3rd, ... repeat, last in the others), "
            "and each path's median over raw's median:",
            "",
            *lines,
        ]
    return lines
