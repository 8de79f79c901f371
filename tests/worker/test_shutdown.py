"""Drain: SIGTERM and the Shutdown RPC share one path and lose nothing."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from driver import ServeProcess, bring_up, code_of, greedy
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlx_worker_svc.engine.runner import ModelRunner
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import SERVICE_NAME, ServerConfig, WorkerServer


def _start_one(
    stub: pb_grpc.WorkerServiceStub, epoch: int, *, ignore_eos: bool = False
) -> list[int]:
    """Starts request "r" (2 prompt tokens, up to 40 greedy ones) through Execute; returns
    the token its first step sampled."""
    new = pb.NewRequest(req_id="r", prompt_token_ids=[5, 6], sampling_params=greedy(40))
    new.sampling_params.ignore_eos = ignore_eos
    step = pb.ExecuteRequest(worker_epoch=epoch, new_requests=[new])
    step.num_scheduled_tokens["r"] = 2
    return list(stub.Execute(step).outputs[0].sampled_token_ids)


@contextlib.contextmanager
def _one_running(
    tiny_dir: Path, *, ignore_eos: bool = False
) -> Iterator[tuple[WorkerServer, pb_grpc.WorkerServiceStub, int, list[int]]]:
    """A worker served in-process (grace 30 s) running request "r" (_start_one):
    (the server, a stub, the epoch, r's first token)."""
    server = WorkerServer(ServerConfig(port=0, grace_seconds=30.0))
    port = server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
        stub = pb_grpc.WorkerServiceStub(chan)
        bring_up(stub, tiny_dir)
        epoch = int(stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
        yield server, stub, epoch, _start_one(stub, epoch, ignore_eos=ignore_eos)


def _wait_not_serving(health: health_pb2_grpc.HealthStub) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        answer = health.Check(health_pb2.HealthCheckRequest(service=""))
        if answer.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            return
        time.sleep(0.01)
    raise AssertionError("health did not turn NOT_SERVING after SIGTERM")


def test_sigterm_lets_running_generates_finish_and_exits_zero(
    start_worker: Callable[[float], ServeProcess],
) -> None:
    worker = start_worker(60.0)
    chan = worker.channel()
    stub = pb_grpc.WorkerServiceStub(chan)
    lengths = [300, 200, 250, 120]  # k = 4 streams in flight
    streams = [
        stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=[1, 2, 3 + i], sampling_params=greedy(n, ignore_eos=True)
            )
        )
        for i, n in enumerate(lengths)
    ]
    firsts = [next(stream) for stream in streams]
    started = time.monotonic()
    os.kill(worker.proc.pid, signal.SIGTERM)
    _wait_not_serving(health_pb2_grpc.HealthStub(chan))
    # New work during the drain is refused by the worker, while the old streams run on.
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], sampling_params=greedy(2))))
    assert code_of(info.value) == grpc.StatusCode.UNAVAILABLE
    assert "DRAINING" in (info.value.details() or "")
    completed = 0
    for stream, first, n in zip(streams, firsts, lengths, strict=True):
        tokens, last = list(first.token_ids), first
        for message in stream:
            tokens += message.token_ids
            last = message
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) == n
        completed += 1
    assert worker.exit_code() == 0
    print(
        f"drain: {len(lengths)} in flight, 1 new call refused, {completed} completed, "
        f"{len(lengths) - completed} lost, exit 0 {time.monotonic() - started:.1f}s after SIGTERM"
    )


def test_sigterm_past_the_grace_period_ends_streams_with_a_clear_status(
    start_worker: Callable[[float], ServeProcess],
) -> None:
    worker = start_worker(0.3)
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    stream = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=greedy(500, ignore_eos=True))
    )
    next(stream)
    started = time.monotonic()
    os.kill(worker.proc.pid, signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert code_of(info.value) in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)
    assert time.monotonic() - started < 10
    assert worker.exit_code() == 0


def test_sighup_drains_as_sigterm_does(start_worker: Callable[[float], ServeProcess]) -> None:
    """A closed terminal or a reload habit does not kill a worker with its work in flight."""
    worker = start_worker(30.0)
    chan = worker.channel()
    stub = pb_grpc.WorkerServiceStub(chan)
    stream = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling_params=greedy(60, ignore_eos=True))
    )
    first = next(stream)
    os.kill(worker.proc.pid, signal.SIGHUP)
    _wait_not_serving(health_pb2_grpc.HealthStub(chan))
    tokens = [*first.token_ids, *(t for message in stream for t in message.token_ids)]
    assert len(tokens) == 60
    assert worker.exit_code() == 0


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
        for bad in (-5.0, math.nan, math.inf):  # refused, and nothing drains
            with pytest.raises(grpc.RpcError) as refused:
                stub.Shutdown(pb.ShutdownRequest(grace_seconds=bad))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "ShutdownRequest.grace_seconds must be" in str(refused.value.details())
        assert (
            stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_SERVING
        )  # not DRAINING
        answer = stub.Shutdown(pb.ShutdownRequest(grace_seconds=30))
        assert answer.num_in_flight == 1
        status = health.Check(health_pb2.HealthCheckRequest(service="")).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        # No new work while it drains, a tokenization included (README's lifecycle).
        for call, request in (
            (stub.Tokenize, pb.TokenizeRequest(text="hi")),
            (stub.Detokenize, pb.DetokenizeRequest(token_ids=[5])),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call(request)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "the worker is DRAINING and accepts no new work" in str(refused.value.details())
        assert stub.GetInfo(pb.GetInfoRequest()).state == pb.WORKER_STATE_DRAINING
        rest = list(stream)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert server.wait(timeout=30)
    assert server.worker.state.value == "STOPPED"


def test_a_generate_a_drain_cuts_is_logged_aborted(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Generate still running when the grace period ends: ABORTED to its caller, and
    "request aborted" in the log (operations.md's end lines), not "request failed"."""
    caplog.set_level(logging.INFO, logger="mlx_worker_svc.worker.generation")
    server = WorkerServer(ServerConfig(port=0, grace_seconds=0.3))
    port = server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
        stub = pb_grpc.WorkerServiceStub(chan)
        bring_up(stub, tiny_dir)
        request = pb.GenerateRequest(
            request_id="cut", prompt_token_ids=[5, 6], sampling_params=greedy(5000, ignore_eos=True)
        )
        stream = stub.Generate(request)
        next(stream)
        server.shutdown(grace_seconds=0.3)
        with pytest.raises(grpc.RpcError) as cut:
            list(stream)
        assert code_of(cut.value) == grpc.StatusCode.ABORTED
    assert server.wait(timeout=30)
    ends = [r.getMessage() for r in caplog.records if getattr(r, "req_id", "") == "cut"]
    assert ends == ["request admitted", "request aborted"]


def test_engine_death_ends_every_call_with_internal_and_turns_health_off(
    tiny_stub: pb_grpc.WorkerServiceStub,
    channel: grpc.Channel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = tiny_stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=[1, 2, 3], sampling_params=greedy(5000, ignore_eos=True)
        )
    )
    next(stream)

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("injected engine fault")

    # The engine thread schedules Generate between jobs: this kills the thread itself.
    monkeypatch.setattr(ModelRunner, "internal_work", broken)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert code_of(info.value) == grpc.StatusCode.INTERNAL
    assert "injected engine fault" in (info.value.details() or "")
    assert time.monotonic() - started < 10
    report = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert not report.healthy and report.state == pb.WORKER_STATE_STOPPED
    assert "injected engine fault" in report.last_error
    with pytest.raises(grpc.RpcError) as info:
        tiny_stub.Execute(pb.ExecuteRequest(step_id=1, worker_epoch=report.worker_epoch))
    assert code_of(info.value) in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    health = health_pb2_grpc.HealthStub(channel)
    service = health_pb2.HealthCheckRequest(service="mlx_worker.v1.WorkerService")
    assert health.Check(service).status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_shutdown_gives_a_schedulers_running_requests_the_grace_period(tiny_dir: Path) -> None:
    """A request a scheduler runs through Execute is in flight as a Generate stream is:
    its steps still run while the worker drains, and the worker stops once it ends
    (within the grace), not as soon as the Generate streams are done."""
    with _one_running(tiny_dir, ignore_eos=True) as (server, stub, epoch, first):
        tokens = list(first)
        assert stub.Shutdown(pb.ShutdownRequest(grace_seconds=30)).num_in_flight == 1
        finish = pb.FINISH_REASON_UNSPECIFIED
        while not finish:
            cached = pb.CachedRequest(req_id="r", num_computed_tokens=1 + len(tokens))
            step = pb.ExecuteRequest(worker_epoch=epoch, cached_requests=[cached])
            step.num_scheduled_tokens["r"] = 1
            [out] = stub.Execute(step).outputs
            tokens += out.sampled_token_ids
            finish = out.finish_reason
        assert finish == pb.FINISH_REASON_LENGTH and len(tokens) == 40
    assert server.wait(timeout=30)
    assert server.worker.state.value == "STOPPED"


def test_a_second_sigterm_cuts_the_grace_period_short(
    start_worker: Callable[[float], ServeProcess],
) -> None:
    """An operator's second SIGTERM (or Ctrl-C) ends the drain at once: the process
    exits 0 without waiting out the grace period for a request no one will finish."""
    worker = start_worker(120.0)
    chan = worker.channel()
    stub = pb_grpc.WorkerServiceStub(chan)
    epoch = int(stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
    _start_one(stub, epoch)  # running, and its scheduler never comes back
    os.kill(worker.proc.pid, signal.SIGTERM)
    os.kill(worker.proc.pid, signal.SIGTERM)  # delivered twice (as GNU timeout does): one
    _wait_not_serving(health_pb2_grpc.HealthStub(chan))
    time.sleep(1.5)
    assert worker.proc.poll() is None  # the first signal waits for the request
    started = time.monotonic()
    os.kill(worker.proc.pid, signal.SIGTERM)
    assert worker.exit_code() == 0
    assert time.monotonic() - started < 30  # not the 120 s grace


@pytest.mark.parametrize(
    ("first", "second", "stops_within"),
    [
        (pb.ShutdownRequest(grace_seconds=120), pb.ShutdownRequest(abort=True), 15.0),
        (pb.ShutdownRequest(grace_seconds=120), pb.ShutdownRequest(grace_seconds=0.5), 15.0),
        (pb.ShutdownRequest(grace_seconds=0.5), pb.ShutdownRequest(grace_seconds=120), 15.0),
    ],
    ids=["abort", "shorter", "longer"],
)
def test_a_second_shutdown_cuts_the_drain_short_and_never_lengthens_it(
    tiny_dir: Path, first: pb.ShutdownRequest, second: pb.ShutdownRequest, stops_within: float
) -> None:
    """During a drain, Shutdown(abort) ends the grace at once (as a second SIGTERM), a
    shorter grace_seconds shortens it, and a longer one leaves it as it was; each
    answers DRAINING. A scheduler's running request that never ends holds the drain."""
    with _one_running(tiny_dir) as (server, stub, _, _):  # its scheduler never comes back
        assert stub.Shutdown(first).num_in_flight == 1
        started = time.monotonic()
        assert stub.Shutdown(second).state == pb.WORKER_STATE_DRAINING
    assert server.wait(timeout=stops_within)
    assert time.monotonic() - started < stops_within
    assert server.worker.state.value == "STOPPED"


def test_an_open_health_watch_does_not_hold_up_the_stop(tiny_dir: Path) -> None:
    """A probe or load balancer keeps a Watch open for good: the drained worker still
    stops at once, the Watch reading NOT_SERVING, then its end (status OK)."""
    server = WorkerServer(ServerConfig(port=0, grace_seconds=60.0))
    port = server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
        stub = pb_grpc.WorkerServiceStub(chan)
        bring_up(stub, tiny_dir)
        watch = health_pb2_grpc.HealthStub(chan).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        stub.Shutdown(pb.ShutdownRequest(grace_seconds=60))
        assert [m.status for m in watch] == [health_pb2.HealthCheckResponse.NOT_SERVING]
    assert server.wait(timeout=15)
    assert time.monotonic() - started < 15  # not the 60 s grace


@pytest.mark.parametrize("second", [None, pb.ShutdownRequest(abort=True)], ids=["runs-out", "cut"])
def test_a_watch_ends_ok_when_the_grace_runs_out_on_work_in_flight(
    tiny_dir: Path, second: pb.ShutdownRequest | None
) -> None:
    """A scheduler's request that never ends holds the drain until its grace runs out (or
    a second Shutdown cuts it): the open Watch still ends with OK, as README says, not
    with the stop's cancellation of the calls left."""
    with _one_running(tiny_dir) as (server, stub, _, _):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        health = health_pb2_grpc.HealthStub(channel)
        names = ("", SERVICE_NAME)
        watches = [health.Watch(health_pb2.HealthCheckRequest(service=s)) for s in names]
        for watch in watches:
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stub.Shutdown(pb.ShutdownRequest(grace_seconds=0.5))
        if second is not None:
            stub.Shutdown(second)
        for watch in watches:  # an UNAVAILABLE end would raise here
            assert [m.status for m in watch] == [health_pb2.HealthCheckResponse.NOT_SERVING]
            assert watch.code() == grpc.StatusCode.OK
        channel.close()
    assert server.wait(timeout=15)
