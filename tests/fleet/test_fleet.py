"""The fleet scheduler end to end: real worker processes behind `mlx-worker fleet`.

Every worker is a `mlx-worker serve --auto-init` subprocess on the tiny random llama
(built with a 2,048-token context so a 512-token prefix fits) and the fleet is a
`mlx-worker fleet` subprocess, driven over loopback with the generated FleetService
stub, as an operator would drive it. A session-wide pool of three workers (conftest.py)
is shared by the tests; a test that kills a worker leaves it dead and the next one
starts it again on the same port. Every process is reaped, even when a test fails.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from driver import code_of, details_of, greedy, reference_tokens, wait_until_idle
from grpcurl_cli import (
    HEALTH,
    REFLECTION,
    Grpcurl,
    assert_reflection_v1_answers,
    grpcurl_binary,
    parse_stream,
)
from processes import (
    FLEET,
    STREAM_TIMEOUT,
    Fleet,
    Stream,
    WorkerPool,
    by_target,
    distinct_prompts,
    run_streams,
    token_request,
)

from mlx_worker_svc.fleet import LinkConfig
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

PROBE = LinkConfig().probe_interval
DETECTION = LinkConfig().detection_seconds
"""A hung worker keeps its requests at most this long (README: Fleet, Failover)."""
SLACK = 5.0
"""Seconds for a few steps and a loaded two-core machine on top of a documented bound."""


def tokens_of(messages: list[pb.GenerateResponse]) -> list[int]:
    return [token for message in messages for token in message.token_ids]


def text_of(messages: list[pb.GenerateResponse]) -> str:
    return "".join(message.text for message in messages)


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


# ---------------------------------------------------------------- tests
def test_grpcurl_lists_the_fleet_and_calls_status_and_generate(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    fleet = start_fleet(pool.targets)
    grpcurl = Grpcurl(grpcurl_binary(), fleet.port)
    assert grpcurl.ok("list").split() == sorted([FLEET, HEALTH, *REFLECTION])
    assert_reflection_v1_answers(grpcurl, sorted([FLEET, HEALTH, *REFLECTION]))
    assert grpcurl.ok("list", FLEET).split() == [f"{FLEET}.Generate", f"{FLEET}.Status"]
    deadline = time.monotonic() + 10
    while grpcurl.health(FLEET) != "SERVING":
        assert time.monotonic() < deadline, "the fleet's health never turned SERVING"
        time.sleep(0.1)
    [listed] = parse_stream(grpcurl.ok(f"{HEALTH}/List", body={}))
    assert listed == {"statuses": {"": {"status": "SERVING"}, FLEET: {"status": "SERVING"}}}

    [status] = parse_stream(grpcurl.ok(f"{FLEET}/Status", body={}))
    assert [w["target"] for w in status["workers"]] == pool.targets
    for worker in status["workers"]:
        assert worker["up"] is True, worker
        assert worker["state"] in {"WORKER_STATE_READY", "WORKER_STATE_SERVING"}, worker
        assert worker["worker_epoch"].isdigit(), "uint64 comes back as a JSON string"
        assert worker["model"] == str(pool.model)
        assert int(worker["kv"]["num_blocks"]) > 0
    assert status["queue_capacity"] == 256

    [prompt] = distinct_prompts(1, 6, seed=1)
    body = {
        "prompt_token_ids": prompt,
        "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True},
    }
    messages = parse_stream(grpcurl.ok(f"{FLEET}/Generate", body=body))
    tokens = [token for message in messages for token in message.get("token_ids", [])]
    *head, last = messages
    assert last["finish_reason"] == "FINISH_REASON_LENGTH"
    assert all("finish_reason" not in message for message in head)
    assert (last["prompt_tokens"], last["completion_tokens"]) == (len(prompt), 8)
    assert len({message["request_id"] for message in messages}) == 1
    assert tokens == tokens_of(fleet.generate(token_request(prompt, 8)))
    [after] = parse_stream(grpcurl.ok(f"{FLEET}/Status", body={}))
    assert after["num_finished"] == "2"


def test_generate_command_prints_the_fleets_answer(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    command = [sys.executable, "-m", "mlx_worker_svc", "generate", "--worker", pool.targets[0]]
    done = subprocess.run(
        [*command, "--raw", "hello", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    fleet = start_fleet(pool.targets[:1])
    sampling = pb.SamplingParams(temperature=0.0, max_tokens=8)
    expected = text_of(fleet.generate(pb.GenerateRequest(prompt="hello", sampling_params=sampling)))
    assert expected.strip(), "the tiny model said nothing"
    assert done.stdout == expected + "\n"


def test_a_stop_string_ends_the_stream_and_is_left_out(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    fleet = start_fleet(pool.targets)
    [prompt] = distinct_prompts(1, 6, seed=2)
    unstopped = fleet.generate(token_request(prompt, 32))
    full, all_tokens = text_of(unstopped), tokens_of(unstopped)
    assert unstopped[-1].finish_reason == pb.FINISH_REASON_LENGTH
    # A stop string from the middle of the text, at its first occurrence.
    start = next(
        i
        for i in range(len(full) // 3, len(full) - 3)
        if full.find(full[i : i + 3]) == i and full[i : i + 3].strip() and "\ufffd" not in full
    )
    stop = full[start : start + 3]

    # The last message names the stop string that matched, not one that never did.
    messages = fleet.generate(token_request(prompt, 32, stop=["\x00absent", stop]))
    *head, last = messages
    assert last.finish_reason == pb.FINISH_REASON_STOP_STRING
    assert last.stop_string == stop
    assert unstopped[-1].stop_string == ""
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in head)
    assert text_of(messages) == full[:start]
    tokens = tokens_of(messages)
    assert 0 < len(tokens) < 32 and tokens == all_tokens[: len(tokens)]
    assert (last.prompt_tokens, last.completion_tokens) == (len(prompt), len(tokens))


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
    count, max_tokens = 24, 96
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
    for stream, want in zip(streams, expected, strict=True):
        assert stream.error is None, stream.error
        assert stream.finish_reason == pb.FINISH_REASON_LENGTH
        assert stream.tokens == want
        last = stream.messages[-1]
        assert (last.prompt_tokens, last.completion_tokens) == (8, max_tokens)
    status = fleet.status()
    dead = by_target(status)[victim]
    assert not dead.up and dead.last_error, dead
    # Every request it held moved on (none had finished, none came in after).
    assert dead.num_failed_over == before.num_running > 0
    assert dead.num_finished == 0
    assert all(w.up for w in status.workers if w.target != victim)
    assert status.num_finished == count
    assert sum(w.num_finished for w in status.workers) == count


def test_text_prompts_cannot_overflow_the_queue_while_they_are_tokenized(
    tiny_stub: pb_grpc.WorkerServiceStub, server: Any
) -> None:
    """The queue bound counts requests whose prompt is still being tokenized."""
    import asyncio

    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler, LinkConfig, Overloaded

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


def _digits(max_tokens: int) -> pb.SamplingParams:
    """A long constrained output (one token a character): 60 digits, each with a comma."""
    return pb.SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=pb.StructuredOutputs(regex="([0-9],){60}"),
    )


def test_a_structured_output_spec_passes_through_and_survives_failover(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    count, max_tokens = 12, 160
    prompts = distinct_prompts(count, 8, seed=11)
    expected = reference_tokens(pool.model, prompts, max_tokens, _digits(max_tokens))
    fleet = start_fleet(pool.targets)
    requests = [
        pb.GenerateRequest(prompt_token_ids=p, sampling_params=_digits(max_tokens)) for p in prompts
    ]
    streams = [Stream(fleet.stub, r) for r in requests]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_token.wait(timeout=120), "a stream produced no token"
    pool.kill(0)
    for stream in streams:
        stream.join(timeout=STREAM_TIMEOUT + 30)
        assert not stream.is_alive(), "a Generate stream never ended"
    for stream, want in zip(streams, expected, strict=True):
        assert stream.error is None, stream.error
        assert stream.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE
        assert stream.tokens == want
        assert re.fullmatch("([0-9],){60}", text_of(stream.messages))
    assert by_target(fleet.status())[pool.targets[0]].num_failed_over > 0


def test_the_fleet_streams_every_token_as_sampled_through_execute_stream(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    """One step ahead (--steps-ahead 1) gives unary Execute's tokens, one message a token,
    with requests joining while others decode."""
    prompts = distinct_prompts(6, 9, seed=21)
    requests = [token_request(p, 12 + i) for i, p in enumerate(prompts)]
    unary = start_fleet(pool.targets[:1], "--steps-ahead", "0")
    expected = [tokens_of(s.messages) for s in run_streams(unary.stub, requests)]
    ahead = start_fleet(pool.targets[:1], "--steps-ahead", "1")
    streams = run_streams(ahead.stub, requests)
    assert [tokens_of(s.messages) for s in streams] == expected
    for stream, request in zip(streams, requests, strict=True):
        counted = [len(m.token_ids) for m in stream.messages if m.token_ids]
        assert counted == [1] * request.sampling_params.max_tokens
    assert ahead.worker(pool.targets[0]).num_finished >= len(requests)
