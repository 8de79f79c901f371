"""`python -m benchmarks.run`: the worker against mlx-lm, side by side, on one machine.

Writes `<out>/<YYYY-MM-DD>-<machine>.json` and a PNG chart next to it, and
prints a Markdown table. See benchmarks/README.md for what each section means.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import chart, report, report_panels
from benchmarks.common import (
    RESULTS,
    build_tiny,
    live_worker,
    machine_facts,
    machine_name,
    temp_dir,
)
from benchmarks.decode import section_a, section_b
from benchmarks.fleet import fleet_rounds, section_g
from benchmarks.kv_quant import float16_copy, section_j
from benchmarks.latency import section_c, section_d, section_e
from benchmarks.lora import section_k
from benchmarks.prefix import section_f
from benchmarks.prompts import SHORT, distinct_prompts, encode, long_tokens
from benchmarks.stream import section_i
from benchmarks.structured import section_h

ALL_SECTIONS = "abcdefghijk"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    p.add_argument("--model", help="model for (a), (b), (e); default: the embedded SmolLM2")
    p.add_argument("--tiny-model", help="model for (c), (d); default: a tiny random llama")
    p.add_argument("--tokens", type=int, help="(a) generated tokens (default 64)")
    p.add_argument("--batch-tokens", type=int, help="(b) tokens per request (default 16)")
    p.add_argument("--batch-sizes", help="(b) comma-separated batch sizes (default 1,4,8,16)")
    p.add_argument("--batch-prompt", type=int, help="(b) prompt tokens per request (default 8)")
    p.add_argument("--overhead-steps", type=int, help="(c) decode steps (default 256)")
    p.add_argument("--seeds-tokens", type=int, help="(d) generated tokens (default 128)")
    p.add_argument("--ttft-prompt", type=int, help="(e) prompt tokens (default 512)")
    p.add_argument("--chunk", type=int, help="(e) prefill chunk (default 64)")
    p.add_argument("--repeats", type=int, help="(a) interleaved repeats, best kept (default 1)")
    p.add_argument("--prefix-tokens", type=int, help="(f) shared prefix tokens (default 1024)")
    p.add_argument("--suffix-tokens", type=int, help="(f) distinct suffix tokens (default 32)")
    p.add_argument("--prefix-repeats", type=int, help="(f) cold/warm pairs, median (default 3)")
    p.add_argument("--fleet-requests", type=int, help="(g) concurrent requests (default 32)")
    p.add_argument("--fleet-tokens", type=int, help="(g) tokens per request (default 256)")
    p.add_argument("--fleet-workers", help="(g) comma-separated worker counts (default 1,2)")
    p.add_argument("--fleet-repeats", type=int, help="(g) interleaved runs, best kept (default 3)")
    p.add_argument(
        "--fleet-baseline",
        type=Path,
        help="(g) a checkout of another version (git worktree add DIR REV) whose fleet and "
        "worker also run, interleaved: ratio_vs_baseline (default: none)",
    )
    p.add_argument("--structured-batch", type=int, help="(h) constrained rows (default 16)")
    p.add_argument("--structured-tokens", type=int, help="(h) tokens per row (default 64)")
    p.add_argument("--structured-repeats", type=int, help="(h) interleaved repeats (default 3)")
    p.add_argument("--stream-sizes", help="(i) comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--stream-tokens", type=int, help="(i) tokens per request (default 128)")
    p.add_argument("--stream-repeats", type=int, help="(i) interleaved repeats (default 3)")
    p.add_argument("--kv-batch", type=int, help="(j) decode batch (default 16)")
    p.add_argument("--kv-tokens", type=int, help="(j) decode tokens per request (default 32)")
    p.add_argument("--kv-quality-tokens", type=int, help="(j) quality tokens (default 48)")
    p.add_argument("--kv-mib", type=int, help="(j) KV MiB beside the weights (default 512)")
    p.add_argument("--lora-tokens", type=int, help="(k) tokens per request (default 64)")
    p.add_argument("--lora-repeats", type=int, help="(k) interleaved repeats (default 7)")
    p.add_argument(
        "--sections",
        default=ALL_SECTIONS,
        help=f"which sections to run, as letters, commas allowed (default {ALL_SECTIONS})",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    p.add_argument("--out", type=Path, help="results directory (default benchmarks/results)")
    args = p.parse_args(argv)
    full = {
        "tokens": 64,
        "batch_tokens": 16,
        "batch_sizes": "1,4,8,16",
        "batch_prompt": 8,
        "overhead_steps": 256,
        "seeds_tokens": 128,
        "ttft_prompt": 512,
        "chunk": 64,
        "repeats": 1,
        "prefix_tokens": 1024,
        "suffix_tokens": 32,
        "prefix_repeats": 3,
        "fleet_requests": 32,
        "fleet_tokens": 256,
        "fleet_workers": "1,2",
        "fleet_repeats": 3,
        "structured_batch": 16,
        "structured_tokens": 64,
        "structured_repeats": 3,
        "stream_sizes": "1,8,32",
        "stream_tokens": 128,
        "stream_repeats": 3,
        "kv_batch": 16,
        "kv_tokens": 32,
        "kv_quality_tokens": 48,
        "kv_mib": 512,
        "lora_tokens": 64,
        "lora_repeats": 7,
    }
    quick = {
        "tokens": 8,
        "batch_tokens": 4,
        "batch_sizes": "1,4",
        "batch_prompt": 4,
        "overhead_steps": 32,
        "seeds_tokens": 16,
        "ttft_prompt": 64,
        "chunk": 16,
        "repeats": 1,
        "prefix_tokens": 64,
        "suffix_tokens": 16,
        "prefix_repeats": 1,
        "fleet_requests": 4,
        "fleet_tokens": 8,
        "fleet_workers": "1,2",
        "fleet_repeats": 1,
        "structured_batch": 4,
        "structured_tokens": 8,
        "structured_repeats": 1,
        "stream_sizes": "1,4",
        "stream_tokens": 16,
        "stream_repeats": 1,
        "kv_batch": 4,
        "kv_tokens": 4,
        "kv_quality_tokens": 4,
        "kv_mib": 64,
        "lora_tokens": 8,
        "lora_repeats": 1,
    }
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "mlx-worker-bench" if args.quick else RESULTS
    return args


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timed(name: str, seconds: dict[str, float], fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    log(f"section ({name}) ...")
    start = time.perf_counter()
    result = fn()
    seconds[name] = round(time.perf_counter() - start, 1)
    log(f"section ({name}) done in {seconds[name]} s")
    return result


def _tiny_worker_sections(
    args: argparse.Namespace, tiny: Path, wanted: set[str], seconds: dict[str, float]
) -> dict[str, Any]:
    """Sections (c), (d) and (i): one worker on the tiny model."""
    from mlx_lm import load

    sections: dict[str, Any] = {}
    model, tokenizer = load(str(tiny))
    prompt = encode(tokenizer, SHORT)
    with live_worker(tiny) as worker:
        if "i" in wanted:
            sizes = [int(x) for x in args.stream_sizes.split(",")]
            many = distinct_prompts(tokenizer, max(sizes), 16)
            sections["i"] = timed(
                "i",
                seconds,
                lambda: section_i(
                    worker, many, sizes, args.stream_tokens, repeats=args.stream_repeats
                ),
            )
        if "c" in wanted:
            steps = args.overhead_steps
            sections["c"] = timed("c", seconds, lambda: section_c(worker, prompt, steps))
        if "d" in wanted:
            n = args.seeds_tokens
            sections["d"] = timed("d", seconds, lambda: section_d(worker, model, prompt, n))
    return sections


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mlx_lm import load

    from mlx_worker_svc.cli import envs
    from mlx_worker_svc.engine.model.embedded import ensure_default_model

    started = time.perf_counter()
    embedded = ensure_default_model(envs.cache_root(), show_progress=False)
    main_model = Path(args.model) if args.model else embedded
    sections: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    notes: list[str] = []
    wanted = _wanted(args.sections)
    with temp_dir() as tmp:
        if wanted & {"c", "d", "g", "h", "i", "k"}:
            tiny = Path(args.tiny_model) if args.tiny_model else build_tiny(tmp, embedded)
        if wanted & {"c", "d", "i"}:
            sections.update(_tiny_worker_sections(args, tiny, wanted, seconds))
        if "h" in wanted:
            sections["h"] = timed("h", seconds, lambda: _structured(args, tiny))
        if "k" in wanted:
            sections["k"] = timed("k", seconds, lambda: _lora(args, tiny, tmp))
        if wanted & {"a", "b", "e", "f"}:
            model, tokenizer = load(str(main_model))
        if wanted & {"a", "b", "e"}:
            with live_worker(main_model) as worker:
                if "a" in wanted:
                    prompt = encode(tokenizer, SHORT)
                    sections["a"] = timed(
                        "a",
                        seconds,
                        lambda: section_a(
                            worker, model, tokenizer, prompt, args.tokens, repeats=args.repeats
                        ),
                    )
                if "b" in wanted:
                    sizes = [int(x) for x in args.batch_sizes.split(",")]
                    prompts = distinct_prompts(tokenizer, max(sizes), args.batch_prompt)
                    sections["b"] = timed(
                        "b",
                        seconds,
                        lambda: section_b(worker, model, prompts, sizes, args.batch_tokens),
                    )
                if "e" in wanted:
                    long = long_tokens(tokenizer, args.ttft_prompt)
                    sections["e"] = timed("e", seconds, lambda: section_e(worker, long, args.chunk))
        if "f" in wanted:
            prefix = long_tokens(tokenizer, args.prefix_tokens)
            first, second = distinct_prompts(tokenizer, 2, args.suffix_tokens)
            with live_worker(main_model, prefix_caching=True) as worker:
                sections["f"] = timed(
                    "f",
                    seconds,
                    lambda: section_f(worker, prefix, (first, second), args.prefix_repeats),
                )
        if "g" in wanted:
            _, tokenizer = load(str(tiny))
            counts = [int(x) for x in args.fleet_workers.split(",")]
            # Rounds of distinct prompts: one to warm each fleet, one per measured run.
            baseline = args.fleet_baseline
            rounds = fleet_rounds(counts, args.fleet_repeats, baseline is not None)
            prompts = distinct_prompts(tokenizer, rounds * args.fleet_requests, 16)
            sections["g"] = timed(
                "g",
                seconds,
                lambda: section_g(
                    tiny,
                    prompts,
                    args.fleet_tokens,
                    counts,
                    tmp,
                    repeats=args.fleet_repeats,
                    baseline=baseline,
                ),
            )
        if "j" in wanted:
            sections["j"] = timed("j", seconds, lambda: _kv_quant(args, embedded, tmp))
    notes.extend(_notes(args, sections))
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine_facts(),
        "models": {
            "a_b_e_f": str(main_model),
            "c_d_i": args.tiny_model or "tiny random llama (tests/tiny_model.py), float32",
            "g": args.tiny_model or "tiny random llama (tests/tiny_model.py), float32",
            "h": args.tiny_model or "tiny random llama (tests/tiny_model.py), float32",
            "j": "the embedded SmolLM2, weights expanded to float16",
            "k": args.tiny_model or "tiny random llama (tests/tiny_model.py), float32",
        },
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "run_seconds": round(time.perf_counter() - started, 1),
        "section_seconds": seconds,
        "sections": sections,
        "notes": notes,
    }


def _lora(args: argparse.Namespace, tiny: Path, tmp: Path) -> dict[str, Any]:
    from mlx_lm import load

    _, tokenizer = load(str(tiny))
    prompts = distinct_prompts(tokenizer, 8, 16)
    return section_k(tiny, tmp / "adapters", prompts, args.lora_tokens, repeats=args.lora_repeats)


def _kv_quant(args: argparse.Namespace, embedded: Path, tmp: Path) -> dict[str, Any]:
    from mlx_lm import load

    model = float16_copy(tmp, embedded)
    _, tokenizer = load(str(model))
    return section_j(
        model,
        tokenizer,
        batch=args.kv_batch,
        decode_tokens=args.kv_tokens,
        quality_tokens=args.kv_quality_tokens,
        kv_mib=args.kv_mib,
    )


def _structured(args: argparse.Namespace, tiny: Path) -> dict[str, Any]:
    from mlx_lm import load

    _, tokenizer = load(str(tiny))
    rows = distinct_prompts(tokenizer, args.structured_batch, 8)
    with live_worker(tiny) as worker:
        return section_h(worker, rows, args.structured_tokens, args.structured_repeats, tiny)


def _notes(args: argparse.Namespace, sections: dict[str, Any]) -> list[str]:
    notes = [
        "Every path runs each shape once untimed before it is measured (warm).",
        "Greedy, EOS ignored on every side: each path generates exactly the same token count.",
        "Decode tok/s runs from the first token's arrival to the last (prefill excluded).",
    ]
    if "b" in sections:
        notes.append(
            f"(b) generates --batch-tokens={args.batch_tokens} tokens per request (not "
            f"--tokens={args.tokens}) so the default run fits in about 10 minutes on a CPU."
        )
    if "f" in sections:
        f = sections["f"]
        notes.append(
            f"(f) runs on its own worker with the prefix cache on (a-e run with it off); "
            f"{f['repeats']} cold/warm pairs, medians, after one untimed pair."
        )
    if "g" in sections:
        g = sections["g"]
        notes.append(
            f"(g) runs worker and fleet processes on the tiny model: {g['requests']} concurrent "
            f"requests x {g['tokens_per_request']} tokens through FleetService.Generate; every "
            f"process shares the machine's {g['cpu_count']} CPUs."
        )
    if "h" in sections:
        h = sections["h"]
        notes.append(
            f"(h) decodes {h['batch']} rows x {h['tokens_per_request']} tokens on the tiny model, "
            "every row under its own JSON schema against the same rows free; best of "
            f"{h['repeats']} interleaved runs each."
        )
    if "d" in sections:
        d = sections["d"]
        note = (
            f"(d) runs on the tiny model ({d['generated_tokens']} tokens, "
            f"{d['prompt_tokens']}-token prompt), because re-prefilling the main model "
            "(4-bit SmolLM2 on a CPU) every token would take many minutes."
        )
        e = sections.get("e")
        rate = e["unchunked"]["prefill_tok_s"] if e else None
        if rate:
            p, n = d["prompt_tokens"], d["generated_tokens"]
            forwards = sum(p + i for i in range(n))
            d["main_model_reprefill_estimate"] = {
                "token_forwards": forwards,
                "prefill_tok_s_measured_in_e": rate,
                "estimated_seconds": round(forwards / rate, 1),
            }
            note += f" Estimate for the main model: {forwards} token-forwards at {rate} tok/s"
            note += f" = about {forwards / rate / 60:.1f} minutes."
        notes.append(note)
    return notes


def _wanted(sections: str) -> set[str]:
    """The section letters of --sections: "aci" and "a,c,i" alike."""
    return set(sections) - {","}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{results['date']}-{machine_name()}"
    ran = "".join(sorted(_wanted(args.sections)))
    if ran != ALL_SECTIONS:  # a partial run does not overwrite the day's full one
        stem += f"-{ran}"
    stem += "-quick" if args.quick else ""
    json_path = args.out / f"{stem}.json"
    png_path = args.out / f"{stem}.png"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    subtitle = f"{machine_name()}, {results['date']}, run {results['run_seconds']} s"
    chart.draw("mlx-worker-svc benchmarks", subtitle, report_panels.panels(results), png_path)
    print(report.markdown(results))
    print(f"\nrun time {results['run_seconds']} s; wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
