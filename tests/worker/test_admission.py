"""Admission limits, engine death and the process exit, cancellation and deadlines."""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from driver import ServeProcess, code_of, details_of, greedy, live_server
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlx_worker_svc.core.errors import InvalidArgument, ResourceExhausted
from mlx_worker_svc.core.limits import AdmissionLimits, context_hint, message_limit
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer
from mlx_worker_svc.worker.engine_loop import EngineLoop

LIMIT = 2


@pytest.fixture
def limited(tiny_dir: Path) -> Iterator[tuple[WorkerServer, pb_grpc.WorkerServiceStub, int]]:
    config = ServerConfig(
        port=0, limits=AdmissionLimits(max_running_requests=LIMIT, max_queued_steps=4)
    )
    with live_server(config) as (server, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        epoch = stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir))).worker_epoch
        stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=64, block_size=16))
        stub.InitCache(pb.InitCacheRequest(num_blocks=4096, enable_prefix_caching=False))
        _pace(server)
        yield server, stub, epoch


def _pace(server: WorkerServer, seconds: float = 0.01) -> None:
    """Makes every engine step take at least `seconds`.

    The tests here need requests still running when they look: the tiny model's
    longest generation (its 512-token context) must outlast a one-second deadline,
    and 40 tokens the next calls, on however fast a machine.
    """
    runner = server.worker.core.runner
    assert runner is not None
    run = runner.run

    def paced(work: Any) -> Any:
        time.sleep(seconds)
        return run(work)

    runner.run = paced  # type: ignore[method-assign]


def _long(stub: pb_grpc.WorkerServiceStub, tokens: int = 100_000, **kw: object) -> Any:
    return stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=[1, 2, 3, 4, 5], sampling_params=greedy(tokens, ignore_eos=True)
        ),
        **kw,
    )


def test_generate_past_the_running_limit_is_refused_at_once_and_health_answers(
    limited: tuple[WorkerServer, pb_grpc.WorkerServiceStub, int],
) -> None:
    server, stub, _ = limited
    streams = [_long(stub, 40) for _ in range(LIMIT)]
    for stream in streams:
        next(stream)  # both admitted and decoding
    with pytest.raises(grpc.RpcError) as info:
        list(_long(stub, 5))
    assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"over the limit of {LIMIT} live requests" in details_of(info.value)
    # Saturated, the worker still answers both health services.
    report = stub.CheckHealth(pb.CheckHealthRequest(), timeout=5)
    assert report.num_running_requests == LIMIT and report.healthy
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    check = health_pb2.HealthCheckRequest(service="mlx_worker.v1.WorkerService")
    assert health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    # Nothing admitted was lost: both finish with every token.
    for stream in streams:
        last = list(stream)[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.completion_tokens == 40
    done = list(_long(stub, 3))  # slots are free again
    assert done[-1].completion_tokens == 3


def test_execute_past_the_running_limit_is_refused_whole(
    limited: tuple[WorkerServer, pb_grpc.WorkerServiceStub, int],
) -> None:
    _, stub, epoch = limited
    new = [
        pb.NewRequest(req_id=f"r{i}", prompt_token_ids=[1, 2, 3], sampling_params=greedy(4))
        for i in range(LIMIT + 1)
    ]
    scheduled = {r.req_id: 3 for r in new}
    with pytest.raises(grpc.RpcError) as info:
        stub.Execute(
            pb.ExecuteRequest(
                step_id=1, worker_epoch=epoch, new_requests=new, num_scheduled_tokens=scheduled
            )
        )
    assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.GetInfo(pb.GetInfoRequest()).kv.used_blocks == 0
    # Nothing was applied: the same requests, within the limit, start cleanly.
    del scheduled["r2"]
    answer = stub.Execute(
        pb.ExecuteRequest(
            step_id=1, worker_epoch=epoch, new_requests=new[:LIMIT], num_scheduled_tokens=scheduled
        )
    )
    assert sorted(o.req_id for o in answer.outputs) == ["r0", "r1"]


def test_bounded_engine_jobs_past_the_queue_limit_are_refused_at_once() -> None:
    gate = threading.Event()
    loop = EngineLoop(lambda: False, lambda: None, max_queued=2)
    try:
        blocker = loop.submit(gate.wait)  # unbounded: occupies the engine thread
        queued = [loop.submit(functools.partial(int, i), bounded=True) for i in range(2)]
        refused = loop.submit(lambda: -1, bounded=True)
        with pytest.raises(ResourceExhausted, match="2 steps queued"):
            refused.result(timeout=1)
        assert loop.queued == 2
        unbounded = loop.submit(lambda: "cancel")  # cancellations are never refused
        gate.set()
        assert blocker.result(timeout=5) is True
        assert [f.result(timeout=5) for f in queued] == [0, 1]
        assert unbounded.result(timeout=5) == "cancel"
        assert loop.queued == 0
        assert loop.submit(lambda: 7, bounded=True).result(timeout=5) == 7
    finally:
        gate.set()
        loop.stop(timeout=5)


def test_a_deep_health_check_of_a_saturated_worker_waits_its_turn(
    limited: tuple[WorkerServer, pb_grpc.WorkerServiceStub, int],
) -> None:
    """With the engine's queue full, a deep CheckHealth is not refused (a probe would read a
    busy worker as failing): it runs after the steps queued before it, and the probes that
    come meanwhile share that one forward instead of piling up."""
    server, stub, _ = limited
    engine = server.worker.core.engine
    gate = threading.Event()
    blocker = engine.submit(gate.wait)  # the engine thread is busy
    queued = [engine.submit(functools.partial(int, i), bounded=True) for i in range(4)]
    try:
        refused = engine.submit(lambda: -1, bounded=True)
        with pytest.raises(ResourceExhausted):
            refused.result(timeout=1)  # the queue is full
        with futures.ThreadPoolExecutor(3) as pool:
            probes = [
                pool.submit(stub.CheckHealth, pb.CheckHealthRequest(deep=True), timeout=30)
                for _ in range(3)
            ]
            time.sleep(0.5)
            assert not any(probe.done() for probe in probes)  # waiting, not refused
            gate.set()
            answers = [probe.result(timeout=30) for probe in probes]
        assert all(a.healthy and a.deep_check_ns > 0 for a in answers)
        assert len({a.deep_check_ns for a in answers}) == 1  # one forward, shared
    finally:
        gate.set()
    assert blocker.result(timeout=5) is True
    assert [f.result(timeout=5) for f in queued] == [0, 1, 2, 3]


def test_limits_are_validated_and_message_sizes_follow_the_context(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="max_running_requests"):
        AdmissionLimits(max_running_requests=0)
    limits = AdmissionLimits(max_running_requests=256)
    assert message_limit(8192, limits) == 8192 * 256 * 8
    assert message_limit(16, limits) == 4 << 20
    assert message_limit(1 << 30, limits) == 1 << 30
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    assert context_hint(str(tmp_path)) == 8192
    assert context_hint(str(tmp_path), max_model_len=512) == 512
    assert context_hint("org/model-on-the-hub") == 32768
    config = ServerConfig(max_context_tokens=8192)
    assert config.message_bytes == 8192 * 256 * 8


def _traced(
    server: WorkerServer,
) -> tuple[dict[str, list[int]], Callable[[], None]]:
    """Records the engine step count when a call's cancel arrives and when its KV is freed."""
    worker = server.worker
    seen: dict[str, list[int]] = {"cancel": [], "freed": []}
    core = worker.core
    generate, end_stream = worker.generate, core.end_stream

    def traced_generate(spec: object) -> object:
        chunks, cancel = generate(spec)  # type: ignore[arg-type]

        def traced_cancel() -> None:
            seen["cancel"].append(worker.steps_run)
            cancel()

        return chunks, traced_cancel

    def traced_end(request_id: str, error: object) -> None:
        end_stream(request_id, error)  # type: ignore[arg-type]
        seen["freed"].append(worker.steps_run)

    worker.generate = traced_generate  # type: ignore[method-assign, assignment]
    core.end_stream = traced_end  # type: ignore[method-assign]

    def undo() -> None:
        del worker.generate, core.end_stream

    return seen, undo


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_cancelled_or_expired_generate_frees_its_kv_within_one_step(
    limited: tuple[WorkerServer, pb_grpc.WorkerServiceStub, int], how: str
) -> None:
    server, stub, _ = limited
    seen, undo = _traced(server)
    try:
        before = stub.GetInfo(pb.GetInfoRequest()).kv.used_blocks
        started = time.monotonic()
        stream = _long(stub, timeout=1.0) if how == "deadline" else _long(stub)
        next(stream)
        assert stub.GetInfo(pb.GetInfoRequest()).kv.used_blocks > before
        if how == "cancel":
            stream.cancel()
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        expected = (
            grpc.StatusCode.DEADLINE_EXCEEDED if how == "deadline" else grpc.StatusCode.CANCELLED
        )
        assert code_of(info.value) == expected
        deadline = time.monotonic() + 10
        while stub.GetInfo(pb.GetInfoRequest()).kv.used_blocks != before:
            assert time.monotonic() < deadline, "the KV was not freed"
            time.sleep(0.01)
        freed_after = time.monotonic() - started
        assert len(seen["cancel"]) == 1 and len(seen["freed"]) == 1
        steps = seen["freed"][0] - seen["cancel"][0]
        print(f"{how}: KV freed {steps} step(s) after the call ended ({freed_after:.2f}s in all)")
        assert steps <= 1
        assert server.worker.health(deep=False).num_running_requests == 0
    finally:
        undo()


def test_engine_death_ends_calls_with_internal_and_the_process_exits_nonzero(
    tiny_dir: Path,
) -> None:
    faulty = Path(__file__).with_name("faulty_worker.py")
    worker = ServeProcess(
        tiny_dir,
        grace=30,
        extra=["--death-exit-seconds", "4"],
        launcher=(sys.executable, str(faulty), "20"),
    )
    try:
        stub = pb_grpc.WorkerServiceStub(worker.channel())
        streams = [_long(stub, 1000) for _ in range(3)]
        codes = []
        for stream in streams:
            with pytest.raises(grpc.RpcError) as info:
                list(stream)
            codes.append(code_of(info.value))
            assert "injected engine fault" in details_of(info.value)
        ended = time.monotonic()
        assert codes == [grpc.StatusCode.INTERNAL] * 3
        code = worker.proc.wait(timeout=4 + 5)
        print(f"exit status {code} {time.monotonic() - ended:.2f}s after the calls ended")
        assert code == 3
    finally:
        worker.reap()


def test_getinfo_reports_the_limits_and_the_fleet_keeps_within_them(
    limited: tuple[WorkerServer, pb_grpc.WorkerServiceStub, int],
) -> None:
    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler, LinkConfig

    server, stub, _ = limited
    limits = stub.GetInfo(pb.GetInfoRequest()).limits
    assert (limits.max_running_requests, limits.max_queued_steps) == (LIMIT, 4)
    assert limits.max_message_bytes == server.config.message_bytes == 4 << 20

    async def main() -> tuple[list[int], int]:
        # The fleet would run 8 at once; the worker admits 2, and no request is refused.
        fleet = FleetScheduler(
            [f"127.0.0.1:{server.port}"], FleetConfig(link=LinkConfig(max_num_seqs=8))
        )
        await fleet.start()
        await fleet.wait_ready()
        peak = 0

        async def one(i: int) -> int:
            nonlocal peak
            request = pb.GenerateRequest(
                prompt_token_ids=[1, 2, i + 3], sampling_params=greedy(6, ignore_eos=True)
            )
            count = 0
            async for message in fleet.generate(request):
                count += len(message.token_ids)
                peak = max(peak, server.worker.health(deep=False).num_running_requests)
            return count

        counts = await asyncio.gather(*(one(i) for i in range(6)))
        await fleet.stop()
        return list(counts), peak

    counts, peak = asyncio.run(main())
    assert counts == [6] * 6 and peak <= LIMIT


def test_an_execute_whose_caller_left_while_it_waited_does_not_run(tiny_dir: Path) -> None:
    """A step queued behind busy engine work whose deadline passes never runs: the
    scheduler saw it fail, so it must leave nothing behind (no request, no KV), and the
    same step sent again starts cleanly. Counted as the caller saw it end."""
    from driver import bring_up

    with live_server() as (server, stub):
        bring_up(stub, tiny_dir)
        epoch = int(stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
        new = pb.NewRequest(req_id="late", prompt_token_ids=[5, 6, 7], sampling_params=greedy(4))
        step = pb.ExecuteRequest(worker_epoch=epoch, new_requests=[new])
        step.num_scheduled_tokens["late"] = 3
        gate = threading.Event()
        blocker = server.worker.core.engine.submit(gate.wait)  # the engine is busy
        try:
            with pytest.raises(grpc.RpcError) as late:
                stub.Execute(step, timeout=0.3)
            assert code_of(late.value) == grpc.StatusCode.DEADLINE_EXCEEDED
        finally:
            gate.set()
        blocker.result(timeout=10)
        health = stub.CheckHealth(pb.CheckHealthRequest())
        assert (health.num_running_requests, health.kv.used_blocks) == (0, 0)
        assert stub.Execute(step).outputs[0].req_id == "late"  # not "already running"
        count = server.metrics.registry.get_sample_value
        labels = {"service": "mlx_worker.v1.WorkerService", "method": "Execute"}
        deadline = time.monotonic() + 10
        while count("mlx_worker_rpcs_total", {**labels, "code": "DEADLINE_EXCEEDED"}) is None:
            assert time.monotonic() < deadline, "the late Execute was never counted"
            time.sleep(0.05)
        assert count("mlx_worker_rpcs_total", {**labels, "code": "DEADLINE_EXCEEDED"}) == 1
        assert count("mlx_worker_rpcs_total", {**labels, "code": "OK"}) == 1


def test_an_answer_past_the_message_limit_is_invalid_naming_the_field(
    limited: tuple[WorkerServer, pb_grpc.WorkerServiceStub, int], tiny_dir: Path
) -> None:
    """Tokenize and Detokenize answers larger than the worker sends are INVALID_ARGUMENT
    naming what made them so, not gRPC's RESOURCE_EXHAUSTED (a scheduler reads that as
    "retry later"); a request of the same kind that fits still answers."""
    server, stub, _ = limited
    limit = server.config.message_bytes
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    # A token of long text and a 2-byte id: the text is many times the request's bytes.
    word = max(range(128, 16384), key=lambda i: len(tokenizer.decode([i])))
    count = limit // len(tokenizer.decode([word])) + 1000
    chat = [pb.ChatMessage(role="user", content="a")] * (limit // 30)
    for call, request, field in (
        (stub.Detokenize, pb.DetokenizeRequest(token_ids=[word] * count), "token_ids: the tokens'"),
        (stub.Tokenize, pb.TokenizeRequest(messages=chat), "messages: the prompt's tokens and"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call(request)
        assert code_of(refused.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert details_of(refused.value).startswith(field)
        assert f"(GetInfo.limits.max_message_bytes: {limit})" in details_of(refused.value)
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=[word] * 100)).text
    assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_READY
