"""Shared pieces: timing statistics, the machine's name, models, a live worker."""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MIB = 1 << 20
BLOCK_SIZE = 16


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary_ms(values_ns: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / mean / min / max of nanosecond samples, in milliseconds."""
    ms = [v / 1e6 for v in values_ns]
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 4),
        "p99_ms": round(percentile(ms, 99), 4),
        "mean_ms": round(statistics.fmean(ms), 4),
        "min_ms": round(min(ms), 4),
        "max_ms": round(max(ms), 4),
    }


def ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den > 0 else None


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (0.0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx_, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx_) ** 2 for x in xs)
    return sum((x - mx_) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (Linux /proc), 0 where unknown."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def machine_name() -> str:
    """A short, hostname-free name: the GPU's name, or e.g. linux-x86_64-2cpu."""
    if mx.is_available(mx.gpu):
        info = dict(mx.device_info())
        name = str(info.get("device_name") or info.get("architecture") or "gpu")
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    system = platform.system().lower()
    return f"{system}-{platform.machine().lower()}-{os.cpu_count() or 0}cpu"


def blas_libraries() -> list[str]:
    """The BLAS/LAPACK libraries mapped into this process (Linux), e.g. a preloaded OpenBLAS."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    names = {Path(line.split()[-1]).name for line in lines if "/" in line}
    return sorted(n for n in names if "blas" in n.lower() or "lapack" in n.lower())


_BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE")


def machine_facts() -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        info = {k: str(v) for k, v in dict(mx.device_info()).items()}
    except (RuntimeError, AttributeError):
        info = {}
    return {
        "name": machine_name(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu_count": os.cpu_count(),
        "mlx_device": str(mx.default_device()),
        "mlx_device_info": info,
        "python": platform.python_version(),
        "blas_libraries": blas_libraries(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        # The BLAS and OpenMP runtimes' settings from the environment: thread counts and
        # OpenBLAS's kernel family ({} when none is set).
        "blas_env": {k: os.environ[k] for k in _BLAS_ENV if k in os.environ},
        "load_average_at_start": list(os.getloadavg()),
    }


def tiny_model_module() -> Any:
    """The tests' model builders (tests/tiny_model.py), which are not a package."""
    spec = importlib.util.spec_from_file_location("tiny_model", REPO / "tests" / "tiny_model.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("tests/tiny_model.py is missing")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_tiny(out_dir: Path, tokenizer_dir: Path, head_dim: int | None = None) -> Path:
    """Builds the tests' tiny random llama (tests/tiny_model.py) into `out_dir`.

    `head_dim` 64 lets mlx-lm's default KV quantization group divide it (`--kv-bits`).
    """
    path: Path = tiny_model_module().build_tiny_model(
        out_dir / "tiny", tokenizer_dir, max_position_embeddings=4096, head_dim=head_dim
    )
    return path


def float32_copy(out_dir: Path, quantized_dir: Path) -> Path:
    """A float32 copy of a quantized model (fast through BLAS on a CPU), as the tests use."""
    path: Path = tiny_model_module().dequantized_copy(quantized_dir, out_dir / "f32")
    return path


@contextmanager
def temp_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="mlx-worker-bench-") as name:
        yield Path(name)


@dataclass
class Worker:
    """A live in-process worker that has been through its lifecycle."""

    stub: Any
    epoch: int
    info: Any
    # The in-process server (`live_worker`); None for a worker process.
    server: WorkerServer | None
    # DetermineMemory's measure of one KV block (`BLOCK_SIZE` tokens) of this model.
    bytes_per_block: int = 0
    # The worker's process id (`process_worker`); None in-process.
    pid: int | None = None
    _counter: int = 0

    def new_id(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}-{self._counter}"


def bring_up(
    stub: Any, model: Path | str, *, num_blocks: int, prefix_caching: bool, kv_bits: int = 0
) -> Worker:
    """Takes a fresh worker through InitDevice .. InitCache (no WarmUp).

    `kv_bits` quantizes the KV (group 64, mlx-lm's default; 0: float).
    """
    stub.InitDevice(pb.InitDeviceRequest())
    loaded = stub.LoadModel(pb.LoadModelRequest(model=str(model)))
    group = 64 if kv_bits else 0
    # The profile is not used (InitCache sets the budget); keep it small on a CPU.
    profile = stub.DetermineMemory(
        pb.DetermineMemoryRequest(
            max_num_batched_tokens=16, block_size=BLOCK_SIZE, kv_bits=kv_bits, kv_group_size=group
        )
    )
    cache = stub.InitCache(
        pb.InitCacheRequest(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=prefix_caching,
            kv_bits=kv_bits,
            kv_group_size=group,
        )
    )
    if cache.prefix_caching != prefix_caching:
        raise RuntimeError(
            f"InitCache(enable_prefix_caching={prefix_caching}) answered "
            f"prefix_caching={cache.prefix_caching} for {model}"
        )
    return Worker(
        stub=stub,
        epoch=int(loaded.worker_epoch),
        info=loaded.model,
        server=None,
        bytes_per_block=int(profile.bytes_per_block),
    )


@contextmanager
def live_worker(
    model: Path | str, *, num_blocks: int = 4096, prefix_caching: bool = False, kv_bits: int = 0
) -> Iterator[Worker]:
    """Starts a real server on loopback, brings the model up, stops it afterwards.

    The prefix cache is off unless asked for: the sections that compare the worker with
    mlx-lm must not be helped by KV reused from an earlier request.
    """
    server = WorkerServer(ServerConfig(port=0, grace_seconds=5.0))
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
            worker = bring_up(
                stub, model, num_blocks=num_blocks, prefix_caching=prefix_caching, kv_bits=kv_bits
            )
            worker.server = server
            yield worker
    finally:
        server.shutdown(grace_seconds=1.0, abort=True)
        server.wait(30)


@contextmanager
def process_worker(
    model: Path | str,
    *,
    num_blocks: int = 4096,
    prefix_caching: bool = False,
    extra_env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
) -> Iterator[Worker]:
    """Like `live_worker`, but the worker is its own process (`mlx-worker serve`).

    The client then does not share a GIL with the worker's gRPC and engine
    threads, as with a real remote scheduler. `extra_env` is added to its
    environment, `extra_args` to `serve`'s options.
    """
    env = {
        **os.environ,
        **(extra_env or {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "mlx_worker_svc", "--log-level", "WARNING", "serve"]
    command += ["--port", "0", "--model", str(model), *(extra_args or [])]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        port = _listening_port(proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
            worker = bring_up(stub, model, num_blocks=num_blocks, prefix_caching=prefix_caching)
            worker.pid = proc.pid
            yield worker
            stub.Shutdown(pb.ShutdownRequest(grace_seconds=1.0, abort=True))
    finally:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _listening_port(proc: subprocess.Popen[str]) -> int:
    """Reads `mlx-worker listening on HOST:PORT` from a starting `serve` process."""
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"listening on \S+:(\d+)", line)
        if match:
            return int(match.group(1))
    raise RuntimeError(f"the worker process exited (code {proc.wait()}) before it listened")
