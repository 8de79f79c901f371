"""`python -m benchmarks.gpu.bench_gpu`: the worker against raw mlx-lm on one GPU.

Builds a random-weight Llama-3.2-1B-shaped model (bf16 and a 4-bit copy), then
for each dtype and batch size runs raw mlx-lm in this process
(`stream_generate` at batch 1, `BatchGenerator` at every size) and the worker
in its own process over gRPC on loopback on two paths (`--paths`): Execute, one
step per token, driven by benchmarks/execute_client.py, and one Generate stream
per request, all started together and scheduled by the worker. Every shape is
warmed first; prefill (TTFT) and decode (tokens after the first) are reported
apart. A greedy parity check on the bf16 model compares the worker's tokens
with mlx-lm's. Writes `<out>/<date>-<machine>-gpu.json` and `.md` after every
measurement, so a run stopped at its time limit keeps what it measured.
`--smoke` runs a tiny shape on any machine (CPU included) in about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks.baselines import raw_batch, raw_stream
from benchmarks.common import Worker, machine_name, ratio, summary_ms, temp_dir
from benchmarks.execute_client import warm_up
from benchmarks.gpu import report
from benchmarks.gpu.report import PATHS
from benchmarks.gpu.synthetic import LLAMA_1B, SMOKE, build_models
from benchmarks.gpu.worker_runs import (
    QUANTIZED_ONLY,
    VARIANTS,
    bench_worker,
    best_run,
    decode_rate,
    parity,
    rounds,
    warm_worker,
    worker_once,
    worker_paths,
)

RESULTS = Path(__file__).resolve().parent.parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.bench_gpu", description=__doc__)
    p.add_argument("--dtypes", default="bf16,4bit", help="comma-separated: bf16, 4bit")
    p.add_argument("--batch-sizes", default="1,8,32,64,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128, help="generated tokens per request")
    p.add_argument(
        "--warm-tokens",
        type=int,
        help="tokens of each warm-up run (default --new-tokens: every KV length the timed "
        "runs reach is warmed, since MLX's CUDA backend builds kernels for new shapes)",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per shape and path, best kept")
    p.add_argument(
        "--sample-s",
        type=float,
        default=10.0,
        help="then more rounds of runs (up to --max-repeats) until a shape's timed rounds "
        "took this long: a round at batch 1 lasts well under a second, and the host's speed "
        "varies by tens of percent from one to the next",
    )
    p.add_argument("--max-repeats", type=int, default=12)
    p.add_argument("--parity-prompts", type=int, default=4)
    p.add_argument("--parity-tokens", type=int, default=64)
    p.add_argument(
        "--variants",
        default="speculate,after,masked,quantized",
        help=f"worker variants, one worker process each ({', '.join(VARIANTS)}); the first "
        "is compared with raw mlx-lm, the others are measured beside it",
    )
    p.add_argument(
        "--paths",
        default="execute,multistep,stream,generate",
        help="worker paths: execute (one Execute RPC per step), multistep (Execute calls of "
        "--decode-steps decode steps each), stream (one decode step a call through "
        "ExecuteStream, --stream-depth steps in flight), generate (one Generate stream per "
        "request, started together)",
    )
    p.add_argument(
        "--stream-depth",
        type=int,
        default=2,
        help="steps in flight on the stream path (2: one step ahead)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=8,
        help="ExecuteRequest.num_decode_steps of the multistep path's decode calls",
    )
    p.add_argument("--deadline-s", type=float, default=420.0, help="skip shapes past this")
    p.add_argument("--models", type=Path, help="build (or reuse) the models here")
    p.add_argument("--out", type=Path, help="results directory (default benchmarks/results)")
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes (CPU-friendly)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.prompt_tokens, args.new_tokens = "1,2,4", 16, 8
        args.parity_prompts, args.parity_tokens, args.sample_s = 2, 8, 0.0
    if args.warm_tokens is None:
        args.warm_tokens = args.new_tokens
    args.shape = SMOKE if args.smoke else LLAMA_1B
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown --variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    args.path_list = [x for x in args.paths.split(",") if x]
    if not args.path_list or set(args.path_list) - set(PATHS):
        p.error(f"--paths: one or more of {', '.join(PATHS)}")
    return args


def log(message: str) -> None:
    print(f"[bench-gpu {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def gpu_facts() -> dict[str, Any]:
    """GPU name, driver and CUDA version (nvidia-smi), MLX and mlx-lm versions."""
    import platform
    import subprocess
    from importlib.metadata import version

    facts: dict[str, Any] = {
        "machine": machine_name(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "mlx_device": str(mx.default_device()),
        "python": platform.python_version(),
    }
    with contextlib.suppress(RuntimeError, AttributeError):
        facts["mlx_device_info"] = {k: str(v) for k, v in dict(mx.device_info()).items()}
    smi: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 30}
    query = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        out = subprocess.run(["nvidia-smi", *query], check=False, **smi)
        name, driver, memory = (x.strip() for x in out.stdout.splitlines()[0].split(","))
        facts.update(gpu=name, driver=driver, gpu_memory=memory)
        header = subprocess.run(["nvidia-smi"], check=False, **smi).stdout.split("CUDA Version:")
        facts["cuda_driver_api"] = header[1].split()[0] if len(header) > 1 else None
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        facts.update(gpu=None, driver=None)
    return facts


def prompt_set(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` distinct prompts of random ordinary token ids (no BOS/EOS)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab - 2) for _ in range(length)] for _ in range(count)]


def _step_times(run: Any) -> dict[str, Any]:
    decode = [s for s in run.steps[1:] if s.sampled]
    return {
        "client_wall": summary_ms([s.wall_ns for s in decode]),
        "worker_total": summary_ms([s.total_ns for s in decode]),
        "worker_forward": summary_ms([s.forward_ns for s in decode]),
    }


def _path_fields(best: dict[str, dict[str, Any]]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for path, got in best.items():
        fields[f"worker_{path}"] = got["stats"]
        if "run" in got:
            fields["worker_step_ms"] = _step_times(got["run"])
    return fields


def measure_shape(
    model: Any, tokenizer: Any, worker: Worker, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, Any]:
    """One batch size: warm every path, then raw and worker runs, interleaved.

    Each repeat runs raw mlx-lm and every worker path, so that a drift of the
    machine's speed (the host's clock, another tenant) reaches both sides alike;
    raw runs first in even repeats and last in odd ones, so that neither side
    always gets the first run after the warm-up (often the fastest of a shape
    in runs 12 to 14, raw's then).
    """
    size, n = len(prompts), args.new_tokens
    single = size == 1
    if single:
        raw_stream(model, tokenizer, prompts[0], args.warm_tokens)
    raw_batch(model, prompts, args.warm_tokens)
    warm_worker(worker, prompts, args)
    raw_runs: list[dict[str, Any]] = []
    bg_runs: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {}

    def raw_once() -> None:
        if single:
            timeline, tokens = raw_stream(model, tokenizer, prompts[0], n)
            raw_runs.append({"stats": timeline.stats(), "tokens": [tokens]})
        timeline, batch_tokens = raw_batch(model, prompts, n)
        bg_runs.append({"stats": timeline.stats(), "tokens": batch_tokens})

    for done in rounds(args):
        if done % 2:
            worker_once(worker, prompts, args, runs)
            raw_once()
        else:
            raw_once()
            worker_once(worker, prompts, args, runs)
    best = {path: best_run(got) for path, got in runs.items()}
    bg = best_run(bg_runs)
    raw = best_run(raw_runs) if single else bg
    # Raw measured two ways: the timeline's decode rate and, for BatchGenerator,
    # mlx-lm's own generation_tps; the faster one is the baseline.
    raw_rate = max(decode_rate(raw["stats"]), float(raw["stats"].get("generation_tps") or 0.0))
    row: dict[str, Any] = {
        "batch": size,
        "raw_path": "stream_generate" if single else "BatchGenerator",
        "raw": raw["stats"],
        "raw_baseline_tok_s": round(raw_rate, 1),
        **_path_fields(best),
        "prefill_tok_s": {"raw": _prefill_rate(raw["stats"], size, len(prompts[0]))},
        "requests_with_identical_tokens": {},
    }
    for path, got in best.items():
        row[f"ratio_{path}_vs_raw"] = ratio(decode_rate(got["stats"]), raw_rate)
        row["prefill_tok_s"][f"worker_{path}"] = _prefill_rate(got["stats"], size, len(prompts[0]))
        row["requests_with_identical_tokens"][path] = sum(
            a == b for a, b in zip(got["tokens"], raw["tokens"], strict=True)
        )
    fastest = max(best, key=lambda path: decode_rate(best[path]["stats"]))
    row["worker_best"] = {
        "path": PATHS[fastest],
        "decode_tok_s": best[fastest]["stats"].get("decode_tok_s"),
        "ratio_vs_raw": row[f"ratio_{fastest}_vs_raw"],
    }
    # Every timed run's decode rate, in run order (the table keeps the best of each side).
    row["decode_tok_s_runs"] = {
        "raw": [decode_rate(r["stats"]) for r in (raw_runs if single else bg_runs)],
        **{path: [decode_rate(r["stats"]) for r in got] for path, got in runs.items()},
    }
    if single:
        row["batch_generator"] = bg["stats"]
    return row


def measure_worker(worker: Worker, prompts: list[list[int]], args: argparse.Namespace) -> Any:
    """Another worker variant at one batch size: its paths, warmed, best run kept."""
    return _path_fields(worker_paths(worker, prompts, args))


def _prefill_rate(stats: dict[str, Any], size: int, prompt: int) -> float | None:
    ttft = stats.get("ttft_s")
    return round(size * prompt / ttft, 1) if ttft else None


class _Run:
    """One benchmark run's state: options, prompts, model directories, results."""

    def __init__(self, args: argparse.Namespace, results: dict[str, Any], save: Any) -> None:
        self.args, self.results, self.save = args, results, save
        self.started = time.monotonic()
        self.sizes = [int(b) for b in args.batch_sizes.split(",")]
        self.prompts = prompt_set(
            max(self.sizes), args.prompt_tokens, int(args.shape["vocab_size"])
        )

    def late(self, what: str) -> bool:
        """Past --deadline-s: `what` is skipped (and recorded so)."""
        if time.monotonic() - self.started <= self.args.deadline_s:
            return False
        self.results["skipped"].append(f"{what}: past --deadline-s")
        return True

    def worker(self, model_dir: Path, variant: str) -> Any:
        log(f"{model_dir.name}: starting a worker process (variant {variant})")
        return bench_worker(model_dir, self.sizes, self.args, variant)

    def shapes(self, dtype: str, variant: str, measure: Any) -> None:
        for size in self.sizes:
            if self.late(f"{dtype} {variant} batch {size}"):
                continue
            log(f"{dtype}: batch {size}, variant {variant}")
            try:
                measure(size)
            except Exception as exc:
                log(f"{dtype} batch {size} ({variant}) failed: {exc!r}")
                self.results["errors"].append(f"{dtype} {variant} batch {size}: {exc!r}")
            self.save()

    def compare(self, dtype: str, model_dir: Path, variant: str) -> None:
        """Raw mlx-lm against the worker's first variant, every size; parity on bf16."""
        from mlx_lm import load

        args, rows = self.args, self.results["rows"].setdefault(dtype, [])
        model, tokenizer = load(str(model_dir))
        with self.worker(model_dir, variant) as worker:
            warm_up(worker, self.sizes, [args.prompt_tokens - 1])

            def measure(size: int) -> None:
                row = measure_shape(model, tokenizer, worker, self.prompts[:size], args)
                rows.append({**row, "variant": variant, "variants": {}})

            self.shapes(dtype, variant, measure)
            if dtype == "bf16" and args.parity_prompts and not self.late("parity"):
                log("bf16: greedy parity check")
                chosen = self.prompts[: args.parity_prompts]
                try:
                    self.results["parity"] = parity(
                        model,
                        tokenizer,
                        worker,
                        chosen,
                        args.parity_tokens,
                        decode_steps=args.decode_steps,
                    )
                except Exception as exc:
                    self.results["errors"].append(f"parity: {exc!r}")
                self.save()

    def beside(self, dtype: str, model_dir: Path, variant: str) -> None:
        """Another worker variant, measured beside the compared rows."""
        rows = {r["batch"]: r for r in self.results["rows"].get(dtype, [])}
        with self.worker(model_dir, variant) as worker:
            warm_up(worker, self.sizes, [self.args.prompt_tokens - 1])

            def measure(size: int) -> None:
                if size in rows:
                    got = measure_worker(worker, self.prompts[:size], self.args)
                    rows[size]["variants"][variant] = got

            self.shapes(dtype, variant, measure)


def run(args: argparse.Namespace, results: dict[str, Any], save: Any) -> None:
    """Raw against the first variant for every dtype first, then the other variants."""
    dtypes = [d for d in args.dtypes.split(",") if d]
    variants = [v for v in args.variants.split(",") if v]
    state = _Run(args, results, save)
    with temp_dir() as tmp:
        root = args.models or tmp / "models"
        log(f"building the models ({', '.join(dtypes)}) under {root}")
        start = time.monotonic()
        dirs = build_models(root, args.shape, dtypes)
        results["build_seconds"] = round(time.monotonic() - start, 1)
        for dtype in dtypes:
            if not state.late(f"{dtype}: raw and {variants[0]}"):
                state.compare(dtype, dirs[dtype], variants[0])
                gc.collect()  # the raw model goes with `compare`'s frame
                mx.clear_cache()
        for variant in variants[1:]:
            for dtype in dtypes:
                if variant in QUANTIZED_ONLY and dtype == "bf16":
                    continue
                if not state.late(f"{dtype}: {variant}"):
                    state.beside(dtype, dirs[dtype], variant)
    results["run_seconds"] = round(time.monotonic() - state.started, 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    stem = out / f"{date}-{machine_name()}-gpu{'-smoke' if args.smoke else ''}"
    results: dict[str, Any] = {
        "date": date,
        "machine": gpu_facts(),
        "model": {
            "shape": "smoke" if args.smoke else "Llama-3.2-1B (random weights)",
            **{k: v for k, v in args.shape.items() if k != "rope_scaling"},
        },
        "options": {k: str(v) for k, v in vars(args).items() if k != "shape"},
        "rows": {},
        "skipped": [],
        "errors": [],
    }

    def save() -> None:
        stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
        stem.with_suffix(".md").write_text(report.markdown(results) + "\n")

    log(f"machine: {results['machine']}")
    run(args, results, save)
    save()
    print(report.markdown(results))
    print(f"\nwrote {stem}.json and {stem}.md")
    parity_ok = results.get("parity", {}).get("ok", True)
    if not parity_ok:
        print("PARITY FAILED: the worker's greedy tokens differ from mlx-lm's", file=sys.stderr)
    return 0 if parity_ok else 2


if __name__ == "__main__":
    raise SystemExit(main())
