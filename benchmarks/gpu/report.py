"""The GPU benchmark's results as Markdown: machine, decode table, prefill, parity."""

from __future__ import annotations

from typing import Any


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _p50(step: dict[str, Any], key: str) -> str:
    return _num(step.get(key, {}).get("p50_ms"), 2)


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    others = sorted({v for rows in results["rows"].values() for r in rows for v in r["variants"]})
    first = results["options"].get("variants", "").split(",")[0]
    extra_head = "".join(f" | worker tok/s, {v} | ratio" for v in others)
    lines = [
        f"GPU: {m.get('gpu')}, driver {m.get('driver')} (CUDA {m.get('cuda_driver_api')}), "
        f"MLX {m.get('mlx')}, mlx-lm {m.get('mlx_lm')}, device {m.get('mlx_device')}, "
        f"Python {m.get('python')}; model: {results['model']['shape']}; "
        f"options: prompt {results['options']['prompt_tokens']} tokens, "
        f"{results['options']['new_tokens']} new tokens, repeats {results['options']['repeats']}",
        "",
        "| dtype | batch | raw path | raw decode tok/s "
        f"| worker decode tok/s (Execute, {first}) "
        "| ratio | worker step p50 ms: client wall / worker total / forward "
        f"| prefill tok/s raw / worker | identical requests{extra_head} |",
        "|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(others),
    ]
    for dtype, rows in results["rows"].items():
        for row in rows:
            steps = row["worker_step_ms"]
            prefill = row["prefill_tok_s"]
            raw = row["raw"].get("decode_tok_s")
            extra = ""
            for v in others:
                got = row["variants"].get(v, {}).get("worker_execute", {}).get("decode_tok_s")
                extra += f" | {_num(got)} | {_num(got / raw if got and raw else None, 3)}"
            lines.append(
                f"| {dtype} | {row['batch']} | {row['raw_path']} "
                f"| {_num(raw)} "
                f"| {_num(row['worker_execute'].get('decode_tok_s'))} "
                f"| {_num(row['ratio_execute_vs_raw'], 3)} "
                f"| {_p50(steps, 'client_wall')} / {_p50(steps, 'worker_total')} / "
                f"{_p50(steps, 'worker_forward')} "
                f"| {_num(prefill['raw'])} / {_num(prefill['worker_execute'])} "
                f"| {row['requests_with_identical_tokens']}/{row['batch']}{extra} |"
            )
    singles = [
        (dtype, row) for dtype, rows in results["rows"].items() for row in rows if row["batch"] == 1
    ]
    if singles:
        lines += ["", "Batch 1, other paths (decode tok/s):", ""]
        for dtype, row in singles:
            lines.append(
                f"- {dtype}: BatchGenerator {_num(row['batch_generator'].get('decode_tok_s'))}, "
                f"worker Generate stream {_num(row['worker_generate'].get('decode_tok_s'))} "
                f"(ratio to stream_generate {_num(row['ratio_generate_vs_raw'], 3)})"
            )
    parity = results.get("parity")
    if parity:
        lines += [
            "",
            f"Greedy parity (bf16, {parity['prompts']} prompts x {parity['tokens']} tokens): "
            f"worker batch 1 == mlx-lm stream_generate: {'OK' if parity['ok'] else 'FAILED'} "
            f"{parity['single_matches_generate']}; worker batched == BatchGenerator: "
            f"{parity['batched_matches_batch_generator']} (tokens agreeing before a difference: "
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
