"""The fleet end to end, failover: a worker restarted, hung or killed mid-generation.

The same worker processes and fleet subprocesses as test_fleet.py (conftest.py):
a restarted worker rejoins with a new epoch and gets work, a hung one (SIGSTOP)
loses its requests within the documented detection bound and rejoins holding
nothing, and requests on a killed worker continue elsewhere token for token.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import grpc
from driver import greedy, reference_tokens, wait_until_idle
from processes import (
    STREAM_TIMEOUT,
    Fleet,
    Stream,
    WorkerPool,
    by_target,
    distinct_prompts,
    token_request,
    tokens_of,
)

from mlx_worker_svc.fleet import LinkConfig
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

PROBE = LinkConfig().probe_interval
DETECTION = LinkConfig().detection_seconds
"""A hung worker keeps its requests at most this long (README: Fleet, Failover)."""
SLACK = 5.0
"""Seconds for a few steps and a loaded two-core machine on top of a documented bound."""


def test_a_restarted_worker_rejoins_with_a_new_epoch_and_gets_work(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    fleet = start_fleet(pool.targets, "--routing", "least-loaded")
    victim = pool.targets[1]
    old_epoch = fleet.worker(victim).worker_epoch
    prompts = iter(distinct_prompts(40, 6, seed=9))

    def one_request() -> None:
        messages = fleet.generate(token_request(next(prompts), 4))
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(tokens_of(messages)) == 4

    one_request()
    pool.kill(1)  # idle: the fleet's probe finds out, not a request
    killed = time.monotonic()
    fleet.wait(lambda s: not by_target(s)[victim].up, "the killed worker down", timeout=30)
    shown_down = time.monotonic() - killed
    down = fleet.worker(victim)
    assert down.last_error and down.num_failed_over == 0, down
    print(f"idle worker killed: shown down {shown_down:.2f} s later (probe interval {PROBE:g} s)")
    assert shown_down <= PROBE + SLACK

    pool.restart(1)
    status = fleet.wait(lambda s: by_target(s)[victim].up, "restarted worker up", timeout=90)
    back = by_target(status)[victim]
    assert back.worker_epoch not in (0, old_epoch)
    assert back.last_error == ""
    for _ in range(6):
        one_request()
    assert fleet.worker(victim).num_finished > back.num_finished


def test_a_hung_worker_loses_its_requests_and_rejoins_holding_nothing(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    count, max_tokens = 6, 96
    prompts = distinct_prompts(count, 8, seed=11)
    expected = reference_tokens(
        pool.model, prompts, max_tokens, greedy(max_tokens, ignore_eos=True)
    )

    fleet = start_fleet(pool.targets[:2])
    victim, hung = pool.targets[0], pool.procs[0].proc
    streams = [Stream(fleet.stub, token_request(p, max_tokens)) for p in prompts]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_token.wait(timeout=120), "a stream produced no token"
    before = fleet.worker(victim)
    assert before.num_running > 0, before
    hung.send_signal(signal.SIGSTOP)  # alive, connected, answering nothing
    try:
        unfinished = sum(s.finish_reason == pb.FINISH_REASON_UNSPECIFIED for s in streams)
        for stream in streams:
            stream.join(timeout=STREAM_TIMEOUT + 30)
            assert not stream.is_alive(), "a Generate stream never ended"
        during = fleet.worker(victim)
    finally:
        hung.send_signal(signal.SIGCONT)

    assert unfinished == count, "streams finished before the worker hung: raise max_tokens"
    longest = max(stream.longest_wait() for stream in streams)
    print(
        f"SIGSTOP: requests moved on, longest wait for a message {longest:.2f} s "
        f"(documented detection {DETECTION:g} s)"
    )
    assert longest <= DETECTION + SLACK
    for stream, want in zip(streams, expected, strict=True):
        assert stream.error is None, stream.error
        assert stream.finish_reason == pb.FINISH_REASON_LENGTH
        assert stream.tokens == want
    assert not during.up and during.last_error, during
    assert during.num_failed_over == before.num_running

    # Back with the same epoch: the fleet frees what the worker still held for it.
    status = fleet.wait(lambda s: by_target(s)[victim].up, "hung worker back", timeout=90)
    assert by_target(status)[victim].worker_epoch == before.worker_epoch
    with grpc.insecure_channel(victim) as channel:
        wait_until_idle(pb_grpc.WorkerServiceStub(channel), timeout=30)


def test_killing_a_worker_mid_generation_loses_no_request(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    count, max_tokens = 24, 192  # every stream still running when the worker is killed
    prompts = distinct_prompts(count, 8, seed=10)
    # The reference: the same prompts, greedy, on one fresh worker.
    expected = reference_tokens(
        pool.model, prompts, max_tokens, greedy(max_tokens, ignore_eos=True)
    )

    fleet = start_fleet(pool.targets)
    streams = [Stream(fleet.stub, token_request(p, max_tokens)) for p in prompts]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_token.wait(timeout=120), "a stream produced no token"
    assert all(s.tokens and s.error is None for s in streams)
    victim = pool.targets[0]
    before = by_target(fleet.status())[victim]
    assert before.up and before.num_running > 0, before
    pool.kill(0)
    unfinished = sum(s.finish_reason == pb.FINISH_REASON_UNSPECIFIED for s in streams)
    for stream in streams:
        stream.join(timeout=STREAM_TIMEOUT + 30)
        assert not stream.is_alive(), "a Generate stream never ended"

    assert unfinished == count, "streams finished before the kill: raise max_tokens"
    with grpc.insecure_channel(pool.targets[1]) as channel:
        survivor = pb_grpc.WorkerServiceStub(channel)
        for stream, want in zip(streams, expected, strict=True):
            assert stream.error is None, stream.error
            assert stream.finish_reason == pb.FINISH_REASON_LENGTH
            assert stream.tokens == want
            last = stream.messages[-1]
            assert (last.prompt_tokens, last.completion_tokens) == (8, max_tokens)
            # The text goes on where the killed worker left it: none repeated, none lost.
            whole = survivor.Detokenize(
                pb.DetokenizeRequest(token_ids=want, skip_special_tokens=True)
            )
            assert "".join(m.text for m in stream.messages) == whole.text
    status = fleet.status()
    dead = by_target(status)[victim]
    assert not dead.up and dead.last_error, dead
    # Every request it held moved on (none had finished, none came in after).
    assert dead.num_failed_over == before.num_running > 0
    assert dead.num_finished == 0
    assert all(w.up for w in status.workers if w.target != victim)
    assert status.num_finished == count
    assert sum(w.num_finished for w in status.workers) == count


def test_a_worker_another_client_puts_to_sleep_loses_no_request(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    """A Sleep from outside aborts the worker's requests: they continue on the other
    worker token for token, new ones (text prompts, tokenized on a worker) pass the
    sleeping worker over, and the fleet wakes it and takes it back."""
    count, max_tokens = 4, 96
    prompts = distinct_prompts(count, 8, seed=12)
    expected = reference_tokens(
        pool.model, prompts, max_tokens, greedy(max_tokens, ignore_eos=True)
    )
    fleet = start_fleet(pool.targets[:2], "--routing", "least-loaded")
    victim = pool.targets[0]
    streams = [Stream(fleet.stub, token_request(p, max_tokens)) for p in prompts]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_token.wait(timeout=120), "a stream produced no token"
    assert fleet.worker(victim).num_running > 0
    with grpc.insecure_channel(victim) as channel:
        pb_grpc.WorkerServiceStub(channel).Sleep(pb.SleepRequest(level=1), timeout=60)
    texts = [
        Stream(fleet.stub, pb.GenerateRequest(prompt=f"Count to {i}", sampling_params=greedy(4)))
        for i in range(4)
    ]
    for stream in texts:
        stream.start()
    for stream in [*streams, *texts]:
        stream.join(timeout=STREAM_TIMEOUT + 30)
        assert not stream.is_alive(), "a Generate stream never ended"
    for stream, want in zip(streams, expected, strict=True):
        assert stream.error is None, stream.error
        assert stream.tokens == want
    assert [(s.error, len(s.tokens)) for s in texts] == [(None, 4)] * 4
    fleet.wait(lambda s: by_target(s)[victim].up, "the slept worker woken and back", 90)


def test_status_shows_the_state_a_down_workers_probe_answered(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    """A draining worker (another scheduler's request holds its grace) is down for the
    fleet, and Status says DRAINING, what its probe answered (fleet.proto), not UNSPECIFIED."""
    fleet = start_fleet(pool.targets)
    victim = pool.targets[0]
    with grpc.insecure_channel(victim) as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        epoch = int(stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
        held = pb.NewRequest(req_id="held", prompt_token_ids=[5, 6], sampling_params=greedy(40))
        step = pb.ExecuteRequest(worker_epoch=epoch, new_requests=[held])
        step.num_scheduled_tokens["held"] = 2
        stub.Execute(step)
        stub.Shutdown(pb.ShutdownRequest(grace_seconds=60))
        deadline = time.monotonic() + DETECTION + SLACK
        while (seen := by_target(fleet.status())[victim]).up or seen.state != (
            pb.WORKER_STATE_DRAINING
        ):
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        assert "DRAINING" in seen.last_error
        stub.Shutdown(pb.ShutdownRequest(abort=True))
    pool.procs[0].proc.wait(timeout=60)  # gone before the next test heals the pool


def test_a_lost_worker_keeps_the_state_last_seen() -> None:
    """Lost (its steps failed, its probes went unanswered), a worker's Status state is
    the one last seen until a probe answers another (fleet.proto), not UNSPECIFIED."""
    from mlx_worker_svc.fleet.link import WorkerLink

    async def main() -> int:
        link = WorkerLink(
            "127.0.0.1:9",
            LinkConfig(),
            on_lost=lambda _lost: None,
            on_up=lambda _link: None,
            emit=lambda _link, _request: True,
        )
        link.up, link.state = True, pb.WORKER_STATE_SERVING
        link._lose_everything("the worker answered no health check in 2 tries of 2 s")
        shown = link.status()
        await link.close()
        assert not shown.up and shown.last_error.startswith("the worker answered no")
        return int(shown.state)

    assert asyncio.run(main()) == pb.WORKER_STATE_SERVING
