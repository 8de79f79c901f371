"""Turns a results dict into the chart panels of `make bench` (chart.py draws them).

One panel per section family present in the results, each bar labelled with its
figure and, where the section has one, the target line it is held to.
"""

from __future__ import annotations

from typing import Any

from benchmarks import lora
from benchmarks.chart import BASELINE, WORKER, Bar, Panel
from benchmarks.report import fmt


def panels(results: dict[str, Any]) -> list[Panel]:
    s = results["sections"]
    more = [lora.report_panel(s["k"])] if "k" in s else []
    return _panels_a_to_i(s) + ([_kv_panel(s["j"])] if "j" in s else []) + more


def _panels_a_to_i(s: dict[str, Any]) -> list[Panel]:
    out: list[Panel] = []
    if "a" in s or "b" in s:
        bars: list[Bar] = []
        if "a" in s:
            a = s["a"]
            for key, name in (("generate", "Generate"), ("execute", "Execute")):
                value = a[f"ratio_{key}_vs_raw"]
                bars.append(Bar(f"(a) {name} / stream_generate", value, fmt(value, 3)))
        if "b" in s:
            for row in s["b"]["rows"]:
                value = row["ratio_execute_vs_batch_generator"]
                bars.append(Bar(f"(b) B={row['batch']} Execute / BatchGen", value, fmt(value, 3)))
        out.append(
            Panel("Decode tokens/s ratio, worker / mlx-lm", bars, 1.0, ">= 1.0 (A: >= 0.95)")
        )
    if "c" in s:
        c = s["c"]
        over, inner = c["overhead_wall_minus_forward"], c["worker_internal_total_minus_forward"]
        pairs = [
            ("(c) wall - forward p50", over.get("p50_ms")),
            ("(c) wall - forward p99", over.get("p99_ms")),
            ("(c) total - forward p50", inner.get("p50_ms")),
            ("(c) total - forward p99", inner.get("p99_ms")),
            ("(c) in-process wall - fwd p50", c["in_process_wall_minus_forward"].get("p50_ms")),
            ("(c) empty Execute RTT p50", c["empty_execute_round_trip"].get("p50_ms")),
        ]
        bars = [Bar(label, v, f"{fmt(v, 3)} ms") for label, v in pairs]
        out.append(Panel("Execute step overhead, tiny model (ms)", bars, 0.5, "P50 < 0.5 MS"))
    if "d" in s:
        d = s["d"]
        bars = [
            Bar("(d) Execute", d["execute_grpc"]["e2e_tok_s"], "", WORKER),
            Bar("(d) mlx-lm generate_step", d["mlx_lm_generate_step"]["e2e_tok_s"], "", BASELINE),
            Bar("(d) re-prefill, no cache", d["reprefill_no_cache"]["e2e_tok_s"], "", BASELINE),
        ]
        for bar in bars:
            bar.text = f"{fmt(bar.value, 1)} tok/s"
        out.append(Panel(f"Tiny model, {d['generated_tokens']} tokens, end to end", bars))
    if "e" in s:
        e = s["e"]
        bars = [
            Bar(f"(e) chunked ({e['chunk_tokens']}/step)", e["chunked"]["ttft_s"], ""),
            Bar("(e) unchunked (1 step)", e["unchunked"]["ttft_s"], ""),
        ]
        for bar in bars:
            bar.text = f"{fmt(bar.value, 2)} s"
        out.append(Panel(f"Time to first token, {e['prompt_tokens']}-token prompt", bars))
    if "f" in s:
        f = s["f"]
        bars = [
            Bar("(f) warm (prefix cached)", f["warm_ttft_ms"], "", WORKER),
            Bar("(f) cold (prefix cache reset)", f["cold_ttft_ms"], "", BASELINE),
        ]
        for bar in bars:
            bar.text = f"{fmt(bar.value, 1)} ms"
        bars[0].text += f" ({fmt(f['ratio_cold_vs_warm'], 1)}x faster)"
        title = f"TTFT, {f['prefix_tokens']}-token shared prefix + {f['suffix_tokens']} tokens"
        out.append(Panel(title, bars))
    if "g" in s:
        g = s["g"]
        bars = []
        for run in g["runs"]:
            plural = "s" if run["workers"] > 1 else ""
            text = f"{fmt(run['tok_s'], 1)} tok/s"
            label = f"(g) {run['workers']} worker{plural}, {run.get('execute', 'stream')}"
            if run.get("execute") == "baseline":
                label += f" {g['baseline']['commit'][:7]}"
            bars.append(Bar(label, run["tok_s"], text))
        title = (
            f"Fleet throughput, {g['requests']} x {g['tokens_per_request']} tokens, "
            f"tiny model, {g['cpu_count']} CPUs"
        )
        out.append(Panel(title, bars))
    out.extend(
        make(s[key]) for key, make in (("h", _structured_panel), ("i", _stream_panel)) if key in s
    )
    return out


def _kv_panel(j: dict[str, Any]) -> Panel:
    """Section (j)'s ratios: bytes per block, decode speed, tokens equal to float16 KV's."""
    bars = []
    for bits in ("8", "4"):
        value = j["formats"][bits]["bytes_ratio_vs_float"]
        bars.append(Bar(f"(j) {bits}-bit bytes/block / float16", value, fmt(value, 3)))
    value = j["decode"]["ratio_kv8_vs_float"]
    bars.append(Bar(f"(j) B={j['decode']['batch']} decode 8-bit / float16", value, fmt(value, 3)))
    for bits in ("8", "4"):
        quality = j["quality"]
        value = quality.get(f"kv{bits}_answer_share_equal", quality[f"kv{bits}_share_equal"])
        bars.append(Bar(f"(j) {bits}-bit answer tokens equal to float16", value, fmt(value, 3)))
    return Panel("Quantized KV against float16 KV, SmolLM2 float16", bars)


def _stream_panel(i: dict[str, Any]) -> Panel:
    """Section (i): ExecuteStream against multi-step Execute, one bar a batch size."""
    bars = []
    for row in i["rows"]:
        value = row["ratio_stream_vs_multi_step"]
        label = f"(i) B={row['batch']} stream / {i['decode_steps']} steps"
        bars.append(Bar(label, value, fmt(value, 3)))
    title = (
        f"Decode tok/s, ExecuteStream (depth {i['depth']}) / Execute with "
        f"{i['decode_steps']} steps a call, {i['generated_tokens_per_request']} tokens, tiny"
    )
    target = i["target_ratio_stream_vs_multi_step"]
    return Panel(title, bars, target, f">= {target}")


def _structured_panel(h: dict[str, Any]) -> Panel:
    """Section (h): constrained rows against free ones, at 1 and 8 steps a call."""
    bars = []
    for steps in (1, 8):
        value = h[f"decode_steps_{steps}"]["ratio_constrained_vs_free"]
        bars.append(Bar(f"(h) {steps} step(s) a call", value, fmt(value, 3)))
    title = f"Decode tok/s, {h['batch']} rows under JSON schemas / free, tiny model"
    return Panel(title, bars, h["target_ratio"], f">= {h['target_ratio']}")
