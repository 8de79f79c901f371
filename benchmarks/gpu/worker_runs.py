"""The worker side of the GPU benchmark: variants, the worker process, its paths.

`bench_gpu` (the comparison with raw mlx-lm) and `profile_step` (where a step's
time goes) start the same worker process (`bench_worker`) and drive it the same
way: each path of `--paths` warmed by a whole run, then timed rounds (`rounds`)
of which the best is kept. `parity` checks the worker's greedy tokens against
mlx-lm's on the GPU.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.baselines import raw_batch, raw_stream
from benchmarks.common import Worker, process_worker
from benchmarks.execute_client import run_execute, run_generate, run_generate_streams
from benchmarks.execute_stream import run_execute_stream
from benchmarks.timeline import combined_stats


class Variant(NamedTuple):
    """A worker variant: engine options as `serve` flags, and MLX's own variables."""

    flags: tuple[str, ...] = ()  # engine options (cli/engine_flags.py)
    env: Mapping[str, str] = {}  # variables MLX itself reads (read only: a shared default)


# Worker variants (engine options for A/B runs).
VARIANTS: dict[str, Variant] = {
    # Everything on: the next forward queued before the host reads the tokens
    # (with the greedy choice of its tokens), decode steps through fused
    # projections (CUDA), aligned batches decode without a mask, quantized models
    # decode batches of 32 rows and more on dequantized weights.
    "speculate": Variant(("--look-ahead", "speculate")),
    # The look-ahead of the engine before this work: started after the step.
    "after": Variant(("--look-ahead", "after")),
    # No look-ahead at all.
    "off": Variant(("--look-ahead", "off")),
    # Speculation, but mlx-lm's masks on every batched step.
    "masked": Variant(("--no-aligned-decode",)),
    # Speculation, but MLX's quantized kernel at every batch size (quantized models only).
    "quantized": Variant(("--dequant-min-batch", "0")),
    # The default engine with MLX's CUDA graphs of up to 80 operations (MLX's default: 20),
    # so fewer graphs are built and launched per decode step.
    "ops80": Variant(env={"MLX_MAX_OPS_PER_BUFFER": "80"}),
    # The default engine without fused projections (engine/rewrite/fused.py).
    "unfused": Variant(("--fuse", "off")),
    # The default engine with every request's KV quantized to 8 bits (`--kv-bits 8`,
    # mlx-lm's group of 64), against float KV in the first variant.
    "kv8": Variant(("--kv-bits", "8", "--kv-group-size", "64")),
}


QUANTIZED_ONLY = {"quantized"}
# The rows from which quantized models decode on dequantized weights (the engine's
# CUDA default; the smoke run lowers it so that a CPU exercises that path too).
DEQUANT_MIN_BATCH = {"gpu": "32", "smoke": "2"}


def variant_flags(variant: str, smoke: bool) -> list[str]:
    """The `serve` flags of a variant (the dequantization threshold first, so it can override)."""
    threshold = DEQUANT_MIN_BATCH["smoke" if smoke else "gpu"]
    return ["--dequant-min-batch", threshold, *VARIANTS[variant].flags]


def kv_blocks(sizes: list[int], args: argparse.Namespace) -> int:
    """KV blocks (of 16 tokens) for the largest batch's requests, twice over, and some spare."""
    return max(sizes) * int(args.prompt_tokens + args.new_tokens) // 16 * 2 + 64


def bench_worker(
    model_dir: Path, sizes: list[int], args: argparse.Namespace, variant: str = "speculate"
) -> Any:
    """A worker process as the benchmark runs it (a context manager yielding the Worker)."""
    # Every Generate stream of a batch is admitted at once: room for all of
    # them in the engine's queue of starts and among the running requests.
    room = max(sizes) + 64
    limits = ["--max-queued-steps", str(room), "--max-running-requests", str(max(256, room))]
    return process_worker(
        model_dir,
        num_blocks=kv_blocks(sizes, args),
        extra_env=dict(VARIANTS[variant].env),
        extra_args=[*limits, *variant_flags(variant, args.smoke)],
    )


def rounds(args: argparse.Namespace) -> Iterator[int]:
    """One shape's timed rounds: `--repeats`, then more until `--sample-s` (`--max-repeats`)."""
    start, done = time.monotonic(), 0
    while done < args.repeats or (
        done < args.max_repeats and time.monotonic() - start < args.sample_s
    ):
        yield done
        done += 1


def best_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return max(runs, key=lambda r: decode_rate(r["stats"]))


def _execute(
    worker: Worker,
    prompts: list[list[int]],
    tokens: int,
    args: argparse.Namespace,
    *,
    multistep: bool = False,
) -> dict[str, Any]:
    run = run_execute(worker, prompts, tokens, decode_steps=args.decode_steps if multistep else 1)
    got: dict[str, Any] = {"stats": run.timeline.stats(), "tokens": run.tokens}
    if not multistep:
        got["run"] = run  # its per-step timings are the table's (one step a call)
    return got


def _stream(
    worker: Worker, prompts: list[list[int]], tokens: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One decode step a call through ExecuteStream, `--stream-depth` steps in flight."""
    run = run_execute_stream(worker, prompts, tokens, depth=args.stream_depth)
    return {"stats": run.timeline.stats(), "tokens": run.tokens}


def _generate(
    worker: Worker, prompts: list[list[int]], tokens: int, args: argparse.Namespace
) -> dict[str, Any]:
    timelines, outputs = run_generate_streams(worker, prompts, tokens)
    return {"stats": combined_stats(timelines), "tokens": outputs}


WORKER_RUNS: dict[str, Callable[..., dict[str, Any]]] = {
    "execute": _execute,
    "multistep": functools.partial(_execute, multistep=True),
    "stream": _stream,
    "generate": _generate,
}


def decode_rate(stats: dict[str, Any]) -> float:
    return float(stats.get("decode_tok_s") or 0.0)


def warm_worker(worker: Worker, prompts: list[list[int]], args: argparse.Namespace) -> None:
    """One run of every worker path (`--paths`) with `--warm-tokens` tokens."""
    for path in args.path_list:
        WORKER_RUNS[path](worker, prompts, args.warm_tokens, args)


def worker_once(
    worker: Worker,
    prompts: list[list[int]],
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """One timed run of every worker path, added to `runs`."""
    for path in args.path_list:
        runs.setdefault(path, []).append(WORKER_RUNS[path](worker, prompts, args.new_tokens, args))


def worker_paths(
    worker: Worker, prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """The worker's paths at one batch size: each warmed, then runs (best kept)."""
    warm_worker(worker, prompts, args)
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in rounds(args):
        worker_once(worker, prompts, args, runs)
    return {path: best_run(got) for path, got in runs.items()}


def parity(
    model: Any,
    tokenizer: Any,
    worker: Worker,
    prompts: list[list[int]],
    tokens: int,
    *,
    decode_steps: int,
) -> dict[str, Any]:
    """Greedy parity on one model: the worker's tokens against mlx-lm's.

    The check that must hold: each prompt alone through Execute (batch 1; one
    decode step a call, and `decode_steps` a call), through ExecuteStream one
    step ahead, and alone through Generate,
    gives exactly `stream_generate`'s tokens
    (mlx_lm.generate's path). For information: the prompts as one batch
    (Execute, and concurrent Generate streams), worker against BatchGenerator
    (batched kernels may round differently, and a random model's near-ties
    then flip a token).
    """
    reference = [raw_stream(model, tokenizer, p, tokens)[1] for p in prompts]
    alone = [run_execute(worker, [p], tokens).tokens[0] for p in prompts]
    multi = [run_execute(worker, [p], tokens, decode_steps=decode_steps).tokens[0] for p in prompts]
    ahead = [run_execute_stream(worker, [p], tokens).tokens[0] for p in prompts]
    streams = run_generate_streams(worker, prompts, tokens)[1]
    generated = [run_generate(worker, p, tokens)[1] for p in prompts]
    together = run_execute(worker, prompts, tokens).tokens
    batch_ref = raw_batch(model, prompts, tokens)[1]

    def agree(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))

    return {
        "prompts": len(prompts),
        "tokens": tokens,
        "single_matches_generate": [a == r for a, r in zip(alone, reference, strict=True)],
        "multistep_single_matches_generate": [
            a == r for a, r in zip(multi, reference, strict=True)
        ],
        "generate_single_matches_generate": [
            a == r for a, r in zip(generated, reference, strict=True)
        ],
        "stream_single_matches_generate": [a == r for a, r in zip(ahead, reference, strict=True)],
        "ok": alone == reference == multi == generated == ahead,
        "batched_matches_batch_generator": [
            a == b for a, b in zip(together, batch_ref, strict=True)
        ],
        "batched_tokens_agreeing_before_first_difference": [
            agree(a, b) for a, b in zip(together, batch_ref, strict=True)
        ],
        "batched_matches_single": [a == b for a, b in zip(together, alone, strict=True)],
        "generate_streams_match_batch_generator": [
            a == b for a, b in zip(streams, batch_ref, strict=True)
        ],
    }
