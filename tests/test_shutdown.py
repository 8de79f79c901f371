"""Drain: SIGTERM and the Shutdown RPC share one path and lose nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from driver import bring_up, code_of, greedy
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.server import ServerConfig, WorkerServer


def _start_worker(model: Path, grace: float) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_worker_svc",
            "serve",
            "--model",
            str(model),
            "--auto-init",
            "--port",
            "0",
            "--grace-seconds",
            str(grace),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    port = 0
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        if match:
            port = int(match.group(1))
        if line.startswith("ready:"):
            break
        assert time.monotonic() < deadline, "worker did not become ready"
    assert port, "worker did not print its port"
    return proc, port


def _exit_code(proc: subprocess.Popen[str]) -> int:
    """Waits for the worker to exit; returns its exit code."""
    code = proc.wait(timeout=60)
    assert proc.stdout is not None
    rest = proc.stdout.read()
    proc.stdout.close()
    if code != 0:
        print(rest)
    return code


@pytest.fixture
def channel_to() -> Iterator[list[grpc.Channel]]:
    opened: list[grpc.Channel] = []
    yield opened
    for chan in opened:
        chan.close()


def _stub(port: int, opened: list[grpc.Channel]) -> pb_grpc.WorkerServiceStub:
    chan = grpc.insecure_channel(f"127.0.0.1:{port}")
    opened.append(chan)
    return pb_grpc.WorkerServiceStub(chan)


def test_sigterm_lets_a_running_generate_finish_and_exits_zero(
    tiny_dir: Path, channel_to: list[grpc.Channel]
) -> None:
    proc, port = _start_worker(tiny_dir, grace=60.0)
    stub = _stub(port, channel_to)
    stream = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=greedy(300, ignore_eos=True))
    )
    first = next(stream)
    os.kill(proc.pid, signal.SIGTERM)
    tokens = list(first.token_ids)
    last = first
    for message in stream:
        tokens += message.token_ids
        last = message
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) == 300
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], sampling_params=greedy(2))))
    assert code_of(info.value) == grpc.StatusCode.UNAVAILABLE
    assert _exit_code(proc) == 0


def test_sigterm_past_the_grace_period_ends_streams_with_a_clear_status(
    tiny_dir: Path, channel_to: list[grpc.Channel]
) -> None:
    proc, port = _start_worker(tiny_dir, grace=0.3)
    stub = _stub(port, channel_to)
    stream = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=greedy(500, ignore_eos=True))
    )
    next(stream)
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert code_of(info.value) in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)
    assert time.monotonic() - started < 10
    assert _exit_code(proc) == 0


def test_shutdown_rpc_drains_like_sigterm(tiny_dir: Path) -> None:
    server = WorkerServer(ServerConfig(port=0, grace_seconds=5.0))
    port = server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
        stub = pb_grpc.WorkerServiceStub(chan)
        health = health_pb2_grpc.HealthStub(chan)
        bring_up(stub, tiny_dir)
        stream = stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=[5, 6], sampling_params=greedy(400, ignore_eos=True)
            )
        )
        next(stream)
        answer = stub.Shutdown(pb.ShutdownRequest(grace_seconds=30))
        assert answer.num_in_flight == 1
        status = health.Check(health_pb2.HealthCheckRequest(service="")).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        rest = list(stream)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert server.wait(timeout=30)
    assert server.worker.state.value == "STOPPED"
