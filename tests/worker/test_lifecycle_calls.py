"""Lifecycle calls coalesce: a repeat joins the call in progress, others are refused.

An in-process worker on the tiny model, with the engine's profile (or deep
check) held on an event so that calls overlap deterministically; each test
counts how often the profile really ran. Last, SIGTERM to a `serve --auto-init`
process in the middle of its own (slow) profile.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from driver import code_of, details_of, live_server
from processes import Proc

from mlx_worker_svc.core.domain import DeviceKind
from mlx_worker_svc.core.lifecycle import PROFILE_TOKENS, default_profile_tokens
from mlx_worker_svc.engine.group.replica import Replica
from mlx_worker_svc.engine.memory.device import auto_kind
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import WorkerServer


class Held:
    """Wraps a Replica method: each call records its options and waits for `go`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.calls: list[dict[str, Any]] = []
        self.started = threading.Event()
        self.go = threading.Event()
        original = getattr(Replica, name)

        def held(replica: Replica, *args: Any, **options: Any) -> Any:
            self.calls.append({"args": args, **options})
            self.started.set()
            assert self.go.wait(timeout=60), "the test never let the call go"
            return original(replica, *args, **options)

        monkeypatch.setattr(Replica, name, held)


@pytest.fixture
def loaded(tiny_dir: Path) -> Iterator[tuple[WorkerServer, pb_grpc.WorkerServiceStub]]:
    """A worker with the tiny model loaded (state MODEL_LOADED)."""
    with live_server() as (server, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir)))
        yield server, stub


def _profile(tokens: int = 0) -> pb.DetermineMemoryRequest:
    return pb.DetermineMemoryRequest(max_num_batched_tokens=tokens)


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in 30 s"
        time.sleep(0.01)


def test_a_repeated_call_joins_the_one_in_progress(
    loaded: tuple[WorkerServer, pb_grpc.WorkerServiceStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, stub = loaded
    profile = Held(monkeypatch, "profile")
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(stub.DetermineMemory, _profile(32))
        assert profile.started.wait(timeout=30)
        # The default on a CPU is 32 tokens: the same call once defaults are filled in.
        repeats = [pool.submit(stub.DetermineMemory, _profile(t)) for t in (32, 0)]
        time.sleep(0.3)
        assert not any(r.done() for r in repeats), "a repeat did not wait for the first call"
        profile.go.set()
        answers = [first.result(timeout=60)] + [r.result(timeout=60) for r in repeats]
    assert len(profile.calls) == 1, profile.calls
    assert profile.calls[0]["max_num_batched_tokens"] == 32
    assert answers[0] == answers[1] == answers[2]
    assert answers[0].state == pb.WORKER_STATE_MEMORY_PROFILED


def _all_join(held: Held, first: Callable[[], Any], *repeats: Callable[[], Any]) -> list[Any]:
    """Runs `first`, held on `held`, and `repeats` meanwhile: each must join its one run."""
    with ThreadPoolExecutor(1 + len(repeats)) as pool:
        running = pool.submit(first)
        assert held.started.wait(timeout=30)
        joined = [pool.submit(repeat) for repeat in repeats]
        time.sleep(0.3)
        assert not [j.exception() for j in joined if j.done()], "a repeat did not join"
        held.go.set()
        answers = [running.result(timeout=60)] + [j.result(timeout=60) for j in joined]
    assert len(held.calls) == 1, held.calls
    return answers


def test_a_repeat_spelling_out_a_default_joins_the_call_in_progress(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """The proto's rule for every lifecycle call: the same arguments once defaults are
    filled in (a path written another way, a revision a local directory does not read)."""
    with live_server() as (_, stub):
        init = Held(monkeypatch, "init_device")
        picked = pb.DEVICE_KIND_GPU if auto_kind() is DeviceKind.GPU else pb.DEVICE_KIND_CPU
        devices = _all_join(
            init,
            lambda: stub.InitDevice(pb.InitDeviceRequest()),
            lambda: stub.InitDevice(pb.InitDeviceRequest(device=picked, world_size=1)),
        )
        assert devices[0] == devices[1]
        load = Held(monkeypatch, "load")
        own = json.loads((tiny_dir / "config.json").read_text())["max_position_embeddings"]
        models = _all_join(
            load,
            lambda: stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir))),
            lambda: stub.LoadModel(pb.LoadModelRequest(model=f"{tiny_dir}/./")),
            lambda: stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir), revision="main")),
            # max_model_len at or past the model's own context caps nothing: 0's call.
            lambda: stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir), max_model_len=own)),
            lambda: stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir), max_model_len=10**6)),
        )
        assert len({m.worker_epoch for m in models}) == 1
        # Done as well as in progress: no reload, the same epoch.
        again = stub.LoadModel(pb.LoadModelRequest(model=f"{tiny_dir}/", revision="v2"))
        assert again.worker_epoch == models[0].worker_epoch
        assert len(load.calls) == 1
        block_size = stub.DetermineMemory(_profile()).block_size
        runner = Held(monkeypatch, "new_runner")
        caches = _all_join(
            runner,
            lambda: stub.InitCache(pb.InitCacheRequest(num_blocks=8)),
            lambda: stub.InitCache(
                pb.InitCacheRequest(num_blocks=8, block_size=block_size, enable_prefix_caching=True)
            ),
        )
        assert caches[0] == caches[1]
        assert caches[0].state == pb.WORKER_STATE_READY


def test_a_deep_check_queued_behind_a_sleep_answers_asleep(
    loaded: tuple[WorkerServer, pb_grpc.WorkerServiceStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CheckHealth(deep) sent while a level-2 Sleep waits for the engine thread runs after
    the weights are gone: it answers SLEEPING (no forward), not INTERNAL."""
    _, stub = loaded
    stub.DetermineMemory(_profile(32))
    stub.InitCache(pb.InitCacheRequest(num_blocks=8))
    deep = Held(monkeypatch, "deep_check")
    with ThreadPoolExecutor(3) as pool:
        holding = pool.submit(stub.CheckHealth, pb.CheckHealthRequest(deep=True))
        assert deep.started.wait(timeout=30)  # the engine thread is held
        sleep = pool.submit(stub.Sleep, pb.SleepRequest(level=2))
        time.sleep(0.3)  # queued behind the held check
        queued = pool.submit(stub.CheckHealth, pb.CheckHealthRequest(deep=True))
        time.sleep(0.3)  # queued behind the Sleep
        deep.go.set()
        assert holding.result(timeout=60).deep_check_ns > 0
        assert sleep.result(timeout=60).state == pb.WORKER_STATE_SLEEPING
        answer = queued.result(timeout=60)
    assert (answer.state, answer.deep_check_ns) == (pb.WORKER_STATE_SLEEPING, 0)
    assert len(deep.calls) == 1
    # Asleep, a repeat of InitDevice still answers with the device (it is idempotent).
    assert stub.InitDevice(pb.InitDeviceRequest()).device.kind
    with pytest.raises(grpc.RpcError) as refused:
        stub.DetermineMemory(_profile(32))
    assert details_of(refused.value) == "DetermineMemory: the worker is SLEEPING: call WakeUp first"


def test_an_init_device_asking_for_another_rank_is_invalid_in_any_state(
    loaded: tuple[WorkerServer, pb_grpc.WorkerServiceStub],
) -> None:
    _, stub = loaded
    for request, rank in (
        (pb.InitDeviceRequest(rank=1), 1),
        (pb.InitDeviceRequest(local_rank=1), 0),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            stub.InitDevice(request)
        assert code_of(refused.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert f"InitDevice.rank is {rank}" in details_of(refused.value)
    assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_MODEL_LOADED


def test_other_lifecycle_calls_meanwhile_are_refused_naming_the_call_in_progress(
    loaded: tuple[WorkerServer, pb_grpc.WorkerServiceStub],
    monkeypatch: pytest.MonkeyPatch,
    tiny_dir: Path,
) -> None:
    _, stub = loaded
    profile = Held(monkeypatch, "profile")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(stub.DetermineMemory, _profile(32))
        assert profile.started.wait(timeout=30)
        with pytest.raises(grpc.RpcError) as other_args:
            stub.DetermineMemory(_profile(64))
        with pytest.raises(grpc.RpcError) as other_call:
            stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir)))
        # Not a lifecycle call: it answers at once.
        assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_MODEL_LOADED
        profile.go.set()
        first.result(timeout=60)
    assert code_of(other_args.value) == grpc.StatusCode.ABORTED
    assert "max_num_batched_tokens=64 (in progress: 32)" in details_of(other_args.value)
    assert code_of(other_call.value) == grpc.StatusCode.ABORTED
    assert "DetermineMemory(memory_utilization=0.9, max_num_batched_tokens=32" in details_of(
        other_call.value
    )
    assert len(profile.calls) == 1


def test_a_call_given_up_before_it_started_never_runs(
    loaded: tuple[WorkerServer, pb_grpc.WorkerServiceStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, stub = loaded
    deep = Held(monkeypatch, "deep_check")
    profile_runs: list[int] = []
    original = Replica.profile

    def counted(replica: Replica, **options: Any) -> Any:
        profile_runs.append(options["max_num_batched_tokens"])
        return original(replica, **options)

    monkeypatch.setattr(Replica, "profile", counted)
    with ThreadPoolExecutor(1) as pool:
        busy: Future[Any] = pool.submit(stub.CheckHealth, pb.CheckHealthRequest(deep=True))
        assert deep.started.wait(timeout=30)  # the engine thread is held
        with pytest.raises(grpc.RpcError) as gave_up:
            stub.DetermineMemory(_profile(32), timeout=0.5)
        assert code_of(gave_up.value) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert server.worker.lifecycle.in_progress is not None
        _wait_for(lambda: server.worker.lifecycle.in_progress is None, "cancelled call")
        deep.go.set()
        busy.result(timeout=60)
    time.sleep(0.2)
    assert profile_runs == [], "the abandoned DetermineMemory still ran"
    assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_MODEL_LOADED
    stub.DetermineMemory(_profile(32))
    assert profile_runs == [32]


def test_a_call_given_up_after_it_started_keeps_its_result_for_the_next_one(
    loaded: tuple[WorkerServer, pb_grpc.WorkerServiceStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, stub = loaded
    profile = Held(monkeypatch, "profile")
    with pytest.raises(grpc.RpcError) as gave_up:
        stub.DetermineMemory(_profile(32), timeout=0.5)
    assert code_of(gave_up.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert profile.started.is_set()
    profile.go.set()
    _wait_for(
        lambda: stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_MEMORY_PROFILED,
        "profile",
    )
    again = stub.DetermineMemory(_profile(32))
    assert len(profile.calls) == 1, "the retry profiled again"
    assert again.suggested_num_blocks > 0
    # A different call is not served from what was kept.
    stub.DetermineMemory(_profile(16))
    assert [c["max_num_batched_tokens"] for c in profile.calls] == [32, 16]
    assert server.worker.state.value == "MEMORY_PROFILED"


def test_a_worker_bringing_itself_up_says_so_and_takes_only_repeats(
    loaded: tuple[WorkerServer, pb_grpc.WorkerServiceStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, stub = loaded
    profile = Held(monkeypatch, "profile")
    worker = server.worker

    def own_bring_up() -> None:
        worker.lifecycle.claim()
        try:
            worker.determine_memory(0.0, 0, 16)
        finally:
            worker.lifecycle.release()

    owner = threading.Thread(target=own_bring_up)
    owner.start()
    try:
        assert profile.started.wait(timeout=30)
        health = stub.CheckHealth(pb.CheckHealthRequest())
        assert health.bringing_up and health.state == pb.WORKER_STATE_MODEL_LOADED
        with pytest.raises(grpc.RpcError) as refused:
            stub.InitCache(pb.InitCacheRequest(num_blocks=8))
        assert code_of(refused.value) == grpc.StatusCode.ABORTED
        # A step is refused at once, not queued behind the profile that holds the engine.
        with pytest.raises(grpc.RpcError) as early:
            stub.Execute(pb.ExecuteRequest(step_id=1, worker_epoch=health.worker_epoch), timeout=10)
        assert code_of(early.value) == grpc.StatusCode.FAILED_PRECONDITION
        assert "bringing itself up (serve --auto-init)" in details_of(early.value)
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(stub.DetermineMemory, pb.DetermineMemoryRequest())
            time.sleep(0.2)
            profile.go.set()
            assert joined.result(timeout=60).state == pb.WORKER_STATE_MEMORY_PROFILED
    finally:
        profile.go.set()
        owner.join(timeout=60)
    assert len(profile.calls) == 1
    assert not stub.CheckHealth(pb.CheckHealthRequest()).bringing_up
    assert "DetermineMemory(" in details_of(refused.value)


def test_outside_calls_between_the_bring_up_steps_are_refused(
    loaded: tuple[WorkerServer, pb_grpc.WorkerServiceStub],
) -> None:
    server, stub = loaded
    server.worker.lifecycle.claim()  # this thread brings the worker up; gRPC's do not
    try:
        with pytest.raises(grpc.RpcError) as refused:
            stub.DetermineMemory(pb.DetermineMemoryRequest())
        with pytest.raises(grpc.RpcError) as early:  # not "call LoadModel first"
            list(stub.Generate(pb.GenerateRequest(prompt="hi")))
    finally:
        server.worker.lifecycle.release()
    assert code_of(refused.value) == grpc.StatusCode.ABORTED
    assert "bringing itself up (serve --auto-init)" in details_of(refused.value)
    assert "CheckHealth.bringing_up" in details_of(refused.value)
    assert code_of(early.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert details_of(early.value) == (
        "Generate needs state READY or later; the worker is MODEL_LOADED, bringing itself "
        "up (serve --auto-init): wait until CheckHealth.bringing_up is false"
    )


def test_determine_memory_without_a_size_profiles_the_devices_default(
    loaded: tuple[WorkerServer, pb_grpc.WorkerServiceStub], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, stub = loaded
    seen: list[int] = []
    original = Replica.profile

    def spy(replica: Replica, **options: Any) -> Any:
        seen.append(options["max_num_batched_tokens"])
        return original(replica, **options)

    monkeypatch.setattr(Replica, "profile", spy)
    assert stub.DetermineMemory(pb.DetermineMemoryRequest()).suggested_num_blocks > 0
    assert seen == [PROFILE_TOKENS[DeviceKind.CPU]] == [32]
    assert default_profile_tokens(DeviceKind.GPU, 8192) == 2048
    assert default_profile_tokens(DeviceKind.GPU, 1024) == 1024
    assert default_profile_tokens(None, 0) == 32


@pytest.mark.smollm
def test_sigterm_while_the_worker_profiles_itself_exits_at_once(smollm_dir: Path) -> None:
    """A 2,048-token profile of SmolLM2 takes minutes on a CPU; SIGTERM does not wait for it."""
    serve = ["serve", "--model", str(smollm_dir), "--auto-init", "--port", "0"]
    worker = Proc([*serve, "--max-num-batched-tokens", "2048"])
    try:
        port = worker.wait_for(r"listening on [\d.]+:(\d+)").group(1)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            _wait_for(
                lambda: (
                    stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_MODEL_LOADED
                ),
                "the profile",
            )
            health = stub.CheckHealth(pb.CheckHealthRequest())
        assert health.bringing_up
        time.sleep(1.0)  # well inside the profile
        sent = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        code = worker.proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        worker.reap()
    print(f"SIGTERM while profiling: exit {code} after {took:.2f} s")
    assert code == 0, worker.output
    assert took < 10.0
    assert not any(line.startswith("ready:") for line in worker.lines)
