"""Malformed input gets INVALID_ARGUMENT / NOT_FOUND naming the field; nothing changes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from driver import code_of, details_of, drive, greedy

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
STALE = grpc.StatusCode.FAILED_PRECONDITION


def _new(req_id: str = "x", prompt: list[int] | None = None, **params: Any) -> pb.NewRequest:
    fields: dict[str, Any] = {"temperature": 0.0, "max_tokens": 4, **params}
    sampling = pb.SamplingParams(**fields)
    return pb.NewRequest(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3] if prompt is None else prompt,
        sampling_params=sampling,
    )


def _exec(**fields: Any) -> Callable[[int], pb.ExecuteRequest]:
    def build(epoch: int) -> pb.ExecuteRequest:
        values = dict(fields)
        values.setdefault("worker_epoch", epoch)
        return pb.ExecuteRequest(**values)

    return build


# (case id, request builder, expected code, words the message must contain)
EXECUTE_CASES = [
    (
        "empty prompt",
        _exec(new_requests=[_new(prompt=[])], num_scheduled_tokens={"x": 1}),
        INVALID,
        ["prompt_token_ids", "empty"],
    ),
    (
        "out of vocabulary",
        _exec(new_requests=[_new(prompt=[1, 49152])], num_scheduled_tokens={"x": 2}),
        INVALID,
        ["prompt_token_ids[1]", "vocabulary"],
    ),
    (
        "empty req_id",
        _exec(new_requests=[_new(req_id="")], num_scheduled_tokens={"": 3}),
        INVALID,
        ["empty req_id"],
    ),
    (
        "duplicate new req_id",
        _exec(new_requests=[_new(), _new()], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["'x' twice"],
    ),
    (
        "unknown cached req_id",
        _exec(
            cached_requests=[pb.CachedRequest(req_id="ghost")], num_scheduled_tokens={"ghost": 1}
        ),
        NOT_FOUND,
        ["ghost"],
    ),
    (
        "unknown finished req_id",
        _exec(finished_req_ids=["ghost"]),
        NOT_FOUND,
        ["finished_req_ids", "ghost"],
    ),
    (
        "unknown preempted req_id",
        _exec(preempted_req_ids=["ghost"]),
        NOT_FOUND,
        ["preempted_req_ids", "ghost"],
    ),
    (
        "scheduled but not sent",
        _exec(num_scheduled_tokens={"nobody": 1}),
        INVALID,
        ["num_scheduled_tokens['nobody']"],
    ),
    (
        "zero scheduled tokens",
        _exec(new_requests=[_new()], num_scheduled_tokens={"x": 0}),
        INVALID,
        ["num_scheduled_tokens['x']", ">= 1"],
    ),
    (
        "too many scheduled tokens",
        _exec(new_requests=[_new()], num_scheduled_tokens={"x": 4}),
        INVALID,
        ["num_scheduled_tokens['x']", "uncomputed"],
    ),
    (
        "NaN temperature",
        _exec(new_requests=[_new(temperature=math.nan)], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["sampling_params.temperature", "finite"],
    ),
    (
        "negative temperature",
        _exec(new_requests=[_new(temperature=-1.0)], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["temperature", ">= 0"],
    ),
    (
        "top_p zero",
        _exec(new_requests=[_new(top_p=0.0)], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["top_p"],
    ),
    (
        "negative top_k",
        _exec(new_requests=[_new(top_k=-5)], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["top_k"],
    ),
    (
        "min_p above one",
        _exec(new_requests=[_new(min_p=1.5)], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["min_p"],
    ),
    (
        "infinite penalty",
        _exec(new_requests=[_new(presence_penalty=math.inf)], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["presence_penalty"],
    ),
    (
        "zero repetition penalty",
        _exec(new_requests=[_new(repetition_penalty=0.0)], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["repetition_penalty"],
    ),
    (
        "stop id out of vocabulary",
        _exec(new_requests=[_new(stop_token_ids=[10**6])], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["stop_token_ids[0]"],
    ),
    (
        "logit_bias NaN",
        _exec(new_requests=[_new(logit_bias={5: math.nan})], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["logit_bias[5]"],
    ),
    (
        "too many logprobs",
        _exec(new_requests=[_new(logprobs=21)], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["logprobs"],
    ),
    (
        "min_tokens above max",
        _exec(new_requests=[_new(min_tokens=9)], num_scheduled_tokens={"x": 3}),
        INVALID,
        ["min_tokens"],
    ),
    (
        "prompt over the context",
        _exec(new_requests=[_new(prompt=[1] * 512)], num_scheduled_tokens={"x": 512}),
        INVALID,
        ["context length"],
    ),
    ("stale epoch", _exec(worker_epoch=1), STALE, ["worker_epoch", "stale"]),
]


@pytest.mark.parametrize(
    ("build", "code", "words"),
    [pytest.param(b, c, w, id=i) for i, b, c, w in EXECUTE_CASES],
)
def test_bad_execute_steps_are_rejected_and_change_nothing(
    tiny_stub: Stub,
    build: Callable[[int], pb.ExecuteRequest],
    code: grpc.StatusCode,
    words: list[str],
) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    # A request that is running when the bad step arrives must be untouched by it.
    drive_first = tiny_stub.Execute(
        pb.ExecuteRequest(
            step_id=0,
            worker_epoch=epoch,
            new_requests=[_new("keep", [5, 6, 7])],
            num_scheduled_tokens={"keep": 3},
        )
    )
    kept = list(drive_first.outputs[0].sampled_token_ids)
    with pytest.raises(grpc.RpcError) as info:
        tiny_stub.Execute(build(epoch))
    err = info.value
    assert code_of(err) == code, details_of(err)
    for word in words:
        assert word in details_of(err), details_of(err)
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_running_requests == 1 and health.healthy
    nxt = tiny_stub.Execute(
        pb.ExecuteRequest(
            step_id=1,
            worker_epoch=epoch,
            cached_requests=[pb.CachedRequest(req_id="keep", num_computed_tokens=3)],
            num_scheduled_tokens={"keep": 1},
        )
    )
    assert len(nxt.outputs[0].sampled_token_ids) == 1 and len(kept) == 1


def test_one_bad_request_among_good_ones_changes_nothing(tiny_stub: Stub) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    clean = drive(tiny_stub, epoch, [[1, 2, 3], [4, 5]], max_tokens=6)
    bad = pb.ExecuteRequest(
        step_id=1,
        worker_epoch=epoch,
        new_requests=[_new("good", [1, 2, 3]), _new("bad", [4, 99999]), _new("good2", [4, 5])],
        num_scheduled_tokens={"good": 3, "bad": 2, "good2": 2},
    )
    with pytest.raises(grpc.RpcError) as info:
        tiny_stub.Execute(bad)
    assert "new_requests[1] (req_id 'bad')" in details_of(info.value)
    assert tiny_stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 0
    assert drive(tiny_stub, epoch, [[1, 2, 3], [4, 5]], max_tokens=6) == clean


def test_cached_request_with_a_wrong_count_is_rejected(tiny_stub: Stub) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    tiny_stub.Execute(
        pb.ExecuteRequest(
            worker_epoch=epoch, new_requests=[_new("a")], num_scheduled_tokens={"a": 3}
        )
    )
    with pytest.raises(grpc.RpcError) as info:
        tiny_stub.Execute(
            pb.ExecuteRequest(
                worker_epoch=epoch,
                cached_requests=[pb.CachedRequest(req_id="a", num_computed_tokens=2)],
                num_scheduled_tokens={"a": 1},
            )
        )
    assert code_of(info.value) == INVALID
    assert "num_computed_tokens is 2" in details_of(info.value)
    with pytest.raises(grpc.RpcError) as info:
        tiny_stub.Execute(
            pb.ExecuteRequest(
                worker_epoch=epoch, new_requests=[_new("a")], num_scheduled_tokens={"a": 3}
            )
        )
    assert "already running" in details_of(info.value)


@pytest.mark.parametrize(
    ("rpc", "message", "code", "word"),
    [
        ("Detokenize", pb.DetokenizeRequest(token_ids=[49152]), INVALID, "token_ids[0]"),
        (
            "Tokenize",
            pb.TokenizeRequest(text="a", messages=[pb.ChatMessage(role="user", content="b")]),
            INVALID,
            "not both",
        ),
        (
            "Tokenize",
            pb.TokenizeRequest(messages=[pb.ChatMessage(role="robot", content="b")]),
            INVALID,
            "messages[0].role",
        ),
        ("InitCache", pb.InitCacheRequest(num_blocks=0), INVALID, "num_blocks"),
        (
            "DetermineMemory",
            pb.DetermineMemoryRequest(memory_utilization=1.5),
            INVALID,
            "memory_utilization",
        ),
        (
            "DetermineMemory",
            pb.DetermineMemoryRequest(max_num_batched_tokens=100000),
            INVALID,
            "max_num_batched_tokens",
        ),
        ("WarmUp", pb.WarmUpRequest(batch_sizes=[0]), INVALID, "batch_sizes must all be >= 1"),
        ("WarmUp", pb.WarmUpRequest(prefill_lengths=[4, 0]), INVALID, "prefill_lengths must"),
        ("WarmUp", pb.WarmUpRequest(batch_sizes=[1025]), INVALID, "batch_sizes: 1025 is past"),
        (
            "WarmUp",
            pb.WarmUpRequest(prefill_lengths=[4] * 64),
            INVALID,
            "batch_sizes (1) and prefill_lengths (64) give 65 shapes; at most 64",
        ),
        ("WarmUp", pb.WarmUpRequest(prefill_lengths=[4096]), INVALID, "exceed the context (512"),
        ("InitDevice", pb.InitDeviceRequest(device=7), INVALID, "DeviceKind"),  # type: ignore[arg-type]
    ],
)
def test_other_rpcs_reject_malformed_input(
    tiny_stub: Stub, rpc: str, message: Any, code: grpc.StatusCode, word: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        getattr(tiny_stub, rpc)(message)
    assert code_of(info.value) == code and word in details_of(info.value)
    assert tiny_stub.CheckHealth(pb.CheckHealthRequest()).healthy


@pytest.mark.parametrize(
    ("request_message", "word"),
    [
        (pb.GenerateRequest(), "exactly one"),
        (pb.GenerateRequest(prompt="a", prompt_token_ids=[1]), "exactly one"),
        (
            pb.GenerateRequest(prompt_token_ids=[1, 49152]),
            "prompt_token_ids[1] = 49152 is out of the vocabulary",
        ),
        (pb.GenerateRequest(prompt_token_ids=[1] * 600), "prompt_token_ids has 600 tokens"),
        (pb.GenerateRequest(prompt="hi " * 600), "prompt has "),
        (
            pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi " * 600)]),
            "messages (the prompt they render) has ",
        ),
        (
            pb.GenerateRequest(
                prompt="hi", sampling_params=pb.SamplingParams(temperature=math.nan)
            ),
            "temperature",
        ),
        (pb.GenerateRequest(prompt="hi", sampling_params=greedy(0)), "max_tokens"),
        (pb.GenerateRequest(prompt="hi", sampling_params=greedy(2, prompt_logprobs=1)), "Execute"),
    ],
)
def test_generate_rejects_malformed_input(
    tiny_stub: Stub, request_message: pb.GenerateRequest, word: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stub.Generate(request_message))
    assert code_of(info.value) == INVALID and word in details_of(info.value)
    assert tiny_stub.CheckHealth(pb.CheckHealthRequest()).healthy


def test_stop_strings_are_unimplemented_in_the_worker(tiny_stub: Stub) -> None:
    """Stop strings need the text: the fleet scheduler honours them, a worker refuses."""
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    stop = greedy(4, stop=["."])
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stub.Generate(pb.GenerateRequest(prompt="hi", sampling_params=stop)))
    assert code_of(info.value) == grpc.StatusCode.UNIMPLEMENTED
    assert "sampling_params.stop" in details_of(info.value)
    step = pb.ExecuteRequest(
        step_id=1,
        worker_epoch=epoch,
        new_requests=[pb.NewRequest(req_id="s", prompt_token_ids=[5, 6], sampling_params=stop)],
        num_scheduled_tokens={"s": 2},
    )
    with pytest.raises(grpc.RpcError) as info:
        tiny_stub.Execute(step)
    assert code_of(info.value) == grpc.StatusCode.UNIMPLEMENTED
    assert "new_requests[0]" in details_of(info.value) and ".stop" in details_of(info.value)
