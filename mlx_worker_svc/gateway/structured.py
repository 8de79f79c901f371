"""Structured-output fields of a request, as one `StructuredOutputs` spec for the workers.

A request constrains its output with at most one of:

- OpenAI's `response_format`: `{"type": "text"}` (no constraint),
  `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}}`. The schema is
  always enforced, whatever `strict` says (a missing schema means any JSON
  object); `name` and `description` only label it.
- vLLM's `structured_outputs` object: exactly one of `json` (a schema, as an
  object or as JSON text), `json_object` (true), `regex`, `choice` (an array
  of strings) or `grammar`, with `disable_any_whitespace` (JSON kinds only:
  no whitespace outside strings). As in vLLM, a `structured_outputs` holding
  only options may come with `response_format`, and they apply to its JSON.
  vLLM's other keys there (`disable_additional_properties`,
  `whitespace_pattern`, `structural_tag`, ...) are refused by name.
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar`.

A grammar is GBNF (llama.cpp's EBNF, rule `root`) when it defines a rule with
`::=`, else llguidance's Lark (rule `start`), the two dialects vLLM's engines
take. What the workers' grammar engine refuses (a schema keyword it cannot
honour, a regex or grammar that does not compile) comes back as
INVALID_ARGUMENT naming `sampling_params.structured_outputs`, and the gateway
answers it as a 400 naming the request field the spec came from (`param`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from mlx_worker_svc.core.structured_outputs import inexact_number, inexact_number_message
from mlx_worker_svc.gateway.body import check_description, json_text, only_keys
from mlx_worker_svc.gateway.errors import ApiError, invalid
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

# The fields that carry a constraint; at most one may be set.
FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
# vLLM's keys of `structured_outputs` that pick the constraint.
_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_OPTIONS = ("disable_any_whitespace",)
# llguidance's JSON without whitespace (what disable_any_whitespace asks the workers for).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# The prefix of the workers' messages about the spec, which the gateway rewrites.
WORKER_FIELD = "sampling_params.structured_outputs"


def parse_structured(body: dict[str, Any]) -> tuple[pb.StructuredOutputs | None, str | None]:
    """The request's spec and the field it came from, or (None, None); raises `ApiError`."""
    given = [name for name in FIELDS if body.get(name) is not None]
    given = [n for n in given if not (n == "response_format" and body[n] == {"type": "text"})]
    options = body.get("structured_outputs")
    if given[:2] == ["response_format", "structured_outputs"] and _options_only(options):
        given.remove("structured_outputs")  # vLLM's way to give response_format options
    else:
        options = None
    if not given:
        return None, None
    if len(given) > 1:
        raise invalid(given[1], f"only one structured-output field may be set; '{given[0]}' is")
    name = given[0]
    value = body[name]
    if name == "response_format":
        spec = _response_format(value)
        if options is not None:
            _options(spec, options)
        return spec, name
    if name == "structured_outputs":
        return _vllm(value), name
    return _spec(name, name.removeprefix("guided_"), value), name


def _options_only(value: Any) -> bool:
    """Whether `structured_outputs` holds options and no constraint."""
    return isinstance(value, dict) and all(value.get(k) is None for k in _KINDS)


def _response_format(value: Any) -> pb.StructuredOutputs:
    kinds = ("text", "json_object", "json_schema")
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in kinds:
        raise invalid("response_format", f"expected an object with 'type' one of {list(kinds)}")
    only_keys(
        value, ("type", "json_schema") if kind == "json_schema" else ("type",), "response_format"
    )
    if kind == "json_object":
        return pb.StructuredOutputs(json_object=True)
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise invalid(where, "expected an object with a 'name' string")
    only_keys(spec, ("name", "description", "schema", "strict"), where)
    check_description(spec, where)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.strict", "expected a boolean")
    schema = spec.get("schema")
    if schema is None:
        return pb.StructuredOutputs(json_object=True)
    return _spec(f"{where}.schema", "json", schema)


def check_exact_numbers(schema: Any, param: str) -> None:
    """Refuses a schema the output is held to whose const, enum or bound has an integer
    past 2^53 (the workers' engine would round it), naming its path under `param`."""
    found = inexact_number(schema)
    if found is not None:
        path, value = found
        raise invalid(f"{param}.{path}", inexact_number_message(path, value))


def _vllm(value: Any) -> pb.StructuredOutputs:
    if not isinstance(value, dict):
        raise invalid("structured_outputs", "expected an object")
    _vllm_keys(value)
    return _constraint(value)


def _vllm_keys(value: dict[str, Any]) -> None:
    """Refuses, by name, the keys of `structured_outputs` this server does not take."""
    for key, item in value.items():
        if key not in (*_KINDS, *_OPTIONS) and item is not None:
            raise ApiError(
                400,
                f"'structured_outputs.{key}' is not supported by this server "
                f"(supported: {', '.join((*_KINDS, *_OPTIONS))})",
                param=f"structured_outputs.{key}",
                code="unsupported_value",
            )


def _constraint(value: dict[str, Any]) -> pb.StructuredOutputs:
    kinds = [k for k in _KINDS if value.get(k) is not None]
    if len(kinds) != 1:
        raise invalid("structured_outputs", f"expected exactly one of {list(_KINDS)}")
    spec = _spec(f"structured_outputs.{kinds[0]}", kinds[0], value[kinds[0]])
    _options(spec, value)
    return spec


def _options(spec: pb.StructuredOutputs, value: dict[str, Any]) -> None:
    """Applies `structured_outputs`' options to `spec`."""
    _vllm_keys(value)
    compact = value.get("disable_any_whitespace")
    if compact is not None:
        if not isinstance(compact, bool):
            raise invalid("structured_outputs.disable_any_whitespace", "expected a boolean")
        if compact and spec.WhichOneof("kind") not in ("json_schema", "json_object"):
            raise invalid("structured_outputs.disable_any_whitespace", "only for JSON kinds")
        spec.disable_any_whitespace = compact


def apply_spec(
    params: pb.SamplingParams, spec: pb.StructuredOutputs | None, param: str, *, tools: bool
) -> dict[str, Any] | None:
    """Puts a request's structured-output `spec` (from field `param`) on its `params`; with
    `tools` the model may call, returns instead the JSON Schema its answer follows beside
    them (the grammar is built with the tools', calls.py). None when there is no spec."""
    if spec is None:
        return None
    if tools:
        return _answer_beside_tools(spec, param)
    params.structured_outputs.CopyFrom(spec)
    return None


def _answer_beside_tools(spec: pb.StructuredOutputs, param: str) -> dict[str, Any]:
    """The JSON Schema an answer follows when the model may also call tools (its grammar:
    calls or such an answer, tool_calls.call_grammar); only JSON specs combine so."""
    kind = spec.WhichOneof("kind")
    schema: object = {"type": "object"} if kind == "json_object" else None
    if kind == "json_schema":
        schema = json.loads(spec.json_schema)
    if not isinstance(schema, dict):
        raise invalid(
            param,
            "only a JSON Schema or a JSON object can be combined with tools the model may call",
        )
    if spec.disable_any_whitespace:  # the worker's compact JSON, in the gateway's grammar
        schema = {"x-guidance": COMPACT_JSON, **schema}
    return schema


def json_schema_spec(param: str, value: Any) -> pb.StructuredOutputs:
    """The spec of a JSON Schema given as an object (or its JSON text); errors name `param`."""
    return _spec(param, "json", value)


def _spec(param: str, kind: str, value: Any) -> pb.StructuredOutputs:
    """One constraint of `kind` (vLLM's names) from `value`; errors name `param`."""
    if kind == "json":
        if isinstance(value, str):
            value = json_text(value, param)
        if not isinstance(value, dict):
            raise invalid(param, "expected a JSON Schema (an object)")
        check_exact_numbers(value, param)  # beside tools it reaches the engine as Lark
        return pb.StructuredOutputs(json_schema=json.dumps(value, ensure_ascii=False))
    if kind == "json_object":
        if value is not True:
            raise invalid(param, "expected true")
        return pb.StructuredOutputs(json_object=True)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise invalid(param, "expected a non-empty array of non-empty strings")
        return pb.StructuredOutputs(choice=pb.StructuredChoice(choices=value))
    if not isinstance(value, str) or not value:
        raise invalid(param, "expected a non-empty string")
    if kind == "regex":
        return pb.StructuredOutputs(regex=value)
    if "::=" in value:
        return pb.StructuredOutputs(gbnf_grammar=value)
    return pb.StructuredOutputs(lark_grammar=value)


_TOOL_CALLS = re.compile(r"(messages\[\d+\])\.tool_calls_json")
# Where in the gateway's grammar llguidance found a problem ("at 4(9): ").
_GRAMMAR_AT = re.compile(r"^at \d+\(\d+\): ")


def _cause(detail: str) -> str:
    """An engine error about the gateway's grammar, without the grammar: its first line
    (without the position), and the reason a multi-line one gives last (a regex
    error's `error: ...` line, after the pattern it quotes)."""
    lines = detail.strip().splitlines() or [""]
    head = _GRAMMAR_AT.sub("", lines[0])
    for line in reversed(lines[1:]):
        if line.strip().startswith("error: "):
            return f"{head} {line.strip().removeprefix('error: ')}"
    return head


def request_error(
    exc: ApiError, param: str | None, *, anthropic: bool = False, own_grammar: bool = False
) -> ApiError:
    """A workers' 400 about a field the gateway filled, reworded to name the request's field.

    `param` is the field the structured-output spec came from (a forced tool
    call's grammar: `tools`); the tools given to the chat template are `tools`;
    an OpenAI message's `tool_calls` are the worker's `messages[i].tool_calls_json`
    (Anthropic's `tool_use` blocks: `messages`, whose indices the system shifts).
    The fleet names a prompt's text too large for a worker `messages` or `prompt`, and
    a request too large by its stop strings `sampling_params.stop`. It rewords the
    first message's error and an error met later, mid-answer (a spec's grammar
    reaching one of the engine's limits), alike. With `own_grammar` (the spec is a
    grammar the gateway wrote around the request's, beside tools) only its cause shows.
    """
    fields = {
        "tools_json": "tools",
        "messages: ": "messages",
        "prompt: ": "prompt",
        "sampling_params.stop: ": "stop_sequences" if anthropic else "stop",
        "sampling_params.ignore_eos ": "ignore_eos",
    }
    if param is not None:
        fields[WORKER_FIELD] = param
    if exc.status != 400:
        return exc
    calls = _TOOL_CALLS.match(exc.message)
    if calls is not None:
        fields[calls.group(0)] = "messages" if anthropic else f"{calls.group(1)}.tool_calls"
    for worker_field, name in fields.items():
        if exc.message.startswith(worker_field):
            rest = exc.message[len(worker_field) :]
            detail = rest if worker_field.endswith(" ") else exc.message.split(": ", 1)[-1]
            if name == "tools" or (own_grammar and name == param):  # the gateway's grammar
                detail = _cause(detail)
            return ApiError(
                400, f"Invalid value for '{name}': {detail}", param=name, code="invalid_value"
            )
    return exc
