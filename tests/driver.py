"""A minimal test scheduler: drives a worker through Execute, step by step."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import grpc

from mlx_worker_svc.client.execute_loop import run_prompts
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer


@contextmanager
def live_server(
    config: ServerConfig | None = None,
) -> Iterator[tuple[WorkerServer, pb_grpc.WorkerServiceStub]]:
    """A brand-new in-process worker on port 0 and a stub to it (stopped afterwards)."""
    server = WorkerServer(config or ServerConfig(port=0))
    port = server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
            yield server, pb_grpc.WorkerServiceStub(chan)
    finally:
        server.shutdown(grace_seconds=1.0, abort=True)
        assert server.wait(timeout=30)


@contextmanager
def fresh_stub() -> Iterator[pb_grpc.WorkerServiceStub]:
    """A stub to a second, brand-new in-process worker (stopped afterwards)."""
    with live_server() as (_, stub):
        yield stub


def bring_up(
    stub: pb_grpc.WorkerServiceStub,
    model: Path | str,
    *,
    num_blocks: int = 4096,
    profile_tokens: int = 64,
) -> int:
    """Runs InitDevice..InitCache (profiling `profile_tokens`); returns the worker epoch."""
    stub.InitDevice(pb.InitDeviceRequest())
    epoch = stub.LoadModel(pb.LoadModelRequest(model=str(model))).worker_epoch
    stub.DetermineMemory(
        pb.DetermineMemoryRequest(max_num_batched_tokens=profile_tokens, block_size=16)
    )
    stub.InitCache(pb.InitCacheRequest(num_blocks=num_blocks, block_size=16))
    return int(epoch)


def greedy(max_tokens: int, **extra: object) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)  # type: ignore[arg-type]


def drive(
    stub: pb_grpc.WorkerServiceStub,
    epoch: int,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    chunk: int | None = None,
    params: pb.SamplingParams | None = None,
    before_step: Callable[[pb.ExecuteRequest], None] | None = None,
    decode_steps: int = 0,
) -> list[list[int]]:
    """Runs all prompts together (`client.execute_loop`), chunked prefill of `chunk`
    tokens (None: whole), `decode_steps` decode steps per Execute call (0: one);
    `before_step` sees each request before it is sent."""

    def execute(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        if before_step is not None:
            before_step(request)
        response: pb.ExecuteResponse = stub.Execute(request)
        return response

    result = run_prompts(
        execute,
        epoch,
        prompts,
        params or greedy(max_tokens),
        chunk=chunk,
        decode_steps=decode_steps,
    )
    return result.tokens


def mlx_lm_tokens(model: Path | str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's own greedy tokens for each prompt alone (`generate_step`, EOS not stopping)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    loaded, _ = load(str(model))
    return [
        [t for t, _ in generate_step(mx.array(p), loaded, max_tokens=max_tokens)] for p in prompts
    ]


def reference_tokens(
    model: Path | str,
    prompts: list[list[int]],
    max_tokens: int,
    params: pb.SamplingParams | None = None,
) -> list[list[int]]:
    """Greedy tokens of `prompts` run together on a brand-new, unconstrained worker."""
    with fresh_stub() as stub:
        return drive(stub, bring_up(stub, model), prompts, max_tokens=max_tokens, params=params)


def wait_until_idle(stub: pb_grpc.WorkerServiceStub, timeout: float) -> pb.CheckHealthResponse:
    """Polls CheckHealth until the worker runs no request and holds no KV block."""
    deadline = time.monotonic() + timeout
    while True:
        health = stub.CheckHealth(pb.CheckHealthRequest(), timeout=30)
        if health.num_running_requests == 0 and health.kv.used_blocks == 0:
            return health
        assert time.monotonic() < deadline, f"the worker still holds requests:\n{health}"
        time.sleep(0.05)


def epoch_of(stub: pb_grpc.WorkerServiceStub) -> int:
    """The worker's epoch (GetInfo), for the steps a test sends."""
    return int(stub.GetInfo(pb.GetInfoRequest()).worker_epoch)


def code_of(error: BaseException) -> grpc.StatusCode:
    """The status code of an RpcError raised by a stub call."""
    return cast(grpc.Call, error).code()


def details_of(error: BaseException) -> str:
    """The status message of an RpcError raised by a stub call."""
    return cast(grpc.Call, error).details() or ""


class ServeProcess:
    """A `mlx-worker serve` subprocess; always reaped, even when a test fails."""

    def __init__(
        self,
        model: Path,
        grace: float,
        extra: Sequence[str] = (),
        launcher: Sequence[str] = (sys.executable, "-m", "mlx_worker_svc"),
    ) -> None:
        self.proc = subprocess.Popen(
            [
                *launcher,
                "serve",
                "--model",
                str(model),
                "--auto-init",
                "--port",
                "0",
                "--grace-seconds",
                str(grace),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.port = 0
        self.channels: list[grpc.Channel] = []
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in self.proc.stdout:
            match = re.search(r"listening on [\d.]+:(\d+)", line)
            if match:
                self.port = int(match.group(1))
            if line.startswith("ready:"):
                break
            assert time.monotonic() < deadline, "worker did not become ready"
        assert self.port, "worker did not print its port"

    def channel(self) -> grpc.Channel:
        chan = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.channels.append(chan)
        return chan

    def exit_code(self) -> int:
        """Waits for the worker to exit; returns its exit code."""
        code = self.proc.wait(timeout=60)
        if code != 0:
            assert self.proc.stdout is not None
            print(self.proc.stdout.read())
        return code

    def reap(self) -> None:
        for chan in self.channels:
            chan.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def share_equal(got: list[list[int]], expected: list[list[int]]) -> float:
    """The share of positions whose token equals `expected`'s (rows of equal lengths)."""
    pairs = [(a, b) for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)
