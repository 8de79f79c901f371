"""`python -m benchmarks.gpu.matmul_probe`: what a decode step's matrix products cost, by route.

MLX's CUDA backend runs a product of one row through its own matrix-vector
kernel, and one of several rows through cuBLASLt: a matmul descriptor, a
heuristic query and a stream capture per call, added to the CUDA graph as a
child graph. `mx.gather_mm` with every row on weight 0 runs MLX's own CUTLASS
kernels instead (a grouped GEMM when each row is its own one-row problem, a
tiled GEMM otherwise). This probe builds a Llama-3.2-1B-shaped stack of 16
layers of products (fused q/k/v, output, fused gate/up, down; no attention) and
times, per route and batch size, interleaved over `--rounds`:

- `build`: the Python that builds one step's graph;
- `launch`: `mx.async_eval` of it (MLX encodes and submits the kernels);
- `wait`: the device's time after the launch returns, steps run serially;
- `piped`: steps launched one ahead of the wait, as the engine runs them.

It also prints the largest difference of each route's product from `@`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import mlx.core as mx

D, Q, F, LAYERS = 2048, 3072, 8192, 16
Product = Callable[[mx.array, mx.array], mx.array]
Layer = tuple[mx.array, mx.array, mx.array, mx.array]


def _matmul(h: mx.array, wt: mx.array) -> mx.array:
    return h @ wt


def _grouped(h: mx.array, wt: mx.array) -> mx.array:
    rows = h.shape[0]
    zeros = mx.zeros((rows,), dtype=mx.uint32)
    out = mx.gather_mm(h[:, None, :], wt[None], rhs_indices=zeros, sorted_indices=True)
    return out.reshape(rows, -1)


def _tiled(h: mx.array, wt: mx.array) -> mx.array:
    zero = mx.zeros((1,), dtype=mx.uint32)
    return mx.gather_mm(h[None], wt[None], rhs_indices=zero)[0]


ROUTES: dict[str, Product] = {"matmul": _matmul, "grouped": _grouped, "tiled": _tiled}


def _weights(dtype: mx.Dtype) -> list[Layer]:
    def weight(n: int, k: int) -> mx.array:
        w: mx.array = (mx.random.normal((n, k)) * k**-0.5).astype(dtype)
        return w.T

    layers = [(weight(Q, D), weight(D, D), weight(2 * F, D), weight(D, F)) for _ in range(LAYERS)]
    mx.eval(layers)
    return layers


def _step(h: mx.array, layers: list[Layer], mm: Product) -> mx.array:
    for wqkv, wo, wgu, wd in layers:
        h = h + mm(mm(h, wqkv)[:, :D], wo)
        u = mm(h, wgu)
        h = h + mm(u[:, :F] * u[:, F:], wd)
    return h


def _time(x: mx.array, layers: list[Layer], mm: Product, steps: int) -> dict[str, float]:
    build, launch, wait = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        y = _step(x, layers, mm)
        t1 = time.perf_counter()
        mx.async_eval(y)  # type: ignore[no-untyped-call]
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        build.append(t1 - t0)
        launch.append(t2 - t1)
        wait.append(t3 - t2)
    start = time.perf_counter()
    previous = None
    for _ in range(steps):
        y = _step(x, layers, mm)
        mx.async_eval(y)  # type: ignore[no-untyped-call]
        if previous is not None:
            mx.eval(previous)
        previous = y
    mx.eval(previous)
    piped = (time.perf_counter() - start) / steps
    ms = {"build": build, "launch": launch, "wait": wait}
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in ms.items()} | {
        "piped": round(piped * 1e3, 3)
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32,64,128")
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dtype", default="bfloat16", help="float32 on a CPU (its gather_mm takes no other)"
    )
    args = parser.parse_args(argv)
    routes = args.routes.split(",")
    dtype = getattr(mx, args.dtype)
    layers = _weights(dtype)
    print(f"device {mx.default_device()}, mlx {version('mlx')}", flush=True)
    for rows in (int(b) for b in args.batch_sizes.split(",")):
        x = (mx.random.normal((rows, D)) * 0.1).astype(dtype)
        reference = _matmul(x, layers[0][2])
        for name in routes:
            got = ROUTES[name](x, layers[0][2])
            diff = mx.abs(got.astype(mx.float32) - reference.astype(mx.float32)).max().item()
            print(f"b{rows} {name}: max |diff| from @ {diff:.3g}", flush=True)
            _time(x, layers, ROUTES[name], 3)
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in routes}
        for _ in range(args.rounds):
            for name in routes:
                results[name].append(_time(x, layers, ROUTES[name], args.steps))
        for name in routes:
            print(f"b{rows} {name}: {results[name]}", flush=True)


if __name__ == "__main__":
    main()
