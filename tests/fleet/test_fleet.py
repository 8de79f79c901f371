"""The fleet scheduler end to end, its surface: grpcurl, `generate`, stop strings, streaming.

Every worker is a `mlx-worker serve --auto-init` subprocess on the tiny random llama
(built with a 2,048-token context so a 512-token prefix fits) and the fleet is a
`mlx-worker fleet` subprocess, driven over loopback with the generated FleetService
stub, as an operator would drive it. A session-wide pool of three workers (conftest.py)
is shared by the tests; a test that kills a worker leaves it dead and the next one
starts it again on the same port. Every process is reaped, even when a test fails.
Routing and admission are in test_fleet_routing.py, failover in test_fleet_failover.py.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from driver import reference_tokens, wait_until_idle
from grpc_health.v1 import health_pb2, health_pb2_grpc
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
    text_of,
    token_request,
    tokens_of,
)

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc


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
    ended = sum(w.num_finished for w in fleet.status().workers)
    messages = fleet.generate(token_request(prompt, 32, stop=["\x00absent", stop]))
    assert sum(w.num_finished for w in fleet.status().workers) == ended + 1  # its worker's
    *head, last = messages
    assert last.finish_reason == pb.FINISH_REASON_STOP_STRING
    assert last.stop_string == stop
    assert unstopped[-1].stop_string == ""
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in head)
    assert text_of(messages) == full[:start]
    tokens = tokens_of(messages)
    assert 0 < len(tokens) < 32 and tokens == all_tokens[: len(tokens)]
    assert (last.prompt_tokens, last.completion_tokens) == (len(prompt), len(tokens))
    # What a worker would refuse, the fleet refuses first, naming the field; each refusal
    # counts as an end of the fleet's only model.
    # Refused before it is admitted: never logged as admitted (nor its prompt tokens
    # counted), its end logged under its id, or one the fleet gives it.
    [model] = fleet.status().models
    cases: list[tuple[dict[str, Any], str]] = [
        ({"stop": ["x", ""]}, "sampling_params.stop[1] is empty"),
        ({"max_tokens": 0}, "sampling_params.max_tokens must be >= 1 when set, got 0"),
        ({"temperature": -1.0}, "sampling_params.temperature must be >= 0, got -1.0"),
        (
            {"structured_outputs": pb.StructuredOutputs(regex="[a-z]+")},
            "sampling_params.ignore_eos cannot be combined with structured_outputs",
        ),
    ]
    for i, (sampling, named) in enumerate(cases):
        bad = token_request(prompt, 32)
        bad.request_id = f"refused-{i}" if i else ""
        bad.sampling_params.MergeFrom(pb.SamplingParams(**sampling))
        if "max_tokens" in sampling:
            bad.sampling_params.max_tokens = 0
        with pytest.raises(grpc.RpcError) as refused:
            fleet.generate(bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(refused.value.details()).startswith(named)
    [after] = fleet.status().models
    assert after.num_finished == model.num_finished + len(cases)
    failed = fleet.proc.wait_for(r"request failed.*req_id=refused-3")
    lines = fleet.proc.output.splitlines()
    assert not [line for line in lines if "request admitted" in line and "refused-" in line]
    first = next(line for line in lines if "request failed" in line and "stop[1]" in line)
    assert re.search(r"req_id=[0-9a-f]{32}\b", first), first
    assert failed


def _digits(max_tokens: int) -> pb.SamplingParams:
    """A long constrained output (one token a character): 150 digits, each with a comma.

    Long enough that no stream ends in the time between the first and the last of
    the streams' first tokens (a worker's cold grammar compile can make that wait).
    """
    return pb.SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=pb.StructuredOutputs(regex="([0-9],){150}"),
    )


def test_a_structured_output_spec_passes_through_and_survives_failover(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    count, max_tokens = 6, 340
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
    # The worker running the most of them (routing may leave one without any).
    status = by_target(fleet.status())
    index = max(range(len(pool.targets)), key=lambda i: status[pool.targets[i]].num_running)
    victim = pool.targets[index]
    before = status[victim]
    assert before.num_running > 0, before
    pool.kill(index)
    unfinished = sum(s.finish_reason == pb.FINISH_REASON_UNSPECIFIED for s in streams)
    for stream in streams:
        stream.join(timeout=STREAM_TIMEOUT + 30)
        assert not stream.is_alive(), "a Generate stream never ended"
    assert unfinished == count, "streams finished before the kill: lengthen the regex"
    for stream, want in zip(streams, expected, strict=True):
        assert stream.error is None, stream.error
        assert stream.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE
        assert stream.tokens == want
        assert re.fullmatch("([0-9],){150}", text_of(stream.messages))
    assert by_target(fleet.status())[victim].num_failed_over == before.num_running


def test_a_spec_past_the_workers_grammar_limits_fails_only_its_request(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    """A spec that reaches a limit of the worker's grammar engine on a token fails its
    own request with INVALID_ARGUMENT naming the field, whether it was new in the step
    (a short prompt) or had run a step before (a prompt prefilled in two chunks); a
    request beside them keeps its tokens, and the worker ends idle."""
    fleet = start_fleet(pool.targets[:1])
    short, long, plain = distinct_prompts(2, 8, seed=41) + distinct_prompts(1, 700, seed=42)
    plain_request = token_request(plain, 24)
    alone = tokens_of(fleet.generate(plain_request))
    choices = pb.StructuredChoice(choices=[f"city{i}" for i in range(2001)])
    past = pb.SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=pb.StructuredOutputs(choice=choices)
    )
    requests = [
        pb.GenerateRequest(prompt_token_ids=prompt, sampling_params=past)
        for prompt in (short, long)
    ]
    streams = run_streams(fleet.stub, [plain_request, *requests])
    assert streams[0].error is None and streams[0].tokens == alone
    for stream in streams[1:]:
        assert stream.error is not None and not stream.tokens
        assert stream.error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(stream.error.details()).startswith(
            "sampling_params.structured_outputs.choice: the grammar engine (llguidance) "
            "reached one of its limits on this spec: Parser Error: Current row has 2002 items"
        )
    with grpc.insecure_channel(pool.targets[0]) as channel:
        worker = pb_grpc.WorkerServiceStub(channel)
        assert wait_until_idle(worker, 30).num_running_requests == 0


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


def test_requests_sharing_a_request_id_run_as_two(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    """GenerateRequest.request_id is the caller's, for logs: two live requests may share
    one (on one worker), and each gets its own tokens, as alone; the worker ends idle."""
    fleet = start_fleet(pool.targets[:1])
    prompts = distinct_prompts(2, 9, seed=31)
    alone = [tokens_of(fleet.generate(token_request(p, 40))) for p in prompts]
    shared = [token_request(p, 40) for p in prompts]
    for request in shared:
        request.request_id = "dup"
    streams = run_streams(fleet.stub, shared)
    assert [s.error for s in streams] == [None, None]
    assert [s.tokens for s in streams] == alone
    assert all(m.request_id == "dup" for s in streams for m in s.messages)
    with grpc.insecure_channel(pool.targets[0]) as channel:
        worker = pb_grpc.WorkerServiceStub(channel)
        assert wait_until_idle(worker, 30).num_running_requests == 0


def test_a_prompt_text_past_a_workers_message_limit_is_the_clients_error(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    """Text larger than a worker tokenizes in one message is INVALID_ARGUMENT naming the
    prompt, not the worker's transport error on the fleet's Tokenize call; for chat
    messages from half of it, whose rendered text comes back with the tokens (the
    worker's Tokenize could not send its answer)."""
    fleet = start_fleet(pool.targets[:1])
    with grpc.insecure_channel(pool.targets[0]) as channel:
        info = pb_grpc.WorkerServiceStub(channel).GetInfo(pb.GetInfoRequest())
    limit = info.limits.max_message_bytes
    huge = pb.GenerateRequest(prompt="a " * (limit // 2 + 8))
    huge.sampling_params.max_tokens = 1
    chat = "a " * (limit // 4 + 8)  # past half the limit: the reply would not fit
    for request, bound in (
        (huge, limit),
        (pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=chat)]), limit // 2),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            fleet.generate(request)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        field = "messages" if request.messages else "prompt"
        assert f"{field}: " in str(refused.value.details())
        assert f"tokenizes in one message ({bound} bytes" in str(refused.value.details())


def _described(prompt: list[int], size: int) -> pb.GenerateRequest:
    """A greedy request with a JSON schema spec of about `size` bytes (most of them its
    description, which the grammar ignores)."""
    schema = '{"type": "integer", "description": "%s"}' % ("x" * size)
    spec = pb.StructuredOutputs(json_schema=schema)
    params = pb.SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=spec)
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)


def test_a_request_past_a_workers_message_limit_is_refused_and_steps_stay_under_it(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    """A structured-output spec (any part) making a request larger than a worker takes in
    one message is INVALID_ARGUMENT naming it; requests that fit alone but not together
    start in separate steps, each answering as it does alone (the step that carried them
    all would break the worker's stream, over and over)."""
    fleet = start_fleet(pool.targets[:1])
    with grpc.insecure_channel(pool.targets[0]) as channel:
        info = pb_grpc.WorkerServiceStub(channel).GetInfo(pb.GetInfoRequest())
    limit = info.limits.max_message_bytes
    [prompt] = distinct_prompts(1, 8, seed=43)
    huge = _described(prompt, limit)
    with pytest.raises(grpc.RpcError) as refused:
        fleet.generate(huge)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(refused.value.details()).startswith("sampling_params.structured_outputs: ")
    assert f"in one message ({limit} bytes" in str(refused.value.details())
    named = _described(prompt, 16)
    named.request_id = "r" * (limit // 2 + 64)  # a step carries it twice
    with pytest.raises(grpc.RpcError) as refused:
        fleet.generate(named)
    assert str(refused.value.details()).startswith("request_id: the request takes ")
    big = _described(prompt, limit * 2 // 5)
    alone = tokens_of(fleet.generate(big))
    streams = run_streams(fleet.stub, [big] * 3)
    assert [(s.error, s.tokens) for s in streams] == [(None, alone)] * 3
    status = fleet.worker(pool.targets[0])
    assert (status.num_failed_over, status.last_error) == (0, "")


@pytest.mark.parametrize("grace", [30, 0])
def test_sigterm_drains_the_fleet_for_its_grace_seconds(
    pool: WorkerPool, start_fleet: Callable[..., Fleet], grace: int
) -> None:
    """On SIGTERM the fleet takes no new request (UNAVAILABLE) and its health turns
    NOT_SERVING; requests in flight finish within --grace-seconds, and those still
    running past it end ABORTED, counted as aborted, not as the caller's cancels."""
    fleet = start_fleet(pool.targets[:1], "--grace-seconds", str(grace))
    prompts = distinct_prompts(3, 8, seed=41)
    streams = [Stream(fleet.stub, token_request(p, 480)) for p in prompts]  # to the context
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_token.wait(STREAM_TIMEOUT)
    # A probe's open Watch on each health name: NOT_SERVING, then its end (OK).
    watcher = health_pb2_grpc.HealthStub(fleet.channel)
    names = ("", "mlx_worker.v1.FleetService")
    deadline = time.monotonic() + 5  # the service turns SERVING within its quarter-second poll
    serving = health_pb2.HealthCheckResponse.SERVING
    while any(
        watcher.Check(health_pb2.HealthCheckRequest(service=n)).status != serving for n in names
    ):
        assert time.monotonic() < deadline, "the fleet never turned SERVING"
        time.sleep(0.05)
    watches = [watcher.Watch(health_pb2.HealthCheckRequest(service=n), timeout=120) for n in names]
    for watch in watches:
        assert next(watch).status == serving
    fleet.proc.proc.send_signal(signal.SIGTERM)
    if grace:  # a new request is refused while the three finish
        with pytest.raises(grpc.RpcError) as refused:
            fleet.generate(token_request(prompts[0], 4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the fleet is shutting down" in str(refused.value.details())
        health = health_pb2_grpc.HealthStub(fleet.channel)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", "mlx_worker.v1.FleetService"):  # within its quarter-second poll
            deadline = time.monotonic() + 5
            while (
                health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
                != not_serving
            ):
                assert time.monotonic() < deadline, f"{service!r} still SERVING while draining"
                time.sleep(0.05)
    for stream in streams:
        stream.join(STREAM_TIMEOUT)
    if grace:
        assert [(s.error, len(s.tokens)) for s in streams] == [(None, 480)] * 3
    else:
        for stream in streams:
            assert stream.error is not None and stream.error.code() == grpc.StatusCode.ABORTED
            assert "the fleet shut down before the request finished" in str(stream.error.details())
    assert fleet.proc.proc.wait(timeout=60) == 0
    for watch in watches:  # an UNAVAILABLE end ("Cancelling all calls") would raise here
        assert [m.status for m in watch][-1:] == [health_pb2.HealthCheckResponse.NOT_SERVING]
        assert watch.code() == grpc.StatusCode.OK
    # Each request's end line says what ended it (operations.md's log lines).
    ends = [line for line in fleet.proc.lines if "outcome=" in line and "unavailable" not in line]
    event = "request finished" if grace else "request aborted"
    assert len(ends) == 3 and all(event in line for line in ends), ends
    assert "outcome=cancelled" not in fleet.proc.output
    with grpc.insecure_channel(pool.targets[0]) as channel:  # nothing left on the worker
        assert wait_until_idle(pb_grpc.WorkerServiceStub(channel), 30).num_running_requests == 0
