"""Tool calls in the model's text: the parser on each format, whole and streamed, and the grammar.

No model runs here: the parser is fed texts in each format, whole and cut at
every chunk size from 1 character up, and must give the same content and calls
either way; the grammar of a forced call is checked with llguidance against
the SmolLM2 tokenizer (the texts a template teaches are accepted; arguments
that break the tool's schema are not).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import pytest
from mlx_lm.tokenizer_utils import load

from mlx_worker_svc.gateway.anthropic.schema import parse_messages
from mlx_worker_svc.gateway.errors import ApiError
from mlx_worker_svc.gateway.structured import apply_spec, parse_structured
from mlx_worker_svc.gateway.tool_calls import (
    Call,
    Event,
    Format,
    ToolCallParser,
    call_grammar,
    tool_format,
)
from mlx_worker_svc.gateway.tools import parse_tools
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
PARIS = {"city": "Paris", "days": 2}


def parse(fmt: Format, text: str, step: int = 0, parallel: bool = True) -> list[Event]:
    """The parser's events for `text`, fed whole (step 0) or in pieces of `step` characters."""
    parser = ToolCallParser(fmt, parallel=parallel)
    pieces = [text[i : i + step] for i in range(0, len(text), step)] if step else [text]
    events = [e for piece in pieces for e in parser.feed(piece)]
    return events + parser.finish()


def summary(events: list[Event]) -> tuple[str, list[tuple[int, str, Any]]]:
    """(content, [(index, name, arguments)]) of a parser's events; ids checked unique."""
    calls = [e for e in events if isinstance(e, Call)]
    assert len({c.id for c in calls}) == len(calls)
    assert all(c.id.startswith("call_") for c in calls)
    content = "".join(e for e in events if isinstance(e, str))
    return content, [(c.index, c.name, json.loads(c.arguments)) for c in calls]


HERMES = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
CASES: list[tuple[Format, str, str, list[tuple[int, str, Any]]]] = [
    ("hermes", HERMES, "Let me look.\n", [(0, "get_weather", PARIS), (1, "get_time", {})]),
    # The closing tag left out before EOS, as some models do.
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [(0, "get_time", {})]),
    # Arguments sent as a JSON string are read as the object they hold.
    (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
        "",
        [(0, "get_time", {"tz": "UTC"})],
    ),
    (
        "llama3_json",
        ' {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
        "",
        [(0, "get_weather", PARIS)],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_time", "parameters": {}}; '
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
        "",
        [(0, "get_time", {}), (1, "get_weather", PARIS)],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [(0, "get_weather", PARIS), (1, "get_time", {})],
    ),
    # [TOOL_CALLS] is a special token: with special tokens skipped only the array is left.
    (
        "mistral",
        '[{"name": "get_time", "arguments": {}}]',
        "",
        [(0, "get_time", {})],
    ),
]
PLAIN: list[tuple[Format, str]] = [
    ("hermes", "The weather is <b>fine</b> and 1 < 2 <tool"),
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("llama3_json", 'It is sunny. {"name": "get_time", "parameters": {}}'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", "{not json"),
    ("llama3_json", "   "),
    ("mistral", "[1, 2, 3] are numbers"),
    ("mistral", "See [TOOL_CALLS] for more"),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_calls_are_parsed_whole_and_at_every_chunk_boundary(
    fmt: Format, text: str, content: str, calls: list[tuple[int, str, Any]]
) -> None:
    for step in (0, 1, 2, 3, 5, 7, 11):
        assert summary(parse(fmt, text, step)) == (content, calls), step


@pytest.mark.parametrize(("fmt", "text"), PLAIN)
def test_text_that_is_no_call_is_content_unchanged(fmt: Format, text: str) -> None:
    for step in (0, 1, 2, 3, 7):
        assert summary(parse(fmt, text, step)) == (text, []), step


def test_content_streams_before_the_call_and_a_marker_is_held_back() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed("Let me look. <tool") == ["Let me look. "]
    assert parser.feed("_call>\n") == []
    assert parser.feed('{"name": "get_time", "arguments": {}}\n</tool_call>') == parser.calls
    assert parser.finish() == []
    # A held-back tail that turns out to be text goes out with the next piece.
    parser = ToolCallParser("hermes")
    assert parser.feed("a <tool") == ["a "]
    assert parser.feed("s are nice") == ["<tools are nice"]


def test_without_parallel_calls_only_the_first_call_is_kept() -> None:
    for fmt, text, _, calls in CASES:
        if len(calls) > 1:
            assert summary(parse(fmt, text, 3, parallel=False))[1] == calls[:1]


def test_the_format_follows_the_chat_template() -> None:
    assert tool_format("{{ '<tool_call>' }}") == "hermes"
    assert tool_format("{%- if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == "mistral"
    assert tool_format("{{- '<|python_tag|>' }}") == "llama3_json"
    assert tool_format("{%- if message.role == 'ipython' %}") == "llama3_json"
    assert tool_format("{{ messages }}") == "hermes"


@pytest.fixture(scope="module")
def ll_tokenizer(smollm_dir: Path) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(load(smollm_dir)._tokenizer)


def accepts(grammar: str, text: str, tokenizer: llguidance.LLTokenizer) -> bool:
    """Whether the grammar takes `text` whole (and then may end)."""
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", grammar))
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


FORCED: list[tuple[Format, str, str]] = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
        "\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"days": 2}}\n</tool_call>',
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '{"name": "get_weather", "parameters": {"city": 7}}',
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"town": "Paris"}}]',
    ),
]


@pytest.mark.parametrize(("fmt", "good", "bad"), FORCED)
def test_a_forced_call_grammar_takes_the_format_and_the_schema(
    fmt: Format, good: str, bad: str, ll_tokenizer: llguidance.LLTokenizer
) -> None:
    grammar = call_grammar((WEATHER, CLOCK), fmt, parallel=False)
    assert accepts(grammar, good, ll_tokenizer)
    assert not accepts(grammar, bad, ll_tokenizer)
    assert not accepts(grammar, good.replace("get_weather", "get_wether"), ll_tokenizer)
    # The parser reads what the grammar produces.
    assert summary(parse(fmt, good))[1][0][1] == "get_weather"


def test_a_tool_without_parameters_is_called_with_no_arguments(
    ll_tokenizer: llguidance.LLTokenizer,
) -> None:
    # OpenAI: "Omitting parameters defines a function with an empty parameter list."
    ping = {"name": "ping", "description": "Ping the server"}
    grammar = call_grammar((ping,), "hermes", parallel=False)
    call = '<tool_call>\n{"name": "ping", "arguments": %s}\n</tool_call>'
    assert accepts(grammar, call % "{}", ll_tokenizer)
    assert not accepts(grammar, call % '{"name": "ping"}', ll_tokenizer)
    # An empty schema given is the caller's: any object.
    anything = call_grammar(({**ping, "parameters": {}},), "hermes", parallel=False)
    assert accepts(anything, call % '{"name": "ping"}', ll_tokenizer)


def test_parallel_calls_are_one_grammar_or_more(ll_tokenizer: llguidance.LLTokenizer) -> None:
    two = HERMES.split("\n", 1)[1]  # the two blocks without the text before them
    assert accepts(call_grammar((WEATHER, CLOCK), "hermes", parallel=True), two, ll_tokenizer)
    assert not accepts(call_grammar((WEATHER, CLOCK), "hermes", parallel=False), two, ll_tokenizer)


# ------------------------------------------ structured-output fields
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("body", "param", "want"),
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, "response_format", {"json_object": True}),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            "response_format",
            {"json_schema": json.dumps(SCHEMA)},
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            "structured_outputs",
            {"json_schema": json.dumps(SCHEMA)},
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            "structured_outputs",
            {"json_object": True, "disable_any_whitespace": True},
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs", {"regex": "[a-z]+"}),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            "structured_outputs",
            {"choice": {"choices": ["yes", "no"]}},
        ),
        (
            {"structured_outputs": {"grammar": 'start: "a"'}},
            "structured_outputs",
            {"lark_grammar": 'start: "a"'},
        ),
        ({"guided_json": SCHEMA}, "guided_json", {"json_schema": json.dumps(SCHEMA)}),
        ({"guided_regex": "[0-9]"}, "guided_regex", {"regex": "[0-9]"}),
        ({"guided_choice": ["a"]}, "guided_choice", {"choice": {"choices": ["a"]}}),
        ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", {"gbnf_grammar": 'root ::= "a"'}),
    ],
)
def test_each_structured_field_becomes_the_workers_spec(
    body: dict[str, Any], param: str | None, want: dict[str, Any] | None
) -> None:
    spec, field = parse_structured(body)
    assert field == param
    assert spec == (None if want is None else pb.StructuredOutputs(**want))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": 1}}},
            "response_format.json_schema.strict",
        ),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
        ),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_a_bad_structured_field_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_structured(body)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert f"'{param}'" in caught.value.message


def test_a_compact_answer_beside_tools_stays_compact(ll_tokenizer: llguidance.LLTokenizer) -> None:
    """disable_any_whitespace (and Anthropic's output_config, which sets it) holds the JSON
    answer the model may give instead of a call, as it does without tools."""
    body = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        "structured_outputs": {"disable_any_whitespace": True},
    }
    spec, param = parse_structured(body)
    assert spec is not None and param is not None
    answer = apply_spec(pb.SamplingParams(), spec, param, tools=True)
    compact = call_grammar((WEATHER,), "hermes", parallel=False, answer=answer)
    assert accepts(compact, '{"a":1}', ll_tokenizer)
    assert not accepts(compact, '{"a": 1}', ll_tokenizer)
    spec.disable_any_whitespace = False
    spaced = call_grammar(
        (WEATHER,),
        "hermes",
        parallel=False,
        answer=apply_spec(pb.SamplingParams(), spec, param, tools=True),
    )
    assert accepts(spaced, '{"a": 1}', ll_tokenizer)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        *(("strict", v, "expected a boolean") for v in ("yes", 1, "false")),
        # It reaches the chat template as text.
        *(("description", v, "expected a string") for v in (12345, {"x": 1}, ["a"], True)),
    ],
)
def test_a_tool_field_of_the_wrong_type_is_a_400_naming_it(
    field: str, value: Any, says: str
) -> None:
    tool = {"name": "f", "parameters": {"type": "object"}, field: value}
    with pytest.raises(ApiError) as openai_route:
        parse_tools({"tools": [{"type": "function", "function": tool}]})
    assert openai_route.value.param == f"tools[0].function.{field}"
    anthropic_tool = {"name": "f", "input_schema": {"type": "object"}, field: value}
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError) as anthropic_route:
        parse_messages(body | {"tools": [anthropic_tool]}, "id")
    assert anthropic_route.value.param == f"tools[0].{field}"
    assert says in anthropic_route.value.message


@pytest.mark.parametrize("description", [12345, {"x": 1}, ["a"], True])
def test_a_schema_description_that_is_not_a_string_is_a_400_naming_it(description: Any) -> None:
    schema = {"name": "a", "schema": {"type": "object"}, "description": description}
    with pytest.raises(ApiError) as response_format:
        parse_structured({"response_format": {"type": "json_schema", "json_schema": schema}})
    assert response_format.value.param == "response_format.json_schema.description"


@pytest.mark.parametrize("stops", [{}, 0, False, 0.0, ""])
def test_anthropic_stop_sequences_that_are_not_an_array_are_a_400_even_when_falsy(
    stops: Any,
) -> None:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(ApiError) as refused:
        parse_messages(body | {"stop_sequences": stops}, "id")
    assert (refused.value.status, refused.value.param) == (400, "stop_sequences")
    parse_messages(body | {"stop_sequences": None}, "id")  # null: absent
