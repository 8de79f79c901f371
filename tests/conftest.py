"""Shared fixtures: the embedded SmolLM2 model, the tiny model, live servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from driver import ServeProcess, bring_up
from tiny_model import build_tiny_model, dequantized_copy

from mlx_worker_svc.cli import envs
from mlx_worker_svc.engine.model.embedded import ensure_default_model
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    return ensure_default_model(envs.cache_root(), show_progress=False)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", smollm_dir)


@pytest.fixture(scope="session")
def tiny_tools_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """The tiny model with a chat template that renders tools (tiny_model.TOOL_TEMPLATE)."""
    out = tmp_path_factory.mktemp("tiny-tools") / "model"
    return build_tiny_model(out, smollm_dir, tool_template=True)


@pytest.fixture(scope="session")
def smollm_f32_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """SmolLM2 with its 4-bit weights expanded to float32 (fast through BLAS on a CPU)."""
    return dequantized_copy(smollm_dir, tmp_path_factory.mktemp("smollm-f32") / "model")


@pytest.fixture
def server() -> Iterator[WorkerServer]:
    srv = WorkerServer(ServerConfig(port=0, grace_seconds=5.0))
    srv.start()
    yield srv
    srv.shutdown(grace_seconds=1.0, abort=True)
    assert srv.wait(timeout=30)


@pytest.fixture
def channel(server: WorkerServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as chan:
        yield chan


@pytest.fixture
def stub(channel: grpc.Channel) -> pb_grpc.WorkerServiceStub:
    return pb_grpc.WorkerServiceStub(channel)


@pytest.fixture
def tiny_stub(stub: pb_grpc.WorkerServiceStub, tiny_dir: Path) -> pb_grpc.WorkerServiceStub:
    """A worker that has been through the lifecycle on the tiny model."""
    bring_up(stub, tiny_dir)
    return stub


@pytest.fixture
def start_worker(tiny_dir: Path) -> Iterator[Callable[[float], ServeProcess]]:
    """Starts `mlx-worker serve --auto-init` on the tiny model (grace seconds given)."""
    started: list[ServeProcess] = []

    def start(grace: float) -> ServeProcess:
        started.append(ServeProcess(tiny_dir, grace))
        return started[-1]

    yield start
    for worker in started:
        worker.reap()
