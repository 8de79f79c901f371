"""Structured outputs and tool calls through the gateway, driven with the official `openai` client.

A `mlx-worker serve` process on the tiny random llama, its chat template
replaced by a Hermes-style one that renders tools (`TOOL_TEMPLATE`), behind a
`mlx-worker gateway` process. The random model's free output is noise, so
whatever it answers under a constraint shows the constraint: the JSON parses
and validates against the schema (`jsonschema`), the forced tool calls name the
tool and their arguments validate against its parameters.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from driver import ServeProcess
from gateway_process import Gateway

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "A forecast",
            "parameters": WEATHER_ARGS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
REPORT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["title", "score", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def worker(tiny_tools_dir: Path) -> Iterator[ServeProcess]:
    proc = ServeProcess(tiny_tools_dir, 1.0)
    yield proc
    proc.reap()


Answer = tuple[str | None, str | None]  # (content, finish_reason)


def ask(client: openai.OpenAI, stream: bool, **options: Any) -> tuple[Answer, list[Any]]:
    """((content, finish_reason), calls) of one greedy chat; a stream's chunks assembled."""
    request: dict[str, Any] = {"model": "model", "messages": ASK, "temperature": 0}
    request |= {"max_tokens": 80} | options
    if not stream:
        done = client.chat.completions.create(**request)
        choice = done.choices[0]
        calls = [
            (c.id, c.type, c.function.name, c.function.arguments)
            for c in choice.message.tool_calls or []
        ]
        return (choice.message.content, choice.finish_reason), calls
    content, finish = "", None
    parts: dict[int, list[Any]] = {}
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            assert call.function is not None
            if call.id is not None:  # the call's first delta: id, type, name
                assert call.type == "function" and call.function.arguments == ""
                parts[call.index] = [call.id, call.type, call.function.name, ""]
            else:
                assert call.function.name is None and call.function.arguments
                parts[call.index][3] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return (content or None, finish), [tuple(parts[i]) for i in sorted(parts)]


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls, "no tool call"
    for call_id, kind, name, arguments in calls:
        assert re.fullmatch(r"call_[0-9a-f]{24}", call_id) and kind == "function"
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---------------------------------------------------- structured outputs
@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_response_format_gives_json_that_validates(
    client: openai.OpenAI, stream: bool
) -> None:
    json_schema = {"name": "report", "schema": REPORT, "strict": True}
    response_format = {"type": "json_schema", "json_schema": json_schema}
    # The random model would write whitespace to the end: vLLM's option rules it out.
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    (content, finish), calls = ask(
        client, stream, response_format=response_format, max_tokens=200, extra_body=compact
    )
    assert finish == "stop" and not calls and content is not None
    jsonschema.validate(json.loads(content), REPORT)


def test_vllms_structured_fields_constrain_the_output(client: openai.OpenAI) -> None:
    extras = [
        ({"structured_outputs": {"choice": ["sunny", "rainy"]}}, r"sunny|rainy"),
        ({"guided_choice": ["yes", "no"]}, r"yes|no"),
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
        ({"guided_regex": r"(cat|dog)s?"}, r"(cat|dog)s?"),
        ({"structured_outputs": {"grammar": 'start: "a" ("b" | "c")'}}, r"a[bc]"),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, r"x[0-9]{2}"),
    ]
    for extra, pattern in extras:
        (content, finish), _ = ask(client, False, extra_body=extra)
        assert finish == "stop" and re.fullmatch(pattern, content or ""), (extra, content)
    extra = {"structured_outputs": {"json": REPORT, "disable_any_whitespace": True}}
    (content, _), _ = ask(client, False, extra_body=extra, max_tokens=200)
    jsonschema.validate(json.loads(content or ""), REPORT)


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strng"}}},
            "response_format",
        ),
        ("guided_regex", "(unclosed", "guided_regex"),
        ("structured_outputs", {"grammar": "start: ("}, "structured_outputs"),
        ("guided_json", {"type": "string", "minLength": 5, "maxLength": 2}, "guided_json"),
        ("guided_regex", r"[^\s\S]", "guided_regex"),  # no text matches it
        # Past the grammar engine's limits on the first token.
        ("guided_choice", [f"city{i}" for i in range(2001)], "guided_choice"),
        ("guided_regex", "(x{1000}){1021}", "guided_regex"),
    ],
)
def test_a_spec_the_engine_refuses_is_a_400_naming_the_field_before_any_token(
    gateway: Gateway, field: str, value: Any, param: str
) -> None:
    body = {"model": "model", "messages": ASK, "max_tokens": 4, field: value}
    for stream in (False, True):
        response = gateway.http.post("/v1/chat/completions", json=body | {"stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_value"), error
        assert error["message"].startswith(f"Invalid value for '{param}': ")


def test_a_strict_tool_the_engine_refuses_is_a_400_with_the_reason(gateway: Gateway) -> None:
    """The engine's reason for a tool's schema reaches the client whole, as it does for
    the same schema as a response_format (a regex error spans several lines)."""
    pattern = {"type": "string", "pattern": "^(?=a).*$"}  # look-ahead: not supported
    schema = {"type": "object", "properties": {"x": pattern}, "required": ["x"]}
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": schema}}
    body = {"model": "model", "messages": ASK, "max_tokens": 4, "tools": [tool]}
    response = gateway.http.post("/v1/chat/completions", json=body | {"tool_choice": "required"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools"
    assert error["message"].startswith("Invalid value for 'tools': ")
    assert (
        "look-around, including look-ahead and look-behind, is not supported" in (error["message"])
    )
    assert "%json" not in error["message"]  # the gateway's own grammar stays out


def test_a_spec_failing_mid_answer_names_the_requests_field(
    gateway: Gateway, worker: ServeProcess
) -> None:
    """A grammar that reaches the engine's limits only after its first token (a 2,500-way
    alternation behind a "k" that logit_bias forces) fails mid-answer: the 400, or the
    stream's error event, names the field the request gave it in, as a refusal up front
    does; and ignore_eos beside a spec is a 400 naming ignore_eos."""
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    k = stub.Tokenize(pb.TokenizeRequest(text="k")).token_ids[-1]
    closed = stub.Tokenize(pb.TokenizeRequest(text="{}")).token_ids  # one token: no "k"
    grammar = 'start: "{" b "}"\nb: "" | "k" c\nc: ' + " | ".join(
        f'"c{i:04d}"' for i in range(2500)
    )
    body = {"model": "model", "messages": ASK, "max_tokens": 30, "temperature": 0}
    bias = {str(k): 100} | {str(t): -100 for t in closed if len(closed) == 1}
    body |= {"guided_grammar": grammar, "logit_bias": bias}
    response = gateway.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_grammar", error
    assert error["message"].startswith("Invalid value for 'guided_grammar': the grammar engine")
    with gateway.http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as got:
        events = [json.loads(line[6:]) for line in got.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["param"] == "guided_grammar", events[-1]
    both = {"model": "model", "messages": ASK, "guided_choice": ["a", "b"], "ignore_eos": True}
    response = gateway.http.post("/v1/chat/completions", json=both)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "ignore_eos", error
    assert error["message"] == (
        "Invalid value for 'ignore_eos': cannot be combined with structured_outputs: the "
        "grammar decides where the output ends"
    )


def test_a_bad_spec_fails_alone_when_it_shares_a_step(gateway: Gateway) -> None:
    # Sent together, the good requests and the bad one start in the same Execute step.
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
            body = {"model": "model", "messages": ASK, "max_tokens": 4}
            bad = body | {"guided_regex": "(unclosed"}
            return await asyncio.gather(
                *(http.post("/v1/chat/completions", json=b) for b in (body, bad, body))
            )

    good1, bad, good2 = asyncio.run(run())
    assert (good1.status_code, bad.status_code, good2.status_code) == (200, 400, 200), good1.text
    assert bad.json()["error"]["param"] == "guided_regex"


# ----------------------------------------------------------- tool calls
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_calls_that_validate(
    client: openai.OpenAI, stream: bool
) -> None:
    options: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required"}
    (content, finish), calls = ask(client, stream, parallel_tool_calls=False, **options)
    assert (content, finish, len(calls)) == (None, "tool_calls", 1)
    check_calls(calls, {"get_weather", "get_time"})
    # With parallel calls the random model calls again and again: complete calls are
    # tool_calls, the one max_tokens cut is left as text.
    (content, finish), calls = ask(client, stream, **options)
    check_calls(calls, {"get_weather", "get_time"})
    assert finish == "length" and (content or "").startswith("\n<tool_call>\n{")


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_the_one_called(client: openai.OpenAI, stream: bool) -> None:
    for name in ("get_weather", "get_time"):
        choice = {"type": "function", "function": {"name": name}}
        (content, finish), calls = ask(client, stream, tools=TOOLS, tool_choice=choice)
        assert finish == "tool_calls" and content is None and len(calls) == 1
        check_calls(calls, {name})


def test_streamed_and_whole_calls_agree(client: openai.OpenAI) -> None:
    whole = ask(client, False, tools=TOOLS, tool_choice="required")
    streamed = ask(client, True, tools=TOOLS, tool_choice="required")
    assert whole[0] == streamed[0]
    assert [c[2:] for c in whole[1]] == [c[2:] for c in streamed[1]]


def test_a_tool_result_sent_back_gets_an_answer(
    client: openai.OpenAI, worker: ServeProcess
) -> None:
    _, [(call_id, _, name, arguments)] = ask(
        client,
        False,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "It is 12:00."},
    ]
    for stream in (False, True):
        (content, finish), calls = ask(
            client,
            stream,
            messages=history,
            tools=TOOLS,
            tool_choice="none",
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert (finish, calls) == ("length", []) and content
    # The same answer sent back as the openai SDK's parse() and stream() helpers dump it:
    # their own fields (parsed, parsed_arguments, a streamed call's index) and nulls.
    dumped = {"refusal": None, "annotations": None, "audio": None, "function_call": None}
    dumped |= {"parsed": None}
    helper = {**history[1], **dumped, "tool_calls": [dict(history[1]["tool_calls"][0])]}
    call = helper["tool_calls"][0]
    call |= {"index": 0, "function": {**call["function"], "parsed_arguments": {}}}
    as_helper = [history[0], helper, history[2]]
    answers = [
        ask(client, False, messages=h, tools=TOOLS, tool_choice="none", max_tokens=8)[0]
        for h in (history, as_helper)
    ]
    assert answers[0] == answers[1]
    # The worker rendered the call and the result through the template.
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    calls_json = json.dumps(
        [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.loads(arguments)},
            }
        ]
    )
    rendered = stub.Tokenize(
        pb.TokenizeRequest(
            messages=[
                pb.ChatMessage(**ASK[0]),
                pb.ChatMessage(role="assistant", tool_calls_json=calls_json),
                pb.ChatMessage(role="tool", content="It is 12:00.", tool_call_id=call_id),
            ]
        ),
        timeout=30,
    ).text
    assert (
        f'<tool_call>\n{{"name": "get_time", "arguments": {arguments}}}\n</tool_call>' in rendered
    )
    assert "<tool_response>\nIt is 12:00.\n</tool_response>" in rendered


def test_auto_mode_without_a_call_is_plain_content(
    client: openai.OpenAI, worker: ServeProcess
) -> None:
    # The random model does not write a call: its text is the answer, as the worker renders it.
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(**ASK[0])],
        tools_json=json.dumps(TOOLS),
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    )
    want = "".join(m.text for m in stub.Generate(request, timeout=60))
    assert want and "<tool_call>" not in want
    for stream in (False, True):
        answer = ask(client, stream, tools=TOOLS, max_tokens=12, extra_body={"ignore_eos": True})
        assert answer == ((want, "length"), [])


def test_a_non_json_constraint_with_tools_to_call_is_a_400(gateway: Gateway) -> None:
    body = {"model": "model", "messages": ASK, "tools": TOOLS, "guided_regex": "a"}
    response = gateway.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex"


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_format_beside_tools_gives_a_call_or_an_answer_of_the_schema(
    client: openai.OpenAI, worker: ServeProcess, stream: bool
) -> None:
    """As OpenAI's: with tools the model may call and a response_format, each answer is
    tool calls or JSON of the schema (agents' tools + typed output); on noise, at
    temperature 1, every seed gives one or the other. Forced calls ignore the format."""
    schema = {"name": "report", "strict": True, "schema": REPORT}
    kinds = set()
    for seed in range(6):
        (content, finish), calls = ask(
            client,
            stream,
            tools=TOOLS,
            response_format={"type": "json_schema", "json_schema": schema},
            temperature=1.0,
            seed=seed,
            max_tokens=120,
            parallel_tool_calls=False,  # one call: noise would call on to max_tokens
        )
        if calls:
            check_calls(calls, set(SCHEMAS))
            assert (content, finish) == (None, "tool_calls")
            kinds.add("calls")
        else:
            assert finish == "stop" and content is not None, (content, finish)
            jsonschema.validate(json.loads(content), REPORT)
            kinds.add("answer")
    assert kinds, "no answer"
    # With the calls' first token ('<' of <tool_call>) banned, the answer is the JSON.
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    opening = stub.Tokenize(pb.TokenizeRequest(text="<tool_call>")).token_ids[0]
    (content, finish), calls = ask(
        client,
        stream,
        tools=TOOLS,
        response_format={"type": "json_schema", "json_schema": schema},
        logit_bias={str(opening): -100},
        max_tokens=120,
    )
    assert not calls and finish == "stop" and content is not None
    jsonschema.validate(json.loads(content), REPORT)
    (_, finish), calls = ask(
        client,
        stream,
        tools=TOOLS,
        tool_choice="required",
        response_format={"type": "json_object"},
        parallel_tool_calls=False,
    )
    check_calls(calls, set(SCHEMAS))
    assert finish == "tool_calls"


def test_a_response_format_beside_tools_the_engine_refuses_shows_no_grammar(
    gateway: Gateway,
) -> None:
    """Beside tools the JSON constraint sits in a grammar the gateway writes: its 400 names
    response_format with the engine's reason, not that grammar's text."""
    unique = {"type": "array", "uniqueItems": True}
    body = {
        "model": "model",
        "messages": ASK,
        "max_tokens": 4,
        "tools": TOOLS,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": unique}},
    }
    response = gateway.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format"
    assert "uniqueItems" in error["message"]
    assert "start:" not in error["message"] and "\n" not in error["message"], error["message"]
