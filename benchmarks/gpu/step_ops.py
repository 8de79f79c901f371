"""`python -m benchmarks.gpu.step_ops`: the kernels one decode step launches, by model copy.

A GPU decode step here is bound by the host's launch of its kernels, so the
count of kernels is the number to cut. MLX's CUDA backend writes each CUDA
graph it launches as a DOT file when `MLX_SAVE_CUDA_GRAPHS_DOT_FILE` names a
path prefix (read once per process: set it when starting this script). This
builds the benchmark's random model, and for mlx-lm's model, the worker's
fused copy (`engine/rewrite/fused.py` over `engine/rewrite/transposed.py`) and that copy with
its own decode step (`engine/rewrite/decode_step.py`) prefills a batch,
warms two decode steps, then counts the graphs and kernel nodes of one more
step and names the kernels, with MLX's primitives of the same step (its
`mx.export_to_dot` graph) beside them.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import temp_dir
from benchmarks.gpu.bench_gpu import prompt_set
from benchmarks.gpu.synthetic import LLAMA_1B, SMOKE, build_models

DUMP = "MLX_SAVE_CUDA_GRAPHS_DOT_FILE"
# A kernel node's label in cudaGraphDebugDotPrint's output holds its function's name.
_KERNEL = re.compile(r'shape="octagon" label="\d+\n([^\n"]+)')


def _short(name: str) -> str:
    """A kernel's name: MLX's without namespace and template arguments, others cut short."""
    mlx = "_ZN3mlx4core2cu"
    length = re.match(r"\d+", name[len(mlx) :]) if name.startswith(mlx) else None
    if length is None:
        return name[:60]
    start = len(mlx) + len(length.group())
    return name[start : start + int(length.group())]


def _kernels(files: list[Path]) -> collections.Counter[str]:
    found: collections.Counter[str] = collections.Counter()
    for path in files:
        found.update(_short(m) for m in _KERNEL.findall(path.read_text(errors="replace")))
    return found


def _primitives(outputs: list[Any], where: Path) -> collections.Counter[str]:
    import mlx.core as mx

    mx.export_to_dot(str(where), *outputs)
    return collections.Counter(re.findall(r'label ="?([A-Za-z0-9_]+)', where.read_text()))


def count_step(model: Any, prompts: list[list[int]], dump: Path, work: Path) -> dict[str, Any]:
    """Graphs, kernels and primitives of one decode step after a prefill and two warm steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_worker_svc.engine.rewrite import decode_step
    from mlx_worker_svc.engine.sampling import greedy

    cache = make_prompt_cache(model)
    tokens = greedy(model(mx.array(prompts, dtype=mx.uint32), cache=cache)[:, -1, :])
    for _ in range(2):
        tokens = greedy(decode_step.logits(model, tokens, cache))
        mx.eval(tokens)
    before = set(dump.parent.glob(dump.name + "_*.dot"))
    tokens = greedy(decode_step.logits(model, tokens, cache))
    state = [c.keys for c in cache] + [c.values for c in cache]
    primitives = _primitives([tokens, *state], work / "step.dot")
    mx.eval(tokens)
    files = sorted(set(dump.parent.glob(dump.name + "_*.dot")) - before)
    kernels = _kernels(files)
    return {"graphs": len(files), "kernels": kernels, "primitives": primitives}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.step_ops", description=__doc__)
    p.add_argument("--dtypes", default="bf16")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--smoke", action="store_true", help="tiny model (CPU: no graphs)")
    args = p.parse_args(argv)
    if not os.environ.get(DUMP):
        p.error(f"set {DUMP} to a path prefix in a scratch folder when starting this script")
    dump = Path(os.environ[DUMP])
    dump.parent.mkdir(parents=True, exist_ok=True)
    from mlx_lm import load

    from mlx_worker_svc.engine.rewrite import decode_step, fused, transposed

    shape = SMOKE if args.smoke else LLAMA_1B
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    with temp_dir() as tmp:
        dirs = build_models(tmp / "models", shape, args.dtypes.split(","))
        for name, model_dir in dirs.items():
            models = {copy: load(str(model_dir))[0] for copy in ("mlx-lm", "fused", "step")}
            for copy in ("fused", "step"):
                fused.install(models[copy])
                transposed.install(models[copy])
            decode_step.install(models["step"])
            prompts = prompt_set(max(sizes), args.prompt_tokens, int(shape["vocab_size"]))
            for size in sizes:
                for copy, model in models.items():
                    got = count_step(model, prompts[:size], dump, tmp)
                    kernels, primitives = got["kernels"], got["primitives"]
                    print(
                        f"{name} batch {size}, {copy}: {got['graphs']} graphs, "
                        f"{sum(kernels.values())} kernel nodes, "
                        f"{sum(primitives.values())} primitives",
                        flush=True,
                    )
                    print(f"  kernels: {kernels.most_common()}", flush=True)
                    print(f"  primitives: {primitives.most_common()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
