"""`python -m benchmarks.gpu.profile_step`: where a worker decode step's time goes.

Runs the worker in this process (no gRPC) on the benchmark's random model and,
per dtype and batch size, prints raw mlx-lm's decode step (BatchGenerator, or
stream_generate at batch 1) beside the worker's (Execute calls of
`--decode-steps` decode steps each; best of `--repeats`), then the engine
thread's cProfile by own time: the time spent waiting for the device shows up
in the call that reads the sampled tokens (`sampling.read_tokens`), the host's
work in the rest. `--smoke` runs a tiny shape on any machine.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path
from typing import Any

from benchmarks.baselines import raw_batch, raw_stream
from benchmarks.common import live_worker, temp_dir
from benchmarks.execute_client import in_process_call, run_execute
from benchmarks.gpu.bench_gpu import prompt_set
from benchmarks.gpu.synthetic import LLAMA_1B, SMOKE, build_models
from mlx_worker_svc.engine.runner import ModelRunner


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


def measure(model_dir: Path, sizes: list[int], args: argparse.Namespace) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    vocab = int(args.shape["vocab_size"])
    prompts = prompt_set(max(sizes), args.prompt_tokens, vocab)
    blocks = max(sizes) * (args.prompt_tokens + args.new_tokens) // 16 * 2 + 64
    with live_worker(model_dir, num_blocks=blocks) as worker:
        call = in_process_call(worker)
        for size in sizes:
            batch = prompts[:size]
            steps = args.decode_steps
            raw_batch(model, batch, 4)
            run_execute(worker, batch, 4, call=call, decode_steps=steps)
            raw, mine = [], []
            profiler = cProfile.Profile()
            original = profile_runner(profiler)
            try:
                for _ in range(args.repeats):
                    if size == 1:
                        timeline = raw_stream(model, tokenizer, batch[0], args.new_tokens)[0]
                    else:
                        timeline = raw_batch(model, batch, args.new_tokens)[0]
                    raw.append(_step_ms(timeline.stats(), size))
                    run = run_execute(worker, batch, args.new_tokens, call=call, decode_steps=steps)
                    mine.append(_step_ms(run.timeline.stats(), size))
            finally:
                ModelRunner.run = original  # type: ignore[method-assign]
            print(
                f"\n## {model_dir.name} batch {size}: decode step ms, raw {min(raw)} "
                f"(runs {raw}), worker {min(mine)} (runs {mine}, {steps} steps a call)",
                flush=True,
            )
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
            table = text.getvalue()
            print(table[table.find("ncalls") :].strip(), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.profile_step", description=__doc__)
    p.add_argument("--dtypes", default="bf16,4bit")
    p.add_argument("--batch-sizes", default="1,128")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=14, help="profile lines per shape")
    p.add_argument("--smoke", action="store_true", help="tiny model and sizes (CPU-friendly)")
    args = p.parse_args(argv)
    args.shape = SMOKE if args.smoke else LLAMA_1B
    if args.smoke:
        args.batch_sizes, args.prompt_tokens, args.new_tokens = "1,4", 16, 16
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    with temp_dir() as tmp:
        dirs = build_models(tmp / "models", args.shape, args.dtypes.split(","))
        for model_dir in dirs.values():
            measure(model_dir, sizes, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
