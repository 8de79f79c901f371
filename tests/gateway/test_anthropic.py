"""Anthropic's Messages API through the gateway, driven by the official `anthropic` package.

A `mlx-worker serve` process on the tiny random llama with the tool-rendering
chat template (`TOOL_TEMPLATE`) sits behind a `mlx-worker gateway` process with
an API key. The gateway's OpenAI chat route is the reference for the text: the
same greedy chat gives the same answer on both APIs. Forced tool calls show the
constraint as the OpenAI tests do: the `tool_use` input validates against the
tool's `input_schema` (`jsonschema`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import jsonschema
import pytest
from driver import ServeProcess, wait_until_idle
from gateway_process import KEY, Gateway

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

MODEL = "model"  # the worker's model directory name
ASK: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "A forecast", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": ZONE},
]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}


@pytest.fixture(scope="module")
def worker(tiny_tools_dir: Path) -> Iterator[ServeProcess]:
    proc = ServeProcess(tiny_tools_dir, 1.0)
    yield proc
    proc.reap()


@pytest.fixture(scope="module")
def gateway(worker: ServeProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY}\n")
    gw = Gateway(worker.port, "--api-key-file", str(keys))
    yield gw
    gw.close()


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def _request(options: dict[str, Any]) -> dict[str, Any]:
    """A greedy request of ASK; `temperature` (which this SDK no longer types) in the body."""
    extra = {"temperature": 0} | options.pop("extra_body", {})
    request = {"model": MODEL, "messages": ASK, "max_tokens": 24}
    return request | options | {"extra_body": extra}


def create(client: anthropic.Anthropic, **options: Any) -> Any:
    return client.messages.create(**_request(options))


def streamed(client: anthropic.Anthropic, **options: Any) -> tuple[str, Any]:
    """(the text deltas joined, the final message) of one streamed request."""
    with client.messages.stream(**_request(options)) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def events(gateway: Gateway, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (event, data) pairs of one raw streamed request."""
    out = []
    headers = {"x-api-key": KEY}
    with gateway.http.stream("POST", "/v1/messages", json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        name = ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                out.append((name, data))
    return out


# ---------------------------------------------------------------- text
def test_a_message_is_the_chat_routes_greedy_answer_streamed_or_not(
    gateway: Gateway, client: anthropic.Anthropic
) -> None:
    chat = gateway.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0},
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()
    expected = chat["choices"][0]["message"]["content"]
    whole = create(client)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text == expected and expected
    assert (
        whole.stop_reason
        == {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    )
    assert whole.stop_sequence is None
    usage = whole.usage
    assert usage.output_tokens == chat["usage"]["completion_tokens"]
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]

    text, final = streamed(client)
    assert text == expected
    assert final.content[0].text == expected and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == usage.output_tokens
    assert (
        final.usage.input_tokens + final.usage.cache_read_input_tokens
        == (chat["usage"]["prompt_tokens"])
    )


def test_the_stream_is_anthropics_event_sequence(gateway: Gateway) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0, "stream": True}
    sent = events(gateway, body)
    names = [name for name, _ in sent]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = sent[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] > 0
    assert sent[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for _, d in sent[3:-3])
    delta = sent[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 8


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_answer_and_is_named(
    client: anthropic.Anthropic, stream: bool
) -> None:
    full = create(client, max_tokens=32).content[0].text
    start = next(
        i
        for i in range(len(full) // 3, len(full) - 3)
        if full.find(full[i : i + 3]) == i and full[i : i + 3].strip()
    )
    stop = full[start : start + 3]
    options = {"max_tokens": 32, "stop_sequences": ["\x00absent", stop]}
    if stream:
        text, message = streamed(client, **options)
        assert text == full[:start]
    else:
        message = create(client, **options)
    assert message.content[0].text == full[:start]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_a_client_disconnect_mid_stream_frees_the_workers_kv(
    gateway: Gateway, worker: ServeProcess, client: anthropic.Anthropic
) -> None:
    route = 'mlx_gateway_client_disconnects_total{route="/v1/messages"}'
    before = gateway.metric(route)
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    with client.messages.stream(**_request({"max_tokens": 400})) as stream:
        texts = iter(stream.text_stream)
        for _ in range(3):
            assert next(texts)
        health = stub.CheckHealth(pb.CheckHealthRequest(), timeout=30)
        assert health.num_running_requests == 1 and health.kv.used_blocks > 0, health
    wait_until_idle(stub, timeout=10)
    assert gateway.metric(route) == before + 1


# ---------------------------------------------------------- errors, keys
def test_errors_come_in_anthropics_shape(gateway: Gateway, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(client, extra_body={"temperature": 1.5})
    assert bad.value.status_code == 400
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "temperature" in bad.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="frequency_penalty"):
        create(client, extra_body={"frequency_penalty": 1})
    with pytest.raises(anthropic.NotFoundError) as missing:
        create(client, model="claude-sonnet-4-5")
    assert missing.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "The model `claude-sonnet-4-5` does not exist.",
        },
    }
    # The SDK's other calls (it sends anthropic-version) get Anthropic's shape too.
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.models.retrieve("claude-sonnet-4-5")
    assert unknown.value.body == missing.value.body
    openai_shape = gateway.http.get("/v1/models/x", headers={"authorization": f"Bearer {KEY}"})
    assert openai_shape.json()["error"]["code"] == "model_not_found"
    with anthropic.Anthropic(base_url=gateway.url, api_key="wrong", max_retries=0) as other:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            create(other)
        with pytest.raises(anthropic.AuthenticationError) as listing:
            other.models.list()
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert listing.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # Raw: a missing max_tokens, a missing key, a broken body, a route of the wrong method.
    body = {"model": MODEL, "messages": ASK}
    raw = gateway.http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert raw.status_code == 400 and "max_tokens" in raw.json()["error"]["message"]
    assert raw.json()["type"] == "error"
    raw = gateway.http.post("/v1/messages", json=body | {"max_tokens": 4})
    assert raw.status_code == 401
    assert raw.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in raw.json()["error"]["message"]
    raw = gateway.http.post("/v1/messages", content=b"{", headers={"x-api-key": KEY})
    assert (raw.status_code, raw.json()["error"]["type"]) == (400, "invalid_request_error")
    raw = gateway.http.get("/v1/messages", headers={"x-api-key": KEY})
    assert raw.status_code == 405 and raw.json()["type"] == "error"


@pytest.mark.parametrize(
    "headers",
    [{"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}],
    ids=["x-api-key", "bearer"],
)
def test_the_key_is_taken_from_x_api_key_or_a_bearer_token(
    gateway: Gateway, headers: dict[str, str]
) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2}
    assert gateway.http.post("/v1/messages", json=body, headers=headers).status_code == 200
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 2}
    assert gateway.http.post("/v1/chat/completions", json=chat, headers=headers).status_code == 200


# ---------------------------------------------------------- count_tokens
def test_count_tokens_counts_what_a_message_computes(
    worker: ServeProcess, client: anthropic.Anthropic
) -> None:
    system = "You are terse."
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system=system)
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    chat = [pb.ChatMessage(role="system", content=system), pb.ChatMessage(**ASK[0])]
    rendered = stub.Tokenize(pb.TokenizeRequest(messages=chat), timeout=30)
    assert counted.input_tokens == len(rendered.token_ids)
    usage = create(client, system=system, max_tokens=1).usage
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, system=system, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens
    prefill = [*ASK, {"role": "assistant", "content": "The sea is"}]
    continued = client.messages.count_tokens(model=MODEL, messages=prefill, system=system)
    assert continued.input_tokens > counted.input_tokens
    # The fields a message takes that change no prompt, as the SDK types them.
    labelled = client.messages.count_tokens(
        model=MODEL, messages=ASK, system=system, speed="fast", user_profile_id="u1",
        workspace_id="wrkspc_1",
    )  # fmt: skip
    assert labelled.input_tokens == counted.input_tokens


def test_fields_that_route_a_request_at_anthropic_are_checked_and_change_nothing(
    gateway: Gateway, client: anthropic.Anthropic
) -> None:
    plain = create(client, max_tokens=4)
    labelled = create(
        client, max_tokens=4, inference_geo="us", user_profile_id="u1", workspace_id="w1",
        diagnostics={"previous_message_id": None},
    )  # fmt: skip
    assert labelled.content == plain.content
    headers = {"x-api-key": KEY}
    for name, value in (
        ("inference_geo", 1),
        ("workspace_id", ["w"]),
        ("diagnostics", "msg_1"),
        ("diagnostics.previous_message_id", 7),
        ("diagnostics.bogus", 1),
    ):
        field, _, key = name.partition(".")
        body = {"model": MODEL, "messages": ASK, "max_tokens": 2}
        body[field] = {key: value} if key else value
        bad = gateway.http.post("/v1/messages", json=body, headers=headers)
        assert bad.status_code == 400 and name in bad.json()["error"]["message"], bad.json()


# ------------------------------------------------------------ tool use
def blocks(message: Any) -> list[tuple[Any, ...]]:
    """A message's content without the call ids: (type, text) or (type, name, input)."""
    return [
        (b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in message.content
    ]


@pytest.mark.parametrize("blank", [False, True])
def test_tools_reach_the_model_as_the_chat_routes_functions(
    gateway: Gateway, client: anthropic.Anthropic, blank: bool
) -> None:
    """The same tools on both routes render the same prompt: the greedy answers agree
    (an empty description is passed on as it is, on both)."""
    tools = [{**t, "description": ""} for t in TOOLS] if blank else TOOLS
    functions = [
        {"name": t["name"]}
        | ({"description": t["description"]} if "description" in t else {})
        | {"parameters": t["input_schema"]}
        for t in tools
    ]
    body = {"model": MODEL, "messages": ASK, "max_tokens": 24, "temperature": 0}
    body["tools"] = [{"type": "function", "function": f} for f in functions]
    chat = gateway.http.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ).json()
    answer = chat["choices"][0]["message"]
    message = create(client, tools=tools)
    text = "".join(b.text for b in message.content if b.type == "text")
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert text == (answer["content"] or "")
    expected = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in answer.get("tool_calls") or []
    ]
    assert calls == expected
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_returns_a_tool_use_whose_input_validates(
    client: anthropic.Anthropic, stream: bool
) -> None:
    def ask(**choice: Any) -> Any:
        options = {"tools": TOOLS, "tool_choice": {"type": "any", **choice}, "max_tokens": 120}
        return streamed(client, **options)[1] if stream else create(client, **options)

    one = ask(disable_parallel_tool_use=True)
    [use] = one.content
    assert use.type == "tool_use" and one.stop_reason == "tool_use"
    assert use.id.startswith("toolu_") and use.name in SCHEMAS
    jsonschema.validate(use.input, SCHEMAS[use.name])
    # With parallel calls the random model calls again and again: the complete calls are
    # tool_use blocks, the one max_tokens cut is left as text.
    many = ask()
    *uses, cut = blocks(many)
    assert len(uses) > 1 and many.stop_reason == "max_tokens"
    for kind, name, arguments in uses:
        assert kind == "tool_use"
        jsonschema.validate(arguments, SCHEMAS[name])
    assert cut[0] == "text" and cut[1].startswith("\n<tool_call>")
    other = create if stream else streamed
    again = other(client, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=120)
    assert blocks(again if stream else again[1]) == blocks(many)
    # A stop sequence as the next call begins: the calls before it stand, and the answer
    # is tool_use (as the OpenAI route's tool_calls), for the agent loop to run them.
    options = {"tools": TOOLS, "tool_choice": {"type": "any"}, "max_tokens": 120}
    options["stop_sequences"] = ["\n<tool"]
    stopped = streamed(client, **options)[1] if stream else create(client, **options)
    assert [kind for kind, *_ in blocks(stopped)] == ["tool_use"] * len(stopped.content)
    assert stopped.stop_reason == "tool_use" and stopped.stop_sequence is None


def test_a_named_tool_streams_as_input_json_deltas(gateway: Gateway) -> None:
    body = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
    }
    sent = events(gateway, body)
    names = [name for name, _ in sent]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    block = sent[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_time" and block["input"] == {}
    delta = sent[3][1]["delta"]
    assert delta["type"] == "input_json_delta"
    jsonschema.validate(json.loads(delta["partial_json"]), ZONE)
    assert sent[5][1]["delta"]["stop_reason"] == "tool_use"


def test_a_tool_result_goes_back_to_the_model(client: anthropic.Anthropic) -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "CET"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}
    history = [
        *ASK,
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    with_result = client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    alone = client.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS)
    assert with_result.input_tokens > alone.input_tokens
    message = create(client, messages=history, tools=TOOLS, tool_choice={"type": "none"})
    assert [b.type for b in message.content] == ["text"]
    # The same turns as the SDK's model_dump() gives them back: its optional fields as
    # nulls (caller, toolset_name, citations) are absent fields, and change nothing.
    dumped = [
        *ASK,
        {"role": "assistant", "content": [call | {"caller": None, "toolset_name": None}]},
        {"role": "user", "content": [result | {"toolset_name": None}]},
    ]
    again = create(client, messages=dumped, tools=TOOLS, tool_choice={"type": "none"})
    assert again.content[0].text == message.content[0].text
    text = {"type": "text", "text": "Tell me about the sea.", "citations": []}
    plain = create(client, messages=[{"role": "user", "content": [text]}])
    assert plain.content[0].text == create(client).content[0].text
    # Text blocks are joined with a newline (gateway.md), system's too.
    two = [{"type": "text", "text": "Tell me"}, {"type": "text", "text": "about the sea."}]
    joined = [{"role": "user", "content": "Tell me\nabout the sea."}]
    for options in ({"messages": [{"role": "user", "content": two}]}, {"system": two}):
        same = (
            {"messages": joined} if "messages" in options else {"system": "Tell me\nabout the sea."}
        )
        blocks, string = create(client, **options), create(client, **same)
        assert blocks.content == string.content
        prompts = [m.usage.input_tokens + m.usage.cache_read_input_tokens for m in (blocks, string)]
        assert prompts[0] == prompts[1]
    with pytest.raises(anthropic.BadRequestError, match="tool_use_id"):
        bad = {**result, "tool_use_id": "toolu_unknown"}
        create(client, messages=[*history[:2], {"role": "user", "content": [bad]}], tools=TOOLS)
    # As Anthropic's API: a tool_use is answered in the next message, and only there.
    unanswered = [*history[:2], {"role": "user", "content": "never mind"}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]': tool_use ids were"):
        create(client, messages=unanswered, tools=TOOLS)
    late = [
        *history,
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [result]},
    ]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[4\].content\[0\].tool_use_id"):
        create(client, messages=late, tools=TOOLS)


def test_tools_on_a_template_without_them_are_a_400_naming_tools(tiny_dir: Path) -> None:
    proc = ServeProcess(tiny_dir, 1.0)
    gw = Gateway(proc.port)
    try:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "tools": TOOLS}
        response = gw.http.post("/v1/messages", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith("Invalid value for 'tools'")
        # A history with calls the template would drop is refused too, on both APIs.
        use = {"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}
        history = [*ASK, {"role": "assistant", "content": [use]}]
        history.append({"role": "user", "content": [result]})
        body = {"model": MODEL, "messages": history, "max_tokens": 4}
        response = gw.http.post("/v1/messages", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith("Invalid value for 'messages'")
        call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
        chat = [
            {"role": "user", "content": "The time?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        ]
        body = {"model": MODEL, "messages": chat, "max_tokens": 4}
        response = gw.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "messages[1].tool_calls"
    finally:
        gw.close()
        proc.reap()


def test_refused_blocks_name_their_place(gateway: Gateway) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "user", "content": [image]}]}, "messages[0].content[0]"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        # A tool's input is an object (the forced call's grammar would write a string).
        (
            {"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
            "tools[0].input_schema.type",
        ),
        ({"metadata": {"user_id": "u", "tier": 1}}, "metadata.tier"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        # As Anthropic's API: no empty content but a final assistant's, no empty text block,
        # no whitespace at the end of a prefill.
        ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content': all messages"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content': all messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
            "messages[0].content[0].text': text content blocks must be non-empty",
        ),
        (
            {"messages": [*ASK, {"role": "assistant", "content": "The sea "}]},
            "messages[1].content': final assistant content cannot end with trailing whitespace",
        ),
        # Nested fields are checked as the top level is (Anthropic's API refuses them too).
        (
            {"messages": [{"role": "user", "content": "hi", "bogus": 1}]},
            "messages[0].bogus': Extra inputs are not permitted",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "b": 1}]}]},
            "messages[0].content[0].b': Extra inputs are not permitted",
        ),
        ({"system": [{"type": "text", "text": "s", "b": 1}]}, "system[0].b'"),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "b": 1}]}, "tools[0].b'"),
        ({"tool_choice": {"type": "auto", "b": 1}}, "tool_choice.b'"),
        (
            {"messages": [{"role": "user", "content": [{"text": "a"}]}]},
            "messages[0].content[0]': a block without a type is not supported here (text and "
            "tool_result blocks are)",
        ),
        (
            {"messages": [{"role": "user", "content": ["a"]}]},
            "messages[0].content[0]': expected a content block (an object), got a string",
        ),
        ({"messages": [{"content": "a"}]}, "messages[0].role': Field required: one of"),
        (
            {"messages": [*ASK, {"role": "assistant", "content": [{"type": "image"}]}]},
            "messages[1].content[0]': 'image' blocks are not supported here (a final assistant "
            "message, the answer's start, takes text and thinking blocks)",
        ),
        # cache_control is checked wherever it may be: the request, a block, a tool.
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": 5}]}
                ]
            },
            "messages[0].content[0].cache_control': expected an object with 'type': 'ephemeral'",
        ),
        (
            {"system": [{"type": "text", "text": "s", "cache_control": "yes"}]},
            "system[0].cache_control'",
        ),
        (
            {"tools": [{**TOOLS[0], "cache_control": [1]}]},
            "tools[0].cache_control': expected an object",
        ),
        (
            {"cache_control": {"type": "ephemeral", "ttl": "2d"}},
            "cache_control.ttl': '2d' is not one of ['5m', '1h']",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name': Field required"),
        # As Anthropic's API: tool names are unique, and every tool's schema is JSON Schema
        # whether or not tool_choice makes the answer call it.
        (
            {"tools": [TOOLS[0], {**TOOLS[1], "name": "get_weather"}]},
            "tools[1].name': tool names must be unique: tools[0] is 'get_weather'",
        ),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "object", "required": "a"}}]},
            "tools[0].input_schema.required': not valid JSON Schema",
        ),
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "object", "properties": 5}}],
                "tool_choice": {"type": "none"},
            },
            "tools[0].input_schema.properties': not valid JSON Schema",
        ),
        # ...and the tool_use ids of one message are unique.
        (
            {
                "tools": TOOLS,
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t1", "name": "get_time", "input": {}},
                            {"type": "tool_use", "id": "t1", "name": "get_time", "input": {}},
                        ],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}],
                    },
                ],
            },
            "messages[1].content[1].id': `tool_use` ids must be unique: 't1' is repeated",
        ),
        # A grammar cannot continue a prefill it does not know.
        (
            {
                "messages": [*ASK, {"role": "assistant", "content": '{"sea":'}],
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
            },
            "output_config.format': cannot be combined with a prefill",
        ),
        (
            {
                "messages": [*ASK, {"role": "assistant", "content": "I will"}],
                "tools": TOOLS,
                "tool_choice": {"type": "any"},
            },
            "tool_choice': cannot be combined with a prefill",
        ),
    ]
    for extra, where in cases:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 4} | extra
        response = gateway.http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
        assert response.status_code == 400, (extra, response.text)
        assert where in response.json()["error"]["message"], (extra, response.text)


def test_a_prompt_past_the_workers_message_limit_is_a_400_not_a_429(
    gateway: Gateway, worker: ServeProcess
) -> None:
    """Text the worker could never take in one message is the client's mistake (400, as
    the OpenAI route answers), not a 429 the SDK would send again and again."""
    with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        info = pb_grpc.WorkerServiceStub(channel).GetInfo(pb.GetInfoRequest())
    limit = info.limits.max_message_bytes
    # Past half the limit: the rendered chat would come back with its tokens in a reply
    # larger than the worker sends (a chat of 0.6 of it got "send less", not these words).
    ask = [{"role": "user", "content": "a " * (limit // 3 + 8)}]
    for route, body in (
        ("/v1/messages", {"model": MODEL, "messages": ask, "max_tokens": 4}),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": ask}),
    ):
        response = gateway.http.post(route, json=body, headers={"x-api-key": KEY})
        assert response.status_code == 400, (route, response.text[:300])
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert f"in one message ({limit // 2} bytes" in error["message"], error
        if route == "/v1/messages":  # the words agents compact the conversation on
            assert error["message"].startswith("prompt is too long: "), error
    body = {"model": MODEL, "messages": ask, "max_tokens": 4}
    response = gateway.http.post("/v1/chat/completions", json=body, headers={"x-api-key": KEY})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "messages")
    assert response.json()["error"]["code"] == "context_length_exceeded"
    # Too large by its stop strings: named as each API names them.
    stops = ["s" * (limit // 4 + 64) + str(i) for i in range(4)]
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "stop": stops}
    response = gateway.http.post("/v1/chat/completions", json=body, headers={"x-api-key": KEY})
    assert (response.status_code, response.json()["error"]["param"]) == (400, "stop")
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "stop_sequences": stops}
    response = gateway.http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert response.status_code == 400
    assert "'stop_sequences': the request takes" in response.json()["error"]["message"]


def test_a_prefill_is_continued(client: anthropic.Anthropic) -> None:
    prefill = [*ASK, {"role": "assistant", "content": "The sea"}]
    message = create(client, messages=prefill, max_tokens=4)
    plain = create(client, max_tokens=4)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > (
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    )
    assert message.content[0].type == "text"


def test_an_answer_cut_to_nothing_goes_back_in_the_history(client: anthropic.Anthropic) -> None:
    """A stop sequence at the answer's start leaves its text block empty, streamed or
    not, with tools too (it had no block then); sent back as the assistant's turn, as
    agents do, it is accepted (it was a 400)."""
    first = create(client, max_tokens=4).content[0].text[0]
    calls = {"tools": TOOLS, "tool_choice": {"type": "any"}}  # the grammar opens a call
    for tools, stop in (({}, first), (calls, "<tool_call>")):
        for stream in (False, True):
            options: dict[str, Any] = {"max_tokens": 16, "stop_sequences": [stop], **tools}
            answer = streamed(client, **options)[1] if stream else create(client, **options)
            assert answer.stop_reason == "stop_sequence"
            assert [(b.type, b.text) for b in answer.content] == [("text", "")]
            turn = {"role": "assistant", "content": [b.model_dump() for b in answer.content]}
            history = [*ASK, turn, {"role": "user", "content": "Go on."}]
            assert create(client, messages=history, max_tokens=2, tools=TOOLS).content
            if not tools:  # a prefill cannot open an answer tool_choice any constrains
                assert create(client, messages=[*ASK, turn], max_tokens=2).content


def test_output_config_format_constrains_the_answer(client: anthropic.Anthropic) -> None:
    """output_config.format (Anthropic's structured outputs) is held to by the grammar:
    the answer is compact JSON of the schema, even at temperature 1 on random weights."""
    schema = {
        "type": "object",
        "properties": {"sea": {"enum": ["calm", "rough"]}, "waves": {"type": "boolean"}},
        "required": ["sea", "waves"],
        "additionalProperties": False,
    }
    config = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    for temperature in (0.0, 1.0):
        message = create(
            client,
            max_tokens=40,
            extra_body={"temperature": temperature, "output_config": config},
            cache_control={"type": "ephemeral"},  # top-level: accepted, changes nothing
        )
        jsonschema.validate(json.loads(message.content[0].text), schema)
        assert message.stop_reason == "end_turn"
    for bad, where in (
        ({"format": {"type": "json_object"}}, "output_config.format"),
        ({"format": {"type": "json_schema"}}, "output_config.format.schema': Field required"),
        (
            {"format": {"type": "json_schema", "schema": [1]}},
            "output_config.format.schema': expected a JSON Schema object, got an array",
        ),
        ({"effort": "extreme"}, "output_config.effort"),
        ({"verbosity": "low"}, "output_config.verbosity"),
    ):
        with pytest.raises(anthropic.BadRequestError, match=re.escape(where)):
            create(client, extra_body={"output_config": bad})


def test_max_tokens_past_the_context_runs_to_its_end(
    client: anthropic.Anthropic, gateway: Gateway
) -> None:
    """As Anthropic's API has it (agents send a large fixed max_tokens, 32000 for one),
    max_tokens may ask for more than the context has left: the answer stops at its end
    with model_context_window_exceeded. A prompt with no room left is a 400 in
    Anthropic's words."""
    message = create(client, max_tokens=32000)
    assert message.stop_reason == "model_context_window_exceeded", message.stop_reason
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.output_tokens == 512
    long = [{"role": "user", "content": "sea " * 600}]
    body = {"model": MODEL, "messages": long, "max_tokens": 4}
    response = gateway.http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert re.fullmatch(
        r"prompt is too long: \d+ tokens > 511 maximum \(the model's context is 512 tokens, "
        r"one of them for the answer\)",
        error["message"],
    ), error
