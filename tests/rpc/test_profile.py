"""StartProfile and StopProfile through a live worker on the tiny model: files, entries, errors."""

from __future__ import annotations

import pstats
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from driver import bring_up, code_of, details_of, greedy, live_server

from mlx_worker_svc.client.errors import ClientError
from mlx_worker_svc.client.worker import ClientConfig, WorkerClient
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import ServerConfig

Stub = pb_grpc.WorkerServiceStub
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT
TOKENS = 16


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("profiles") / "not-made-yet" / "profiles"


@pytest.fixture(scope="module")
def stub(tiny_dir: Path, profile_dir: Path) -> Iterator[Stub]:
    with live_server(ServerConfig(port=0, profile_dir=profile_dir)) as (_, stub):
        bring_up(stub, tiny_dir)
        yield stub


def _error(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return code_of(info.value), details_of(info.value)


def _generate(stub: Stub) -> list[int]:
    request = pb.GenerateRequest(
        prompt_token_ids=[5, 17, 300, 42], sampling_params=greedy(TOKENS, ignore_eos=True)
    )
    return [t for message in stub.Generate(request) for t in message.token_ids]


def _is_forward(entry: pb.ProfileEntry) -> bool:
    """mlx-lm's llama modules (Model, LlamaModel, layers): the model's forward."""
    return entry.function == "__call__" and entry.file.endswith("mlx_lm/models/llama.py")


def test_a_profile_of_a_generate_holds_the_models_forward(stub: Stub, profile_dir: Path) -> None:
    started = stub.StartProfile(pb.StartProfileRequest(label="decode-1"))
    assert started.label == "decode-1" and started.gpu_capture_path == ""
    path = Path(started.path)
    assert path.parent == profile_dir.resolve() and path.name.startswith("decode-1-")
    assert path.suffix == ".prof" and not path.exists()  # written by StopProfile

    assert len(_generate(stub)) == TOKENS
    report = stub.StopProfile(pb.StopProfileRequest())  # the default 30 entries

    assert report.label == "decode-1" and report.path == started.path
    assert report.gpu_capture_path == "" and report.seconds > 0
    assert path.is_file()
    written = pstats.Stats(str(path))
    assert len(written.stats) == report.num_functions > 30  # type: ignore[attr-defined]
    assert len(report.entries) == 30
    cumulative = [e.cumulative_seconds for e in report.entries]
    assert cumulative == sorted(cumulative, reverse=True)
    forwards = [e for e in report.entries if _is_forward(e)]
    assert forwards, [f"{e.file}:{e.function}" for e in report.entries]
    # One forward per sampled token at least (the prompt's, then each decode step).
    assert max(e.calls for e in forwards) >= TOKENS
    assert all(e.primitive_calls <= e.calls and e.own_seconds >= 0 for e in report.entries)
    # The engine's step functions, run on the profiled (engine) thread, are there too.
    names = {(Path(e.file).name, e.function) for e in report.entries}
    assert ("runner.py", "run") in names


def test_own_time_order_the_default_count_and_the_default_label(
    stub: Stub, profile_dir: Path
) -> None:
    started = stub.StartProfile(pb.StartProfileRequest())
    assert started.label == "profile" and Path(started.path).name.startswith("profile-")
    _generate(stub)
    report = stub.StopProfile(pb.StopProfileRequest(sort=pb.PROFILE_SORT_OWN))
    assert len(report.entries) == 30 < report.num_functions
    own = [e.own_seconds for e in report.entries]
    assert own == sorted(own, reverse=True)
    assert Path(report.path).is_file()


def test_the_same_label_twice_gets_two_files(stub: Stub) -> None:
    paths = []
    for _ in range(2):
        stub.StartProfile(pb.StartProfileRequest(label="twice"))
        paths.append(stub.StopProfile(pb.StopProfileRequest(top_entries=1)).path)
    assert paths[0] != paths[1] and all(Path(p).is_file() for p in paths)


def test_one_profile_at_a_time(stub: Stub) -> None:
    stub.StartProfile(pb.StartProfileRequest(label="first"))
    try:
        code, message = _error(lambda: stub.StartProfile(pb.StartProfileRequest(label="second")))
        assert code == FAILED_PRECONDITION
        assert "'first' is running" in message and "StopProfile" in message
    finally:
        assert stub.StopProfile(pb.StopProfileRequest()).label == "first"
    code, message = _error(lambda: stub.StopProfile(pb.StopProfileRequest()))
    assert code == FAILED_PRECONDITION
    assert message == "StopProfile: no profile is running: call StartProfile first"


@pytest.mark.parametrize(
    "label", ["../escape", "a/b", "/etc/passwd", ".hidden", "-dash", "a b", "x" * 65, "é"]
)
def test_a_label_that_is_not_a_file_name_is_refused(
    stub: Stub, profile_dir: Path, label: str
) -> None:
    before = sorted(profile_dir.parent.rglob("*")) if profile_dir.parent.exists() else []
    code, message = _error(lambda: stub.StartProfile(pb.StartProfileRequest(label=label)))
    assert code == INVALID_ARGUMENT and "StartProfileRequest.label" in message
    assert "paths are not accepted" in message
    after = sorted(profile_dir.parent.rglob("*")) if profile_dir.parent.exists() else []
    assert after == before
    code, _ = _error(lambda: stub.StopProfile(pb.StopProfileRequest()))
    assert code == FAILED_PRECONDITION  # nothing started


def test_bad_stop_arguments_leave_the_profile_running(stub: Stub) -> None:
    stub.StartProfile(pb.StartProfileRequest(label="kept"))
    code, message = _error(lambda: stub.StopProfile(pb.StopProfileRequest(top_entries=1001)))
    assert code == INVALID_ARGUMENT and "StopProfileRequest.top_entries 1001" in message
    code, message = _error(
        lambda: stub.StopProfile(pb.StopProfileRequest(sort=7))  # type: ignore[arg-type]
    )
    assert code == INVALID_ARGUMENT and "StopProfileRequest.sort 7" in message
    report = stub.StopProfile(pb.StopProfileRequest(top_entries=1000))
    assert report.label == "kept" and len(report.entries) == report.num_functions


def test_gpu_capture_needs_metal(stub: Stub) -> None:
    request = pb.StartProfileRequest(label="gpu", gpu_capture=True)
    code, message = _error(lambda: stub.StartProfile(request))
    assert code == FAILED_PRECONDITION
    assert message.startswith("StartProfileRequest.gpu_capture needs Metal")
    code, _ = _error(lambda: stub.StopProfile(pb.StopProfileRequest()))
    assert code == FAILED_PRECONDITION  # nothing started


def test_profiling_is_off_without_a_profile_dir(tiny_dir: Path) -> None:
    with live_server() as (_, stub):
        for call, name in (
            (lambda: stub.StartProfile(pb.StartProfileRequest(label="x")), "StartProfile"),
            (lambda: stub.StopProfile(pb.StopProfileRequest()), "StopProfile"),
        ):
            code, message = _error(call)
            assert code == FAILED_PRECONDITION
            assert message.startswith(f"{name}: profiling is off; start the worker with ")
            assert "--profile-dir DIR" in message


def test_a_new_worker_profiles_its_lifecycle_calls(tmp_path: Path) -> None:
    with live_server(ServerConfig(port=0, profile_dir=tmp_path)) as (_, stub):
        started = stub.StartProfile(pb.StartProfileRequest(label="bring-up"))
        stub.InitDevice(pb.InitDeviceRequest())
        report = stub.StopProfile(pb.StopProfileRequest(top_entries=1000))
    assert report.path == started.path and Path(report.path).is_file()
    seen = {(e.file.rpartition("mlx_worker_svc/")[2], e.function): e for e in report.entries}
    # The engine thread's part of InitDevice is there...
    assert seen[("engine/group/replica.py", "init_device")].calls == 1
    # ...and the gRPC thread's part (it submits the job and waits) is not: cProfile sees
    # the engine thread only (Python 3.11; from 3.12 it sees every thread).
    if sys.version_info < (3, 12):
        assert ("worker/lifecycle.py", "init_device") not in seen


def test_the_client_sdk_starts_and_stops_profiles(tmp_path: Path) -> None:
    with (
        live_server(ServerConfig(port=0, profile_dir=tmp_path)) as (server, _),
        WorkerClient(f"127.0.0.1:{server.port}", ClientConfig(retries=3)) as client,
    ):
        started = client.start_profile(pb.StartProfileRequest(label="sdk"))
        with pytest.raises(ClientError) as info:
            client.start_profile(pb.StartProfileRequest(label="sdk"))
        assert (info.value.code, info.value.attempts) == (FAILED_PRECONDITION, 1)
        report = client.stop_profile(pb.StopProfileRequest(top_entries=3))
        assert report.path == started.path and len(report.entries) == 3
        with pytest.raises(ClientError) as info:
            client.stop_profile()
        assert (info.value.code, info.value.attempts) == (FAILED_PRECONDITION, 1)
