"""`python -m benchmarks.gpu.profile_step`: where a worker decode step's time goes.

Runs the worker on the benchmark's random model and, per dtype and batch size,
prints raw mlx-lm's decode step (BatchGenerator, or stream_generate at batch 1)
beside the worker's (Execute calls of `--decode-steps` decode steps each; best
of `--repeats`, runs interleaved) through each of `--transports`:

- `direct`: the servicer's Execute called in this process (no gRPC);
- `grpc`: the same in-process worker over gRPC on loopback;
- `process`: a worker process (`mlx-worker serve`) over gRPC, as the benchmark runs it.

The differences split the worker's cost between engine, gRPC and process
boundary. Then one more `direct` run under cProfile (the timed runs are not
profiled: the profiler slows the host's Python, which at batch 1 is the
step), the engine thread's functions by own time: the time spent waiting for
the device shows up in the call that reads the sampled tokens
(`sampling.read_tokens`), the host's work in the rest. `--smoke` runs a tiny
shape on any machine.

`--anatomy` instead splits a serial decode step of mlx-lm's model (no worker,
no look-ahead) into the host's graph construction (Python), the launch
(`mx.async_eval`: MLX encodes and submits the kernels) and the wait for the
device after it: whether a step is bound by the host or by the device. With
`--fuse` the same model with its weights' transposed views kept
(`engine/rewrite/transposed.py`), and with its projections fused too
(`engine/rewrite/fused.py`, single rows and decode batches), and
the fused copy's own decode step (`engine/rewrite/decode_step.py`), run beside it,
interleaved, and their greedy tokens are compared with mlx-lm's.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.baselines import raw_batch, raw_stream
from benchmarks.common import Worker, live_worker, temp_dir
from benchmarks.execute_client import in_process_call, run_execute
from benchmarks.gpu.bench_gpu import prompt_set
from benchmarks.gpu.synthetic import LLAMA_1B, SMOKE, build_models
from benchmarks.gpu.worker_runs import bench_worker, kv_blocks
from mlx_worker_svc.client.execute_loop import ExecuteCall
from mlx_worker_svc.engine.rewrite import decode_step, fused, transposed
from mlx_worker_svc.engine.runner import ModelRunner
from mlx_worker_svc.engine.sampling import greedy


def _step_ms(stats: dict[str, Any], rows: int) -> float:
    return round(rows * 1e3 / float(stats["decode_tok_s"]), 3)


def profile_runner(profiler: cProfile.Profile) -> Any:
    """Profiles every `ModelRunner.run` (on the engine thread) into `profiler`."""
    original = ModelRunner.run

    def run(self: ModelRunner, work: Any) -> Any:
        profiler.enable()
        try:
            return original(self, work)
        finally:
            profiler.disable()

    ModelRunner.run = run  # type: ignore[method-assign]
    return original


TRANSPORTS = ("direct", "grpc", "process")


def raw_step_ms(model: Any, tokenizer: Any, batch: list[list[int]], tokens: int) -> float:
    """Raw mlx-lm's decode step: stream_generate alone, BatchGenerator for a batch."""
    if len(batch) == 1:
        timeline = raw_stream(model, tokenizer, batch[0], tokens)[0]
    else:
        timeline = raw_batch(model, batch, tokens)[0]
    return _step_ms(timeline.stats(), len(batch))


def _workers(
    stack: contextlib.ExitStack, model_dir: Path, sizes: list[int], args: argparse.Namespace
) -> dict[str, tuple[Worker, ExecuteCall | None]]:
    """The worker each transport drives, and its Execute call (None: the gRPC stub).

    The worker process is the benchmark's own (`bench_worker`: its environment,
    limits and KV blocks); the in-process one has the same KV blocks.
    """
    transports = args.transport_list
    out: dict[str, tuple[Worker, ExecuteCall | None]] = {}
    if {"direct", "grpc"} & set(transports):
        live = stack.enter_context(live_worker(model_dir, num_blocks=kv_blocks(sizes, args)))
        out["direct"], out["grpc"] = (live, in_process_call(live)), (live, None)
    if "process" in transports:
        out["process"] = (stack.enter_context(bench_worker(model_dir, sizes, args)), None)
    return {t: out[t] for t in transports}


def measure(model_dir: Path, sizes: list[int], args: argparse.Namespace) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    vocab = int(args.shape["vocab_size"])
    prompts = prompt_set(max(sizes), args.prompt_tokens, vocab)
    steps = args.decode_steps
    with contextlib.ExitStack() as stack:
        workers = _workers(stack, model_dir, sizes, args)
        profiled = workers.get("direct")
        for size in sizes:
            batch = prompts[:size]
            # Whole runs: a decode step's shapes change with the KV length, and
            # MLX's CUDA backend builds kernels for each new shape on first use.
            raw_step_ms(model, tokenizer, batch, args.new_tokens)
            for worker, call in workers.values():
                run_execute(worker, batch, args.new_tokens, call=call, decode_steps=steps)
            raw: list[float] = []
            mine: dict[str, list[float]] = {t: [] for t in workers}
            for _ in range(args.repeats):
                raw.append(raw_step_ms(model, tokenizer, batch, args.new_tokens))
                for transport, (worker, call) in workers.items():
                    run = run_execute(worker, batch, args.new_tokens, call=call, decode_steps=steps)
                    mine[transport].append(_step_ms(run.timeline.stats(), size))
            print(
                f"\n## {model_dir.name} batch {size}: decode step ms ({steps} steps a call), "
                f"raw {min(raw)} (runs {raw})",
                flush=True,
            )
            for transport, runs in mine.items():
                print(f"- worker, {transport}: {min(runs)} (runs {runs})", flush=True)
            if profiled is None:
                continue
            profiler = cProfile.Profile()
            original = profile_runner(profiler)
            try:
                worker, call = profiled
                run_execute(worker, batch, args.new_tokens, call=call, decode_steps=steps)
            finally:
                ModelRunner.run = original  # type: ignore[method-assign]
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
            table = text.getvalue()
            print(table[table.find("ncalls") :].strip(), flush=True)


def anatomy(model: Any, prompts: list[list[int]], steps: int) -> tuple[dict[str, float], list[Any]]:
    """Median ms of a serial decode step's parts (build, launch, wait, their sum); the tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = greedy(model(mx.array(prompts, dtype=mx.uint32), cache=cache)[:, -1, :])
    mx.eval(tokens)
    parts: dict[str, list[float]] = {"build": [], "launch": [], "wait": []}
    sampled = []
    for _ in range(steps):
        start = time.perf_counter()
        tokens = greedy(decode_step.logits(model, tokens, cache))
        built = time.perf_counter()
        mx.async_eval(tokens)  # type: ignore[no-untyped-call]
        launched = time.perf_counter()
        mx.eval(tokens)
        done = time.perf_counter()
        parts["build"].append(built - start)
        parts["launch"].append(launched - built)
        parts["wait"].append(done - launched)
        sampled.append(tokens)
    got = {k: round(statistics.median(v) * 1e3, 3) for k, v in parts.items()}
    rows: list[Any] = mx.stack(sampled, axis=1).tolist()  # type: ignore[assignment]
    return {**got, "step": round(sum(got.values()), 3)}, rows


def measure_anatomy(model_dir: Path, sizes: list[int], args: argparse.Namespace) -> None:
    """mlx-lm's model, and with `--fuse` its transposed and fused copies, interleaved."""
    from mlx_lm import load

    models = {"mlx-lm": load(str(model_dir))[0]}
    if args.fuse:
        models["transposed"] = load(str(model_dir))[0]
        transposed.install(models["transposed"])
        models["fused"] = load(str(model_dir))[0]
        print(f"{model_dir.name}: {fused.install(models['fused'])} groups fused", flush=True)
        transposed.install(models["fused"])
        models["step"] = load(str(model_dir))[0]
        fused.install(models["step"])
        transposed.install(models["step"])
        print(f"{model_dir.name}: own decode step {decode_step.install(models['step'])}")
    prompts = prompt_set(max(sizes), args.prompt_tokens, int(args.shape["vocab_size"]))
    for size in sizes:
        # A first run of each model warms every shape; its tokens are compared.
        tokens = {n: anatomy(m, prompts[:size], args.new_tokens)[1] for n, m in models.items()}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, m in models.items():
                runs[name].append(anatomy(m, prompts[:size], args.new_tokens)[0])
        for name, got in runs.items():
            print(f"{model_dir.name} batch {size}, {name}: serial decode step ms {got}", flush=True)
        for name in models.keys() - {"mlx-lm"}:
            same = tokens[name] == tokens["mlx-lm"]
            print(f"{model_dir.name} batch {size}: {name} tokens == mlx-lm's: {same}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.profile_step", description=__doc__)
    p.add_argument("--dtypes", default="bf16,4bit")
    p.add_argument("--batch-sizes", default="1,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transports", default="direct", help=f"any of {','.join(TRANSPORTS)}")
    p.add_argument("--anatomy", action="store_true", help="split a serial step (see above)")
    p.add_argument(
        "--fuse", action="store_true", help="with --anatomy: also transposed and fused models"
    )
    p.add_argument("--top", type=int, default=14, help="profile lines per shape")
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes (CPU-friendly)")
    args = p.parse_args(argv)
    args.shape = SMOKE if args.smoke else LLAMA_1B
    if args.smoke:
        args.batch_sizes, args.prompt_tokens, args.new_tokens = "1,4", 16, 16
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.transport_list = args.transports.split(",")
    unknown = set(args.transport_list) - set(TRANSPORTS)
    if unknown:
        p.error(f"unknown transports {sorted(unknown)}: use {','.join(TRANSPORTS)}")
    with temp_dir() as tmp:
        dirs = build_models(tmp / "models", args.shape, args.dtypes.split(","))
        for model_dir in dirs.values():
            (measure_anatomy if args.anatomy else measure)(model_dir, sizes, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
