"""`python -m benchmarks.gpu.overhead`: the host's cost per decode step, on any machine.

On a GPU a 1B model's decode step takes a few milliseconds, so whatever the
worker and its client do in Python per step, and per request per step, is a
visible share. This measures that share on a CPU: a micro llama (one layer,
hidden 32, vocabulary 512) whose forward costs almost nothing, driven like the
GPU benchmark drives the worker (a worker process, Execute over gRPC, greedy,
one step per token, or `--decode-steps` a call, or through one ExecuteStream
with `--stream-depth` steps in flight), beside mlx-lm's
BatchGenerator on the same model. Per batch size it prints the p50 per decode
step of the client's wall time, the worker's `total_ns` and `forward_ns` (the
runner's forward + sampling), and the host cost per request per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.baselines import raw_batch
from benchmarks.common import percentile, process_worker, temp_dir, tiny_model_module
from benchmarks.execute_client import run_execute
from benchmarks.execute_stream import run_execute_stream
from benchmarks.gpu.bench_gpu import prompt_set
from benchmarks.gpu.synthetic import write_tokenizer

MICRO: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _p50_ms(values: list[int]) -> float:
    return round(percentile([v / 1e6 for v in values], 50), 3)


def measure(
    model_dir: Path,
    sizes: list[int],
    steps: int,
    prompt: int,
    decode_steps: int = 1,
    *,
    stream_depth: int = 0,
) -> list[dict[str, Any]]:
    from mlx_lm import load

    model, _ = load(str(model_dir))
    prompts = prompt_set(max(sizes), prompt, int(MICRO["vocab_size"]))
    rows = []
    with process_worker(model_dir) as worker:
        for size in sizes:
            batch = prompts[:size]
            run_execute(worker, batch, 4)
            if stream_depth:
                run_execute_stream(worker, batch, 4, depth=stream_depth)
            raw_batch(model, batch, 4)
            assert worker.pid is not None
            worker_cpu, client_cpu = cpu_seconds(worker.pid), time.process_time()
            run = (
                run_execute_stream(
                    worker, batch, steps, depth=stream_depth, decode_steps=decode_steps
                )
                if stream_depth
                else run_execute(worker, batch, steps, decode_steps=decode_steps)
            )
            worker_cpu = cpu_seconds(worker.pid) - worker_cpu
            client_cpu = time.process_time() - client_cpu
            # Calls of n decode steps: each call's times over its steps (tokens per request).
            decode = [(s, max(s.sampled // size, 1)) for s in run.steps[1:] if s.sampled]
            raw = raw_batch(model, batch, steps)[0].stats()
            wall = _p50_ms([s.wall_ns // n for s, n in decode])
            total = _p50_ms([s.total_ns // n for s, n in decode])
            forward = _p50_ms([s.forward_ns // n for s, n in decode])
            raw_step = raw["decode_s"] * 1e3 / max(steps - 1, 1)
            rows.append(
                {
                    "batch": size,
                    "client_wall_ms": wall,
                    "worker_total_ms": total,
                    "worker_forward_ms": forward,
                    "outside_worker_ms": round(wall - total, 3),
                    "host_us_per_request": round((wall - forward) * 1e3 / size, 1),
                    # CPU time per step (all steps of the run), steady under other load.
                    "worker_cpu_ms_per_step": round(worker_cpu * 1e3 / steps, 3),
                    "client_cpu_ms_per_step": round(client_cpu * 1e3 / steps, 3),
                    "batch_generator_step_ms": round(raw_step, 3),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.overhead", description=__doc__)
    p.add_argument("--batch-sizes", default="1,8,32,64,128")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument(
        "--decode-steps",
        type=int,
        default=1,
        help="decode steps a call (ExecuteRequest.num_decode_steps); figures are per step",
    )
    p.add_argument(
        "--stream-depth",
        type=int,
        default=0,
        help="drive the worker through one ExecuteStream with this many steps in flight "
        "(0: unary Execute); a step's wall time is then the time between replies",
    )
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    with temp_dir() as tmp:
        tokenizer = tmp / "tokenizer"
        write_tokenizer(tokenizer, int(MICRO["vocab_size"]))
        model_dir = tiny_model_module().build_tiny_model(tmp / "micro", tokenizer, overrides=MICRO)
        rows = measure(
            model_dir,
            sizes,
            args.steps,
            args.prompt_tokens,
            args.decode_steps,
            stream_depth=args.stream_depth,
        )
    print(
        "| batch | client wall ms | worker total ms | forward+sample ms | outside worker ms "
        "| host µs / request | worker CPU ms / step | client CPU ms / step "
        "| BatchGenerator step ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['client_wall_ms']} | {r['worker_total_ms']} "
            f"| {r['worker_forward_ms']} | {r['outside_worker_ms']} "
            f"| {r['host_us_per_request']} | {r['worker_cpu_ms_per_step']} "
            f"| {r['client_cpu_ms_per_step']} | {r['batch_generator_step_ms']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
