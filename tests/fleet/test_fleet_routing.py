"""The fleet end to end, routing and admission: prefix affinity, least-loaded, the queue bound.

The same worker processes and fleet subprocesses as test_fleet.py (conftest.py):
requests sharing a long prefix go where it is cached, `--routing least-loaded`
spreads them, and a full queue refuses at once, also while text prompts are
being tokenized, while every admitted request completes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from driver import code_of, details_of, greedy
from processes import (
    Fleet,
    Proc,
    WorkerPool,
    by_target,
    distinct_prompts,
    run_streams,
    token_request,
    tokens_of,
)

from mlx_worker_svc.fleet import LinkConfig
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc


class StatusPoller(threading.Thread):
    """Polls the fleet's Status until stopped; keeps the largest queue it saw."""

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(daemon=True)
        self.fleet = fleet
        self.peak_queued = 0
        self.samples = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                status = self.fleet.status()
                self.peak_queued = max(self.peak_queued, status.num_queued)
                self.samples += 1
                self._halt.wait(0.01)
        except grpc.RpcError as exc:
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)
        assert self.error is None, self.error


def test_requests_sharing_a_prefix_go_where_it_is_cached(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    fleet = start_fleet(pool.targets)  # --routing prefix, the default
    [prefix] = distinct_prompts(1, 512, seed=3)
    cached: list[int] = []
    for suffix in distinct_prompts(4, 8, seed=4):
        messages = fleet.generate(token_request(prefix + suffix, 4))
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(tokens_of(messages)) == 4
        cached.append(messages[0].num_cached_prompt_tokens)
    assert cached == [0, 512, 512, 512]
    status = fleet.status()
    [home] = [w for w in status.workers if w.num_finished]
    assert home.num_finished == 4
    assert (home.prefix_hits, home.cached_prompt_tokens) == (3, 3 * 512)

    # Prompts shorter than the affinity window (256 tokens) spread over every worker.
    for prompt in distinct_prompts(6, 8, seed=5):
        assert len(tokens_of(fleet.generate(token_request(prompt, 4)))) == 4
    before, after = by_target(status), by_target(fleet.status())
    gained = {target: after[target].num_finished - before[target].num_finished for target in after}
    assert all(gained.values()), gained


def test_least_loaded_routing_spreads_a_shared_prefix(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    fleet = start_fleet(pool.targets, "--routing", "least-loaded")
    [prefix] = distinct_prompts(1, 512, seed=6)
    for suffix in distinct_prompts(6, 8, seed=7):
        messages = fleet.generate(token_request(prefix + suffix, 4))
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finished = {w.target: w.num_finished for w in fleet.status().workers}
    assert all(finished.values()) and sum(finished.values()) == 6, finished


def test_a_full_queue_refuses_at_once_and_admitted_requests_complete(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    fleet = start_fleet(pool.targets[:1], "--queue", "4", "--max-num-seqs", "2")
    poller = StatusPoller(fleet)
    poller.start()
    try:
        prompts = distinct_prompts(30, 6, seed=8)
        streams = run_streams(fleet.stub, [token_request(p, 32) for p in prompts])
    finally:
        poller.stop()
    rejected = [s for s in streams if s.error is not None]
    admitted = [s for s in streams if s.error is None]
    assert rejected and len(admitted) >= 4, (len(admitted), len(rejected))
    for stream in rejected:
        assert stream.error is not None
        assert code_of(stream.error) == grpc.StatusCode.RESOURCE_EXHAUSTED, stream.error
        assert "queue is full" in details_of(stream.error)
        assert stream.messages == [], "a refused request streamed something first"
        assert stream.elapsed < 5.0
    for stream in admitted:
        assert stream.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(stream.tokens) == 32
    # Refused at once: before any admitted request could have finished.
    assert max(s.elapsed for s in rejected) < min(s.elapsed for s in admitted)
    status = fleet.status()
    assert status.num_rejected == len(rejected)
    assert status.num_finished == len(admitted)
    assert (status.num_queued, status.queue_capacity) == (0, 4)
    assert poller.samples > 0 and poller.peak_queued <= 4, poller.peak_queued


def test_text_prompts_cannot_overflow_the_queue_while_they_are_tokenized(
    tiny_stub: pb_grpc.WorkerServiceStub, server: Any
) -> None:
    """The queue bound counts requests whose prompt is still being tokenized."""
    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler, Overloaded

    async def main() -> tuple[list[str], int]:
        config = FleetConfig(link=LinkConfig(max_num_seqs=1), queue_capacity=2)
        fleet = FleetScheduler([f"127.0.0.1:{server.port}"], config)
        await fleet.start()
        await fleet.wait_ready()
        sampling = greedy(4, ignore_eos=True)
        peak = 0

        async def one(i: int) -> str:
            nonlocal peak
            request = pb.GenerateRequest(prompt=f"hi {i}", sampling_params=sampling)
            try:
                async for _ in fleet.generate(request):
                    peak = max(peak, fleet.status().num_queued)
            except Overloaded:
                return "rejected"
            return "ok"

        results = await asyncio.gather(*(one(i) for i in range(10)))
        await fleet.stop()
        return list(results), peak

    results, peak = asyncio.run(main())
    assert results.count("rejected") >= 7 and peak <= 2
    assert results.count("ok") + results.count("rejected") == 10


def test_a_caller_that_leaves_while_no_worker_is_up_is_counted_as_cancelled() -> None:
    """Every ended request counts once: one cancelled before any worker came up too."""
    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler

    async def main() -> tuple[float, float]:
        fleet = FleetScheduler(["127.0.0.1:9"], FleetConfig())  # nothing listens there
        await fleet.start()
        cancelled = fleet.metrics.requests.labels("cancelled")
        before = cancelled._value.get()
        request = pb.GenerateRequest(prompt="hi", sampling_params=greedy(4))

        async def ask() -> None:
            async for _ in fleet.generate(request):
                pass

        with pytest.raises(TimeoutError):
            await asyncio.wait_for(ask(), timeout=0.5)
        after = cancelled._value.get()
        await fleet.stop()
        return before, after

    before, after = asyncio.run(main())
    assert after == before + 1


def test_a_drain_ends_a_request_still_being_admitted() -> None:
    """A request admitted before SIGTERM but still waiting for a worker is waited for
    through the grace period, then ends ShutDown (ABORTED), not 30 s later with
    NoWorkers, and the drain does not return before it has ended."""
    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler
    from mlx_worker_svc.fleet.errors import ShutDown

    async def main() -> tuple[str, float, float]:
        fleet = FleetScheduler(["127.0.0.1:9"], FleetConfig())  # nothing listens there
        await fleet.start()
        request = pb.GenerateRequest(prompt="hi", sampling_params=greedy(4))
        outcome = ""

        async def ask() -> None:
            nonlocal outcome
            try:
                async for _ in fleet.generate(request):
                    pass
            except ShutDown as exc:
                outcome = f"{exc.code.name}: {exc}"

        task = asyncio.create_task(ask())
        await asyncio.sleep(0.2)  # admitted: waiting for a worker
        assert fleet.status().num_queued == 1
        began = asyncio.get_running_loop().time()
        await fleet.drain(0.5)
        drained = asyncio.get_running_loop().time() - began
        await asyncio.wait_for(task, timeout=5)
        aborted = fleet.metrics.requests.labels("aborted")._value.get()
        await fleet.stop()
        return outcome, drained, aborted

    outcome, drained, aborted = asyncio.run(main())
    assert outcome == (
        "ABORTED: the fleet shut down before the request finished (its --grace-seconds ran out)"
    )
    assert 0.5 <= drained < 5  # the grace was given, and the request did not outlast it
    assert aborted == 1


def test_a_worker_that_stays_down_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Retries that fail the same way log WARNING once (DEBUG after), not every retry;
    Status still has the cause."""
    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler

    async def main() -> str:
        link = LinkConfig(retry_backoff=0.02, max_backoff=0.02)
        fleet = FleetScheduler(["127.0.0.1:9"], FleetConfig(link=link))  # nothing listens
        await fleet.start()
        await asyncio.sleep(1.0)  # a dozen tries or more
        last_error: str = fleet.status().workers[0].last_error
        await fleet.stop()
        return last_error

    with caplog.at_level("DEBUG", logger="mlx_worker_svc.fleet.link"):
        last_error = asyncio.run(main())
    tries = [r for r in caplog.records if "not usable" in r.getMessage()]
    assert [r.levelname for r in tries[:2]] == ["WARNING", "DEBUG"]
    assert sum(r.levelname == "WARNING" for r in tries) == 1 and len(tries) > 5
    assert last_error and last_error in tries[0].getMessage()


def test_no_worker_up_says_why_the_workers_are_down() -> None:
    """NoWorkers names each worker that is down with the cause it last gave (the
    `generate` command's whole answer when its one worker cannot serve)."""
    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler, NoWorkers

    async def main() -> str:
        fleet = FleetScheduler(["127.0.0.1:9"], FleetConfig(no_worker_timeout=0.5))
        await fleet.start()
        request = pb.GenerateRequest(prompt_token_ids=[1, 2], sampling_params=greedy(4))
        try:
            async for _ in fleet.generate(request):
                pass
        except NoWorkers as exc:
            return str(exc)
        finally:
            await fleet.stop()
        return ""

    message = asyncio.run(main())
    assert message.startswith("no worker of the fleet is up (127.0.0.1:9: "), message


def test_a_second_sigterm_cuts_the_fleets_drain_short() -> None:
    """A second SIGTERM ends the fleet's grace period at once: the request still in
    flight ends ABORTED and the process exits 0, not after --grace-seconds."""
    fleet = Fleet(
        Proc(["fleet", "--worker", "127.0.0.1:9", "--port", "0", "--grace-seconds", "120"]),
        ["127.0.0.1:9"],  # nothing listens there: the request waits for a worker
    )
    errors: list[grpc.RpcError] = []

    def ask() -> None:
        try:
            fleet.generate(pb.GenerateRequest(prompt="hi", sampling_params=greedy(4)))
        except grpc.RpcError as exc:
            errors.append(exc)

    caller = threading.Thread(target=ask)
    try:
        caller.start()
        fleet.wait(lambda s: s.num_queued == 1, "request waiting")
        fleet.proc.proc.send_signal(signal.SIGTERM)
        time.sleep(1.5)  # a repeat sooner is the same signal delivered twice
        assert fleet.proc.proc.poll() is None  # the first signal waits for the request
        started = time.monotonic()
        fleet.proc.proc.send_signal(signal.SIGTERM)
        caller.join(30)
        assert [e.code() for e in errors] == [grpc.StatusCode.ABORTED]
        assert fleet.proc.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 20  # not the 120 s grace, nor the 30 s wait
    finally:
        fleet.channel.close()
        fleet.proc.reap()


def test_a_worker_found_asleep_is_woken_and_serves(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    """Asleep (a load on demand cut short by a fleet that stopped, or another client's
    Sleep), a worker is woken with WakeUp, not left "not usable" for good."""
    target = pool.targets[0]
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        stub.Sleep(pb.SleepRequest(level=2), timeout=60)
        assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_SLEEPING
        fleet = start_fleet([target])  # waits for the worker up
        [prompt] = distinct_prompts(1, 8, seed=43)
        assert len(tokens_of(fleet.generate(token_request(prompt, 4)))) == 4
        assert stub.CheckHealth(pb.CheckHealthRequest()).state in (
            pb.WORKER_STATE_READY,
            pb.WORKER_STATE_SERVING,
        )


def test_a_text_call_passes_over_a_worker_that_does_not_serve() -> None:
    """Tokenize (a text prompt's admission, /v1/messages) on a worker that turns out to
    be asleep, draining or gone goes to the next worker up; when none answers, the
    caller gets NoWorkers (UNAVAILABLE) with the cause, not the worker's own refusal."""
    from mlx_worker_svc.client.worker import ClientError
    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler
    from mlx_worker_svc.fleet.errors import NoWorkers

    asleep = ClientError(
        grpc.StatusCode.FAILED_PRECONDITION,
        "the worker is SLEEPING at level 1: call WakeUp first",
        "Tokenize",
    )
    draining = ClientError(
        grpc.StatusCode.UNAVAILABLE, "Tokenize: the worker is DRAINING", "Tokenize"
    )

    class Client:
        def __init__(self, error: ClientError | None) -> None:
            self.error, self.calls = error, 0

        async def tokenize(self, request: pb.TokenizeRequest, timeout: float) -> Any:
            self.calls += 1
            if self.error is not None:
                raise self.error
            return pb.TokenizeResponse(token_ids=[1, 2])

    async def main() -> tuple[list[int], list[int], str]:
        fleet = FleetScheduler(["127.0.0.1:9", "127.0.0.1:10"], FleetConfig())  # not started
        first, second = fleet.links
        for link, error in ((first, asleep), (second, None)):
            link.up, link.model_name = True, "m"
            link.client = Client(error)  # type: ignore[assignment]
        answer = await fleet.tokenize(pb.TokenizeRequest(text="hi"), "m")
        second.client = Client(draining)  # type: ignore[assignment]
        with pytest.raises(NoWorkers) as none:
            await fleet.tokenize(pb.TokenizeRequest(text="hi"), "m")
        calls = [link.client.calls for link in fleet.links]  # type: ignore[attr-defined]
        return list(answer.token_ids), calls, str(none.value)

    tokens, calls, message = asyncio.run(main())
    assert tokens == [1, 2] and calls == [2, 1]
    assert message.startswith("no worker of the fleet could answer: ") and "DRAINING" in message


def test_a_queue_place_refused_while_draining_logs_its_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gateway's Anthropic route takes a queue place before it tokenizes: refused
    during a drain, it logs `request failed` with `outcome` and `error`, as generate's
    refusals do (operations.md); the error said nothing of why before."""
    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler
    from mlx_worker_svc.fleet.errors import ShuttingDown

    async def main() -> None:
        fleet = FleetScheduler(["127.0.0.1:9"], FleetConfig())  # nothing listens there
        await fleet.start()
        fleet.draining = True
        with pytest.raises(ShuttingDown):
            async with fleet.queue_slot("", "msg_1"):
                pass
        fleet.draining = False
        await fleet.stop()

    with caplog.at_level(logging.INFO, logger="mlx_worker_svc"):
        asyncio.run(main())
    [failed] = [r for r in caplog.records if getattr(r, "req_id", None) == "msg_1"]
    assert failed.getMessage() == "request failed"
    assert getattr(failed, "outcome", None) == "unavailable"
    assert "the fleet is shutting down" in getattr(failed, "error", "")
