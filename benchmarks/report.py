"""Turns a results dict into the Markdown table of `make bench`.

The chart panels of the same results are report_panels.py's; `fmt` writes a figure
for both.
"""

from __future__ import annotations

from typing import Any

from benchmarks import lora


def fmt(value: Any, digits: int = 2) -> str:
    """`value` with `digits` decimals, or "n/a" for a figure the run did not produce."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def _ratio(value: Any, target: str) -> str:
    return "n/a" if value is None else f"{value:.3f} ({target})"


def markdown(results: dict[str, Any]) -> str:
    s = results["sections"]
    rows: list[tuple[str, str, str, str, str]] = []
    if "a" in s:
        a = s["a"]
        raw = fmt(a["raw_stream_generate"]["decode_tok_s"])
        paths = (
            ("generate_grpc", "Generate", "ratio_generate_vs_raw", ">= 0.95"),
            ("execute_grpc", "Execute", "ratio_execute_vs_raw", ">= 0.95"),
            (
                "execute_stream_depth2_grpc",
                "ExecuteStream (depth 2)",
                "ratio_execute_stream_vs_raw",
                ">= 1.0",
            ),
        )
        for key, name, ratio_key, target in paths:
            if key not in a:  # results written before the path existed
                continue
            rows.append(
                (
                    "(a) single stream",
                    f"decode tok/s, {name} vs stream_generate ({a['generated_tokens']} tokens)",
                    fmt(a[key]["decode_tok_s"]),
                    raw,
                    _ratio(a[ratio_key], target),
                )
            )
    if "b" in s:
        for row in s["b"]["rows"]:
            rows.append(
                (
                    f"(b) batch {row['batch']}",
                    "decode tok/s, Execute vs BatchGenerator",
                    fmt(row["execute"]["decode_tok_s"]),
                    fmt(row["batch_generator"]["decode_tok_s"]),
                    _ratio(row["ratio_execute_vs_batch_generator"], ">= 1.0"),
                )
            )
    if "c" in s:
        c = s["c"]
        over, inner = c["overhead_wall_minus_forward"], c["worker_internal_total_minus_forward"]
        rows.append(
            (
                "(c) step overhead (tiny)",
                "client wall - forward_ns, p50 / p99 ms",
                f"{fmt(over.get('p50_ms'), 3)} / {fmt(over.get('p99_ms'), 3)}",
                "",
                f"p50 target < {c['target_p50_ms']} ms",
            )
        )
        rows.append(
            (
                "(c) worker-internal (tiny)",
                "total_ns - forward_ns, p50 / p99 ms",
                f"{fmt(inner.get('p50_ms'), 3)} / {fmt(inner.get('p99_ms'), 3)}",
                "",
                "",
            )
        )
        ahead = c.get("stream_depth2_wall_minus_forward")
        if ahead is not None:
            rows.append(
                (
                    "(c) step overhead, ExecuteStream depth 2 (tiny)",
                    "time between replies - forward_ns, p50 / p99 ms",
                    f"{fmt(ahead.get('p50_ms'), 3)} / {fmt(ahead.get('p99_ms'), 3)}",
                    "",
                    f"p50 < {c['target_p50_ms']} ms, p99 < {c['target_p99_ms_stream']} ms",
                )
            )
        local, empty = c["in_process_wall_minus_forward"], c["empty_execute_round_trip"]
        rows.append(
            (
                "(c) where it goes (tiny)",
                "p50 ms: same step in-process (no gRPC) / empty Execute / CheckHealth",
                f"{fmt(local.get('p50_ms'), 3)} / {fmt(empty.get('p50_ms'), 3)}"
                f" / {fmt(c['checkhealth_round_trip'].get('p50_ms'), 3)}",
                "",
                "",
            )
        )
    if "d" in s:
        d = s["d"]
        rows.append(
            (
                f"(d) seeds' re-prefill ({d['model']})",
                f"end-to-end tok/s, {d['generated_tokens']} tokens: Execute vs re-prefill",
                fmt(d["execute_grpc"]["e2e_tok_s"], 1),
                fmt(d["reprefill_no_cache"]["e2e_tok_s"], 1),
                f"{fmt(d['speedup_execute_vs_reprefill_e2e'])}x speed-up",
            )
        )
    if "e" in s:
        e = s["e"]
        rows.append(
            (
                f"(e) TTFT, {e['prompt_tokens']}-token prompt",
                f"seconds: chunked ({e['chunk_tokens']}/step, {e['chunked']['steps']} steps)"
                " vs unchunked (1 step)",
                fmt(e["chunked"]["ttft_s"]),
                fmt(e["unchunked"]["ttft_s"]),
                f"{fmt(e['ratio_chunked_vs_unchunked_ttft'], 3)} (chunked/unchunked)",
            )
        )
    if "f" in s:
        f = s["f"]
        rows.append(
            (
                f"(f) TTFT, {f['prefix_tokens']}-token cached prefix",
                f"ms: cold (cache reset) vs warm ({f['suffix_tokens']}-token suffix computed, "
                f"{f['warm_num_cached_prompt_tokens']} tokens cached)",
                fmt(f["warm_ttft_ms"], 1),
                fmt(f["cold_ttft_ms"], 1),
                f"{fmt(f['ratio_cold_vs_warm'], 1)}x cold/warm (>= {f['target_ratio']:g}x)",
            )
        )
    if "g" in s:
        g = s["g"]
        runs = [r for r in g["runs"] if r.get("execute", "stream").startswith("stream")]
        one = next((r for r in runs if r["workers"] == 1), None)
        for run in runs:
            plural = "s" if run["workers"] > 1 else ""
            rows.append(
                (
                    f"(g) fleet, {run['workers']} worker{plural} (tiny)",
                    f"completed tok/s, {g['requests']} concurrent requests x "
                    f"{g['tokens_per_request']} tokens through FleetService.Generate, "
                    f"{g['cpu_count']} CPUs",
                    fmt(run["tok_s"], 1),
                    "" if one is None or run is one else fmt(one["tok_s"], 1),
                    ""
                    if run["speedup_vs_1_worker"] is None or run is one
                    else f"{fmt(run['speedup_vs_1_worker'])}x vs 1 worker",
                )
            )
    if "h" in s:
        h = s["h"]
        target = f">= {h['target_ratio']}x"
        for steps in (1, 8):
            run = h[f"decode_steps_{steps}"]
            rows.append(
                (
                    f"(h) structured outputs, {steps} decode step{'s' if steps > 1 else ''} "
                    "a call (tiny)",
                    f"decode tok/s, {h['batch']} rows x {h['tokens_per_request']} tokens, "
                    f"all under JSON schemas vs free; mask {fmt(run['mask_ms_per_step'], 3)} "
                    "ms a step",
                    fmt(run["constrained_tok_s"], 1),
                    fmt(run["free_tok_s"], 1),
                    _ratio(run["ratio_constrained_vs_free"], target),
                )
            )
        c = h["compile"]
        rows.append(
            (
                "(h) grammar compile",
                f"ms per JSON schema ({c['schemas']}): cold median (max {fmt(c['cold_ms_max'])})"
                f" vs cached; tokenizer conversion {fmt(c['tokenizer_conversion_ms'], 0)} ms once",
                fmt(c["cold_ms_median"], 2),
                fmt(c["cached_ms_median"], 4),
                "",
            )
        )
    rows.extend(_stream_rows(s))
    head = "| Section | Measure | Worker | Baseline | Ratio (target) |\n|---|---|---|---|---|\n"
    return head + "\n".join("| " + " | ".join(r) + " |" for r in rows)


def _stream_rows(s: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Rows for ExecuteStream: the fleet one step ahead vs unary (g), and section (i)."""
    rows: list[tuple[str, str, str, str, str]] = []
    if "g" in s and "ratio_stream_vs_unary" in s["g"]:
        g = s["g"]
        fewest = min(r["workers"] for r in g["runs"])
        by = {r["execute"]: r for r in g["runs"] if r["workers"] == fewest}
        same, unary = by["stream, 1 step ahead"], by["unary"]
        rows.append(
            (
                f"(g) fleet, {unary['workers']} worker (tiny)",
                f"completed tok/s, ExecuteStream 1 step ahead vs unary Execute, "
                f"{g['requests']} concurrent requests, one token a step",
                fmt(same["tok_s"], 1),
                fmt(unary["tok_s"], 1),
                _ratio(g["ratio_stream_vs_unary"], "measured"),
            )
        )
        if "baseline" in by:
            rows.append(
                (
                    f"(g) fleet, {unary['workers']} worker (tiny)",
                    f"completed tok/s, this fleet's default vs the baseline checkout's "
                    f"({g['baseline']['commit'][:12]}), {g['requests']} concurrent requests",
                    fmt(same["tok_s"], 1),
                    fmt(by["baseline"]["tok_s"], 1),
                    _ratio(g["ratio_vs_baseline"], f">= {g['target_ratio_vs_baseline']}"),
                )
            )
    if "i" in s:
        h = s["i"]
        for row in h["rows"]:
            multi = row[f"execute_{h['decode_steps']}_steps"]
            rows.append(
                (
                    f"(i) batch {row['batch']} (tiny)",
                    f"decode tok/s, ExecuteStream 1 step/call depth {h['depth']} vs Execute "
                    f"{h['decode_steps']} steps/call (tokens match: {row['tokens_match']})",
                    fmt(row[f"stream_depth{h['depth']}_one_step"]["decode_tok_s"], 1),
                    fmt(multi["decode_tok_s"], 1),
                    _ratio(row["ratio_stream_vs_multi_step"], ">= 0.9"),
                )
            )
    if "j" in s:
        rows.extend(_kv_rows(s["j"]))
    rows.extend(lora.report_rows(s["k"]) if "k" in s else [])
    return rows


def _kv_rows(j: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Section (j): quantized KV against float KV (SmolLM2 in float16)."""
    rows = []
    base = j["formats"]["0"]
    for bits, target, blocks in (("8", "<= 0.55", ">= 1.8"), ("4", "<= 0.35", ">= 2.8")):
        f = j["formats"][bits]
        rows.append(
            (
                f"(j) {bits}-bit KV",
                "bytes per KV block (DetermineMemory), vs float16",
                str(f["bytes_per_block"]),
                str(base["bytes_per_block"]),
                _ratio(f["bytes_ratio_vs_float"], target),
            )
        )
        rows.append(
            (
                f"(j) {bits}-bit KV",
                "suggested num_blocks, vs float16",
                str(f["suggested_num_blocks"]),
                str(base["suggested_num_blocks"]),
                _ratio(f["suggested_blocks_ratio_vs_float"], blocks),
            )
        )
        rows.append(
            (
                f"(j) {bits}-bit KV",
                f"2048-token requests admitted under {base['memory_limit_bytes'] >> 20} MiB",
                str(f["requests_of_2048_tokens"]),
                str(base["requests_of_2048_tokens"]),
                _ratio(f["requests_ratio_vs_float"], "higher"),
            )
        )
    d, q = j["decode"], j["quality"]
    rows.append(
        (
            f"(j) batch {d['batch']}",
            "decode tok/s, 8-bit KV vs float16 KV",
            fmt(d["kv8_decode_tok_s"], 1),
            fmt(d["float_decode_tok_s"], 1),
            _ratio(d["ratio_kv8_vs_float"], f">= {d['target_ratio']}"),
        )
    )
    for width, target in ((8, ">= 0.9"), (4, "")):
        for key, how, goal in (
            ("answer_share_equal", "answers up to EOS", target),
            ("share_equal", "EOS ignored, free-running", ""),
            ("teacher_forced_share_equal", "EOS ignored, fed", ""),
        ):
            if f"kv{width}_{key}" not in q:
                continue
            rows.append(
                (
                    f"(j) quality {width}-bit",
                    f"share of {q['prompts']} x {q['tokens_per_prompt']} greedy tokens equal to "
                    f"float16 KV's ({how})",
                    fmt(q[f"kv{width}_{key}"], 3),
                    "1",
                    goal,
                )
            )
    return rows
