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


def test_a_forced_call_of_a_tool_that_is_not_strict_leaves_out_what_cannot_be_enforced(
    gateway: Gateway,
) -> None:
    """Keywords the grammar engine does not enforce (a pydantic set's uniqueItems, bytes'
    format binary, not) do not refuse a tool that is not strict, as OpenAI does not;
    with strict: true they do (a 400 naming tools)."""
    tags: dict[str, Any] = {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b"]},
                "maxItems": 2,
                "uniqueItems": True,
            },
            "blob": {"type": "string", "format": "binary", "maxLength": 4},
            "note": {"not": {"type": "null"}, "type": "string", "maxLength": 4},
        },
        "required": ["tags"],
        "additionalProperties": False,
        "minProperties": 1,  # enforced only where every property is required
    }
    tool: dict[str, Any] = {"type": "function", "function": {"name": "tag", "parameters": tags}}
    forced = {"type": "function", "function": {"name": "tag"}}
    body = {"model": "model", "messages": ASK, "tools": [tool], "tool_choice": forced}
    done = gateway.http.post("/v1/chat/completions", json=body | {"max_tokens": 80}).json()
    [call] = done["choices"][0]["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) <= set(tags["properties"]) and set(arguments["tags"]) <= {"a", "b"}
    strict = {**tool, "function": {**tool["function"], "strict": True}}
    response = gateway.http.post("/v1/chat/completions", json=body | {"tools": [strict]})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "tools"
    # The engine's reason, not the gateway's grammar.
    assert "\n" not in error["message"] and "call_0" not in error["message"], error


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "dependencies": {"a": ["b"]}},
        {"type": "object", "properties": {"p": {"type": "string", "pattern": "^(?=.*\\d).{8,}$"}}},
        {"type": "object", "properties": {"p": {"type": "string", "pattern": "^(a)\\1$"}}},
        {"type": "object", "properties": {"l": {"type": "array", "minItems": 1.0}}},
        {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**64 - 1}}},
        {"type": "object", "properties": {"r": {"$ref": "#/$defs/missing"}}},
        {"type": "object", "properties": {"r": {"$ref": "https://example.com/s.json"}}},
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {
                "t": {"type": "array", "items": [{"type": "array", "uniqueItems": True}]}
            },
        },
        {"type": "object", "$dynamicAnchor": "meta", "properties": {"x": {"$dynamicRef": "#meta"}}},
    ],
)
def test_a_forced_call_of_a_tool_that_is_not_strict_leaves_out_what_the_engine_refuses(
    gateway: Gateway, schema: Any
) -> None:
    """What the grammar engine cannot hold a call to (look-around, a dangling $ref, a
    bound past 64 bits, ...) is left out for a tool that is not strict, as under auto."""
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"model": "model", "messages": ASK, "tools": [tool], "max_tokens": 8}
    response = gateway.http.post("/v1/chat/completions", json=body | {"tool_choice": "required"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "array"}, {"type": ["object"]}])
def test_a_tool_whose_arguments_are_no_object_is_a_400(gateway: Gateway, schema: Any) -> None:
    # A forced call's grammar would write such arguments, which are no call to parse.
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"model": "model", "messages": ASK, "tools": [tool], "tool_choice": "required"}
    response = gateway.http.post("/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "tools[0].function.parameters.type"


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        # Not JSON Schema, whatever tool_choice says (the chat template shows it as it is).
        ([{"type": "object", "properties": {"a": {"type": "nonsense"}}}], ".properties.a.type"),
        ([{"type": "object", "properties": 5}], ".properties"),
        ([{"type": "object", "required": "a"}], ".required"),
        (
            [{"type": "object", "properties": {"z": {"type": "string", "pattern": "("}}}],
            ".properties.z.pattern",
        ),
        ([{"type": "object", "$schema": 5}], ".$schema"),
        # Patterns are ECMA-262's, as JSON Schema reads them: Python's (?P<n>...) is none.
        (
            [{"type": "object", "properties": {"z": {"type": "string", "pattern": "(?P<n>x)"}}}],
            ".properties.z.pattern",
        ),
        # A name with a dot is not read as a path.
        (
            [{"type": "object", "properties": {"a.b": {"type": "nonsense"}}}],
            '.properties["a.b"].type',
        ),
        # Two tools of one name: which one a call meant would be a guess.
        ([{"type": "object"}, {"type": "object"}], "tools[1].function.name"),
    ],
)
@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_a_tool_that_is_not_usable_is_a_400_whether_or_not_it_is_called(
    gateway: Gateway, tools: list[Any], param: str, choice: str | None
) -> None:
    offered = [
        {"type": "function", "function": {"name": "f", "parameters": schema}} for schema in tools
    ]
    body = {"model": "model", "messages": ASK, "tools": offered, "max_tokens": 4}
    response = gateway.http.post("/v1/chat/completions", json=body | {"tool_choice": choice})
    error = response.json()["error"]
    assert response.status_code == 400, response.text
    where = param if param.startswith("tools") else f"tools[0].function.parameters{param}"
    assert error["param"] == where, error


@pytest.mark.parametrize(
    "schema",
    [
        # ECMA-262 patterns (zod's emoji(), named groups) that Python's re refuses.
        {
            "type": "object",
            "properties": {"e": {"type": "string", "pattern": "^\\p{Extended_Pictographic}+$"}},
        },
        {"type": "object", "properties": {"d": {"type": "string", "pattern": "(?<y>\\d{4})-[^]"}}},
        # A draft named with https://, as some generators write it: that draft's rules.
        {
            "$schema": "https://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"t": {"type": "array", "items": [{"type": "string"}]}},
        },
        {
            "$schema": "https://json-schema.org/draft-04/schema#",
            "type": "object",
            "properties": {"n": {"type": "number", "minimum": 0, "exclusiveMinimum": True}},
        },
    ],
)
def test_a_tool_schema_valid_in_its_draft_is_offered(gateway: Gateway, schema: Any) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"model": "model", "messages": ASK, "tools": [tool], "max_tokens": 2}
    response = gateway.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "12:00"}, "messages[1].tool_call_id"),
        # Two calls of one id: a tool message could not say which it answers.
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "c", "type": "function", "function": {"name": "g", "arguments": "{}"}},
                ],
            },
            "messages[1].tool_calls[1].id",
        ),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[1].tool_calls"),
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                ],
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"type": "function"}]},
            "messages[1].tool_calls[0].id",
        ),
        # As OpenAI: a tool message answers a call made just before it...
        ({"role": "tool", "tool_call_id": "zzz", "content": "sunny"}, "messages[1].tool_call_id"),
        # ...and a call is answered before anything else (here: the end of the chat).
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            "messages[1].tool_calls",
        ),
        ({"role": "user"}, "messages[1].content"),
        ({"role": "system", "content": None}, "messages[1].content"),
    ],
)
def test_bad_tool_messages_are_a_400_naming_the_field(
    gateway: Gateway, message: dict[str, Any], param: str
) -> None:
    body = {"model": "model", "messages": [*ASK, message], "max_tokens": 4}
    response = gateway.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_calls_answered_in_order_pass_and_a_call_left_open_is_a_400(gateway: Gateway) -> None:
    def call(call_id: str) -> dict[str, Any]:
        return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}

    made = {"role": "assistant", "content": None, "tool_calls": [call("a"), call("b")]}
    answers = [{"role": "tool", "tool_call_id": i, "content": "ok"} for i in ("b", "a")]
    then = {"role": "user", "content": "and now?"}
    for messages, param in (
        ([*ASK, made, *answers, then], None),
        ([*ASK, made, answers[0], then], "messages[1].tool_calls"),
        ([*ASK, made, *answers, answers[0]], "messages[4].tool_call_id"),  # answered twice
    ):
        body = {"model": "model", "messages": messages, "max_tokens": 2}
        response = gateway.http.post("/v1/chat/completions", json=body)
        if param is None:
            assert response.status_code == 200, response.text
        else:
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
