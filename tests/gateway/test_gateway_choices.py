"""`n` choices through the gateway: each the answer its own request would get.

As vLLM's parallel sampling: choice i of a seeded request is the request with
`seed + i` and n = 1, streamed or not; the usage counts the prompt once and
every choice's tokens; a refused choice refuses the request (a full queue's
429 says when to retry), and a client that leaves frees every choice on the
worker.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

import openai
import pytest
from driver import ServeProcess
from gateway_process import Gateway, chat, complete
from starlette.requests import Request

from mlx_worker_svc.gateway import app
from mlx_worker_svc.gateway.errors import ApiError
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

SAMPLED = {"temperature": 1.0, "max_tokens": 8}


def test_choices_are_the_requests_with_seed_plus_their_index(
    client: openai.OpenAI, gateway: Gateway
) -> None:
    ttft = 'mlx_gateway_time_to_first_token_seconds_count{route="/v1/chat/completions"}'
    counters = [
        ttft,
        *(f'mlx_gateway_tokens_total{{kind="{k}"}}' for k in ("prompt", "completion")),
    ]
    before = [gateway.metric(line) for line in counters]
    both = chat(client, n=3, seed=7, **SAMPLED)
    assert both.usage is not None
    # One answer: its first token once, its tokens as its usage counts them.
    added = [gateway.metric(line) - was for line, was in zip(counters, before, strict=True)]
    assert added == [1, both.usage.prompt_tokens, both.usage.completion_tokens]
    assert [c.index for c in both.choices] == [0, 1, 2]
    texts = [c.message.content for c in both.choices]
    alone = [chat(client, seed=7 + i, **SAMPLED) for i in range(3)]
    assert texts == [a.choices[0].message.content for a in alone]
    assert len(set(texts)) > 1  # the seeds differ, and so do the random model's answers
    assert all(c.finish_reason == "length" for c in both.choices)
    assert both.usage is not None and alone[0].usage is not None
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens  # the prompt once
    assert both.usage.completion_tokens == 3 * 8
    assert both.usage.total_tokens == both.usage.prompt_tokens + 3 * 8
    again = chat(client, n=3, seed=7, **SAMPLED)
    assert [c.message.content for c in again.choices] == texts


def test_a_stream_interleaves_the_choices_each_with_its_index(client: openai.OpenAI) -> None:
    whole = chat(client, n=2, seed=3, **SAMPLED)
    stream = chat(
        client, n=2, seed=3, stream=True, stream_options={"include_usage": True}, **SAMPLED
    )
    text: dict[int, str] = defaultdict(str)
    roles: dict[int, int] = defaultdict(int)
    finish: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert dict(text) == {c.index: c.message.content for c in whole.choices}
    assert dict(roles) == {0: 1, 1: 1} and finish == {0: "length", 1: "length"}
    assert usage is not None and whole.usage is not None
    assert usage.model_dump() == whole.usage.model_dump()


def test_legacy_completions_take_n_and_best_of_equal_to_it(client: openai.OpenAI) -> None:
    both = complete(client, n=2, best_of=2, seed=11, **SAMPLED)
    alone = [complete(client, seed=11 + i, **SAMPLED).choices[0].text for i in range(2)]
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == alone
    assert both.usage is not None and both.usage.completion_tokens == 16


@pytest.mark.parametrize(
    ("route", "options", "param"),
    [
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"n": 129}, "n"),
        ("/v1/chat/completions", {"n": "2"}, "n"),
        ("/v1/completions", {"n": 2, "best_of": 1}, "best_of"),
        ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
    ],
)
def test_a_bad_n_or_best_of_is_a_400_naming_it(
    gateway: Gateway, route: str, options: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": "model", "max_tokens": 4}
    if route == "/v1/completions":
        body["prompt"] = "Once upon a time"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    response = gateway.http.post(route, json=body | options)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_more_choices_than_the_queue_holds_is_a_400_naming_n(worker: ServeProcess) -> None:
    small = Gateway(worker.port, "--queue", "2")
    try:
        body = {"model": "model", "messages": [{"role": "user", "content": "hi"}], "n": 3}
        refused = small.http.post("/v1/chat/completions", json=body | {"max_tokens": 2})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "n"
        assert "more than the fleet's queue holds (2" in refused.json()["error"]["message"]
        done = small.http.post("/v1/chat/completions", json=body | {"n": 2, "max_tokens": 2})
        assert done.status_code == 200 and len(done.json()["choices"]) == 2
    finally:
        small.close()


def _running(worker: ServeProcess) -> int:
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    return stub.CheckHealth(pb.CheckHealthRequest(), timeout=30).num_running_requests


def test_every_choice_is_refused_or_freed_together(gateway: Gateway, worker: ServeProcess) -> None:
    info = pb_grpc.WorkerServiceStub(worker.channel()).GetInfo(pb.GetInfoRequest(), timeout=30)
    past = {"prompt": [5] * info.model.max_context_length, "max_tokens": 4, "n": 3}
    refused = gateway.http.post("/v1/completions", json={"model": "model"} | past)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == (
        "context_length_exceeded"
    )
    body = {
        "model": "model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": info.model.max_context_length - 64,
        "ignore_eos": True,
        "n": 3,
        "stream": True,
    }
    with gateway.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk: every choice is running
        assert _running(worker) == 3
    deadline = time.monotonic() + 30
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(worker) == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_429_says_when_to_retry(path: str) -> None:
    # A full queue is a 429 on both APIs (errors.py); the SDKs wait for Retry-After.
    request = Request({"type": "http", "method": "POST", "path": path, "headers": []})
    full = ApiError(429, "the fleet's queue is full", kind="rate_limit_error")
    answer = asyncio.run(app._api_error_response(request, full))
    assert (answer.status_code, answer.headers["retry-after"]) == (429, "1")
    bad = asyncio.run(app._api_error_response(request, ApiError(400, "no")))
    assert "retry-after" not in bad.headers
