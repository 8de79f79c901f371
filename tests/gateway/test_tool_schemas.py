"""A tool's schema and the tool fields of a chat, through the gateway's OpenAI route.

What the gateway takes and refuses of `tools` (each schema checked against its
draft's metaschema whatever `tool_choice` says, names unique), what a forced
call of a tool that is not strict leaves out of its constraint, and the tool
messages of a history. One worker on the tiny model with the tool-rendering
chat template, behind a gateway.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from driver import ServeProcess
from gateway_process import Gateway

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def worker(tiny_tools_dir: Path) -> Iterator[ServeProcess]:
    proc = ServeProcess(tiny_tools_dir, 1.0)
    yield proc
    proc.reap()


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
    # ...in the schema's terms, not an engine option no client reaches.
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    strict["function"]["parameters"] = {"type": "object", "properties": {"n": overlapping}}
    error = gateway.http.post("/v1/chat/completions", json=body | {"tools": [strict]}).json()
    assert "oneOf is taken only where its branches cannot both match" in str(error), error
    assert "coerce_one_of" not in str(error), error


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "dependencies": {"a": ["b"]}},
        {"type": "object", "properties": {"p": {"type": "string", "pattern": "^(?=.*\\d).{8,}$"}}},
        {"type": "object", "properties": {"p": {"type": "string", "pattern": "^(a)\\1$"}}},
        {"type": "object", "properties": {"l": {"type": "array", "minItems": 1.0}}},
        {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**64 - 1}}},
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2**53 + 1}}},
        {"type": "object", "properties": {"n": {"const": 2**60 + 1}}},
        {"type": "object", "properties": {"n": {"enum": [1, 2**53 + 1]}}},
        # Branches that may overlap: taken as anyOf (beside an anyOf too).
        {
            "type": "object",
            "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
        },
        {
            "type": "object",
            "properties": {
                "n": {
                    "anyOf": [{"type": "integer"}, {"type": "string"}],
                    "oneOf": [{"type": "integer"}, {"type": "number"}],
                }
            },
        },
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
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
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


def test_an_integer_the_engine_would_round_is_a_400_naming_its_path(gateway: Gateway) -> None:
    """The grammar engine reads JSON numbers as doubles: a const, enum or bound past 2^53
    in a schema the answer is held to (a strict tool's, a response_format beside tools)
    is a 400 naming its path, not a call with another number."""
    big = {"type": "object", "properties": {"n": {"const": 2**53 + 1}}, "required": ["n"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": big, "strict": True}}
    body = {"model": "model", "messages": ASK, "tools": [tool], "max_tokens": 8}
    response = gateway.http.post("/v1/chat/completions", json=body | {"tool_choice": "required"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == (
        "tools[0].function.parameters.properties.n.const"
    ), error
    assert f"holds {2**53 + 1}, past 2^53" in error["message"]
    loose = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    answer = {"type": "json_schema", "json_schema": {"name": "a", "schema": big}}
    body = {"model": "model", "messages": ASK, "tools": [loose], "response_format": answer}
    response = gateway.http.post("/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == (
        "response_format.json_schema.schema.properties.n.const"
    ), error


@pytest.mark.parametrize("arguments", ['{"path": "src', "", "null", "[1, 2]"])
def test_a_malformed_call_in_the_history_goes_back_as_its_text(
    gateway: Gateway, arguments: str
) -> None:
    """As OpenAI takes any string: a model's malformed call, answered by its tool with an
    error as agents do, stays in the history instead of making every later turn a 400."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Error: arguments are not JSON"},
    ]
    body = {"model": "model", "messages": history, "tools": [tool], "max_tokens": 2}
    response = gateway.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
