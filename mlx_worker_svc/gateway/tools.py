"""Chat's tool fields (`tools`, `tool_choice`, `parallel_tool_calls`) and tool messages.

`parse_tools` validates the tool fields in full. Agent and IDE clients send
them on every call, most often as "no tools": `tools: []`, `tool_choice:
"none"`, or `"auto"` with nothing to call; those are no-ops, and tools offered
under `"none"` are not shown to the model, which answers in text. Otherwise
(`may_call`) the tools go to the chat template, and `"required"` or a named
function constrains the output to a call (tool_calls.py). `history` reads the
tool fields of earlier messages: an assistant's `tool_calls` (their JSON
`arguments` parsed, as chat templates read them; arguments that are no JSON
object go as the text they are, as OpenAI takes any string) and a tool
message's `tool_call_id` and `name`.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Literal, cast

import regress
from jsonschema import Draft202012Validator, FormatChecker, validators

from mlx_worker_svc.gateway.body import check_description, json_type, only_keys
from mlx_worker_svc.gateway.errors import invalid
from mlx_worker_svc.gateway.structured import check_exact_numbers

Choice = Literal["none", "auto", "required", "function"]
_MODES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_PLAIN = re.compile(r"[A-Za-z_$][A-Za-z0-9_$-]*")  # a schema key written .name in a path


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request says about tools."""

    tools: tuple[dict[str, Any], ...] = ()  # the `function` objects offered
    choice: Choice = "auto"  # tool_choice; "function": the one named `function`
    function: str | None = None
    parallel: bool = True  # parallel_tool_calls

    @property
    def may_call(self) -> bool:
        """Whether the answer could be a tool call."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> tuple[dict[str, Any], ...]:
        """The tools the answer must call one of: all ("required"), the named one, or none."""
        if self.choice == "required":
            return self.tools
        return tuple(
            t for t in self.tools if self.choice == "function" and t["name"] == self.function
        )

    def tools_json(self) -> str:
        """The tools as the chat template takes them (GenerateRequest.tools_json)."""
        offered = [{"type": "function", "function": t} for t in self.tools]
        return json.dumps(offered, ensure_ascii=False)


def parse_tools(body: dict[str, Any]) -> ToolRequest:
    """The request's tool fields; raises `ApiError` (400) naming the bad field."""
    tools = _tools(body.get("tools"))
    choice, function = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", f"expected a boolean, got {parallel!r}")
    return ToolRequest(tools, choice, function, True if parallel is None else parallel)


def history(message: dict[str, Any], where: str) -> dict[str, str]:
    """The `ChatMessage` tool fields of one request message (`where` names it in errors)."""
    out: dict[str, str] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant":
            raise invalid(f"{where}.tool_calls", "only assistant messages have tool calls")
        if not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls", "expected an array of tool calls")
        parsed = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        ids = [call["id"] for call in parsed]
        for j, call_id in enumerate(ids):
            if call_id in ids[:j]:  # a tool message would answer which?
                raise invalid(
                    f"{where}.tool_calls[{j}].id",
                    f"tool call ids must be unique in a message: {call_id!r} is repeated",
                )
        out["tool_calls_json"] = json.dumps(parsed, ensure_ascii=False)
    for name in ("tool_call_id", "name"):
        value = message.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise invalid(f"{where}.{name}", "expected a string")
        if name == "tool_call_id" and message.get("role") != "tool":
            raise invalid(f"{where}.{name}", "only tool messages answer a tool call")
        out[name] = value
    if message.get("role") == "tool" and "tool_call_id" not in out:
        raise invalid(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
    return out


def check_tool_answers(messages: list[dict[str, Any]]) -> None:
    """Refuses a history whose tool messages and calls do not pair up, as OpenAI does.

    Each tool message answers a call of the assistant message before the run
    of tool messages it is in, and each such call is answered before the next
    other message. (`messages` are already checked one by one.)
    """
    calls: dict[str, int] = {}  # the open calls' ids -> their assistant message's index
    for i, message in enumerate([*messages, None]):
        role = None if message is None else message.get("role")
        if role == "tool":
            assert message is not None
            call_id = message["tool_call_id"]
            if calls.pop(call_id, None) is None:
                raise invalid(
                    f"messages[{i}].tool_call_id",
                    f"{call_id!r} answers no call: a tool message must answer a call of the "
                    "assistant message with 'tool_calls' before it",
                )
            continue
        if calls:
            at = next(iter(calls.values()))
            raise invalid(
                f"messages[{at}].tool_calls",
                "an assistant message with 'tool_calls' must be followed by tool messages "
                f"answering each call; these have none: {', '.join(sorted(calls))}",
            )
        if role == "assistant":
            assert message is not None
            calls = {c["id"]: i for c in message.get("tool_calls") or ()}


def _history_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise invalid(where, "expected an object with type 'function'")
    # `index` (a streamed call's) and `parsed_arguments` (the openai SDK's parse()):
    # what clients send back of an answer, read as nothing.
    only_keys(call, ("id", "type", "function", "index"), where)
    if isinstance(function, dict):
        only_keys(function, ("name", "arguments", "parsed_arguments"), f"{where}.function")
    if not isinstance(call.get("id"), str):
        raise invalid(f"{where}.id", "expected a string")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid(f"{where}.function", "expected an object with a 'name' string")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise invalid(f"{where}.function.arguments", "expected a string (JSON text)")
    try:
        parsed: Any = json.loads(arguments)
    except ValueError:
        parsed = None
    # As OpenAI takes any string here: a model's malformed call (its tool answered with
    # an error) stays in the history, and goes to the template as the text it was.
    return {
        "id": call["id"],
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": parsed if isinstance(parsed, dict) else arguments,
        },
    }


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid("tools", "expected an array of tools")
    out = []
    names: dict[str, str] = {}
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(where, "expected an object with type 'function'")
        only_keys(tool, ("type", "function"), where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", "expected an object")
        only_keys(function, ("name", "description", "parameters", "strict"), f"{where}.function")
        check_function(function, f"{where}.function", "parameters", names)
        out.append(function)
    return tuple(out)


def check_function(
    function: dict[str, Any], where: str, schema_field: str, names: dict[str, str]
) -> None:
    """Refuses a tool whose name (unique: `names`, those seen, and where) or parameter
    schema (at `schema_field`) is not usable, whether or not the answer must call it."""
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"{where}.name", "expected a string of a-z, A-Z, 0-9, _ and -, at most 64")
    if name in names:
        raise invalid(f"{where}.name", f"tool names must be unique: {names[name]} is {name!r}")
    names[name] = where
    check_description(function, where)
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.strict", f"expected a boolean, got {json_type(strict)}")
    parameters = function.get(schema_field)
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid(f"{where}.{schema_field}", "expected a JSON Schema object")
    # Arguments are a JSON object (a call's `arguments`, a `tool_use`'s `input`),
    # as OpenAI's and Anthropic's APIs require of the schema.
    kind = (parameters or {}).get("type", "object")
    if kind != "object":
        raise invalid(
            f"{where}.{schema_field}.type",
            f"a tool's arguments are a JSON object: the schema's type must be 'object', "
            f"got {json.dumps(kind)}",
        )
    if parameters:
        problem = _schema_problem(json.dumps(parameters, sort_keys=True))
        if problem is not None:
            path, message = problem
            raise invalid(f"{where}.{schema_field}{_path(path)}", message)
        if function.get("strict") is True:  # one that is not strict is relaxed instead
            check_exact_numbers(parameters, f"{where}.{schema_field}")


@functools.lru_cache(maxsize=1024)  # agents send the same tools with every call
def _schema_problem(schema_json: str) -> tuple[tuple[str | int, ...], str] | None:
    """Where and why a tool's schema is not JSON Schema (its `$schema`'s draft, else
    2020-12, as Anthropic's API checks it); None when it is."""
    schema = json.loads(schema_json)
    uri = schema.get("$schema", "")
    if not isinstance(uri, str):
        return ("$schema",), "expected a string (the URI of a JSON Schema draft)"
    draft = _draft(uri)
    meta = validators.validator_for(draft.META_SCHEMA, default=draft)
    error = next(
        iter(meta(draft.META_SCHEMA, format_checker=_formats(draft)).iter_errors(schema)), None
    )
    if error is None:
        return None
    return tuple(error.absolute_path), f"not valid JSON Schema: {error.message}"


def _ecma_regex(pattern: object) -> bool:
    """Whether `pattern` is a regex as JSON Schema reads it: ECMA-262's, not Python's."""
    return not isinstance(pattern, str) or bool(regress.Regex(pattern))


@functools.cache
def _draft(uri: str) -> Any:
    """The validator of the draft `uri` names (drafts 3 to 7 are named with http://; a
    https:// spelling means the same draft); 2020-12's for none, or one unknown."""
    for name in (uri, uri.replace("https://", "http://", 1)):
        draft = validators.validator_for({"$schema": name}, default=cast(Any, None))
        if draft is not None:
            return draft
    return Draft202012Validator


@functools.cache
def _formats(draft: Any) -> FormatChecker:
    """The draft's format checks, its `regex` ECMA-262's (jsonschema's own is Python's)."""
    checker: FormatChecker = copy.copy(draft.FORMAT_CHECKER)
    checker.checkers = {**checker.checkers, "regex": (_ecma_regex, regress.RegressError)}
    return checker


def _path(parts: tuple[str | int, ...]) -> str:
    """A place in a schema: `.name`, or `["a.b"]` for a name that would read as a path,
    and `[i]` for an index."""
    return "".join(
        f"[{part}]"
        if isinstance(part, int)
        else f".{part}"
        if _PLAIN.fullmatch(part)
        else f"[{json.dumps(part)}]"
        for part in parts
    )


def _choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[Choice, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in _MODES:
            raise invalid("tool_choice", f"{value!r} is not one of {list(_MODES)}")
        if value == "required" and not tools:
            raise invalid("tool_choice", "'required' needs 'tools'")
        return cast(Choice, value), None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise invalid(
            "tool_choice",
            "expected 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
        )
    only_keys(value, ("type", "function"), "tool_choice")
    only_keys(cast(dict[str, Any], function), ("name",), "tool_choice.function")
    if name not in {t["name"] for t in tools}:
        raise invalid("tool_choice", f"no tool named {name!r} is in 'tools'")
    return "function", name
