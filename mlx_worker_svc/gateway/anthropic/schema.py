"""Anthropic Messages bodies in, a fleet `GenerateRequest` out, or an `ApiError` naming the field.

`/v1/messages` takes `model`, `messages` and `max_tokens` (required, as
Anthropic's API requires them), `system` (a string or text blocks),
`stop_sequences`, `stream`, `temperature` (0 to 1), `top_p`, `top_k`,
`metadata` (`user_id`), `tools`, `tool_choice` and `output_config` (a JSON
Schema the answer follows); `/v1/messages/count_tokens` takes `model`,
`messages`, `system`, `tools` and `tool_choice`. The messages' content
(text, tool_use and tool_result blocks) is content.py's; a final assistant
message is a prefill: the answer continues its text. As with the OpenAI
routes, a field the endpoint does not know is a 400 naming it, and one it
knows but cannot honour (images, documents, server tools) is a 400 that
says so; `thinking` and thinking blocks are thinking.py's.

Tools map onto the OpenAI routes' `ToolRequest`: `input_schema` is a function's
`parameters`, and `tool_choice` `auto`, `any`, `tool` and `none` are OpenAI's
`auto`, `required`, a named function and `none`
(`disable_parallel_tool_use`: `parallel_tool_calls: false`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_worker_svc.gateway.anthropic.content import (
    check_cache_control,
    prefill_text,
    system_messages,
    turn_messages,
)
from mlx_worker_svc.gateway.anthropic.thinking import (
    EXTRA,
    check_context_management,
    check_thinking,
)
from mlx_worker_svc.gateway.body import Fields, json_type, only_keys
from mlx_worker_svc.gateway.errors import ApiError, invalid
from mlx_worker_svc.gateway.sampling import UINT32, apply_top_p
from mlx_worker_svc.gateway.schema import ParsedRequest
from mlx_worker_svc.gateway.structured import apply_spec, json_schema_spec
from mlx_worker_svc.gateway.tools import Choice, ToolRequest, check_function
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

MAX_STOP_SEQUENCES = 16
_COUNT_FIELDS = {
    "model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control",
    "context_management", "output_config", "speed", "user_profile_id", "workspace_id",
}  # fmt: skip
# Strings the SDK types that route or attribute a request at Anthropic: checked, no effect.
_LABELS = ("inference_geo", "user_profile_id", "workspace_id")
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
_CREATE_FIELDS = _COUNT_FIELDS | {
    "max_tokens",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "service_tier",
    "output_config",
    "inference_geo",
    "diagnostics",
}
# Known to Anthropic, not honoured here (None/absent is fine).
_UNSUPPORTED = {
    "container": "containers are not supported by this server",
    "mcp_servers": "MCP servers are not supported by this server",
}
_EXTRA = EXTRA
# The fields a tool takes (others are refused by name); its opt-in beta hints change nothing.
_TOOL_KEYS = (
    "type", "name", "description", "input_schema", "cache_control", "strict",
    "eager_input_streaming", "input_examples", "defer_loading", "allowed_callers",
)  # fmt: skip
_CHOICES: dict[str, Choice] = {
    "auto": "auto",
    "any": "required",
    "tool": "function",
    "none": "none",
}


@dataclass(frozen=True)
class MessagesRequest:
    """One Anthropic request: the fleet request, and the assistant text it continues."""

    parsed: ParsedRequest
    prefill: str  # the text of a final assistant message ("" when there is none)


def parse_messages(body: Any, id_base: str, *, count: bool = False) -> MessagesRequest:
    """Validates a `/v1/messages` body (`count`: a count_tokens body); raises `ApiError`.
    The answer's id is built on `id_base` (request_ids.base)."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    known = _COUNT_FIELDS if count else _CREATE_FIELDS
    for name in body:
        if name in _UNSUPPORTED and body[name] is not None:
            raise ApiError(400, f"{name}: {_UNSUPPORTED[name]}", param=name)
        if name not in known and name not in _UNSUPPORTED:
            raise ApiError(400, f"{name}: Extra inputs are not permitted", param=name)
    fields = Fields(body)
    model = fields.get("model")
    if model is None or model == "":  # required, as Anthropic's API has it
        raise invalid("model", "Field required (a non-empty string)")
    if not isinstance(model, str):
        raise invalid("model", f"expected a string, got {json_type(model)}")
    tools = _tools(fields.get("tools"), fields.get("tool_choice"))
    messages = system_messages(fields.get("system"))
    turns = fields.get("messages")
    if not isinstance(turns, list) or not turns:
        raise invalid("messages", "expected a non-empty array of messages")
    prefill = ""
    # As Anthropic's API: the tool_use blocks of an assistant message are each
    # answered by a tool_result block of the next message, and only they.
    calls: dict[str, str] = {}  # the last turn's tool_use ids -> their tools' names
    for i, turn in enumerate(turns):
        asked, calls = calls, {}
        if i == len(turns) - 1 and isinstance(turn, dict) and turn.get("role") == "assistant":
            prefill = prefill_text(turn, f"messages[{i}]")
        else:
            messages += turn_messages(turn, f"messages[{i}]", asked, calls)
        if asked:  # left unanswered
            raise invalid(
                f"messages[{i - 1}]",
                f"tool_use ids were found without tool_result blocks immediately after: "
                f"{', '.join(asked)}. Each tool_use block must have a corresponding "
                "tool_result block in the next message.",
            )
    if not any(m.role != "system" for m in messages):
        raise invalid("messages", "a user message must come before the assistant's prefill")
    params = pb.SamplingParams() if count else _sampling(fields)
    check_thinking(fields.get("thinking"), None if count else params.max_tokens)
    check_context_management(fields.get("context_management"), fields.get("thinking"))
    _labels(fields)
    spec = _output_config(fields.get("output_config"))
    if count:  # the answer's format is no part of the prompt
        spec = None
    if prefill and (spec is not None or tools.forced):
        # The grammar would start after the prefill's text, which it does not know.
        where = "output_config.format" if spec is not None else "tool_choice"
        raise invalid(
            where,
            "cannot be combined with a prefill (a final assistant message): the "
            "constrained answer starts the assistant's text",
        )
    answer_schema = apply_spec(params, spec, "output_config.format", tools=tools.may_call)
    check_cache_control(fields.get("cache_control"), "cache_control")
    request = pb.GenerateRequest(
        messages=messages, sampling_params=params, request_id=f"msg_{id_base}"
    )
    parsed = ParsedRequest(
        kind="messages",
        id=request.request_id,
        model=model,
        generate=request,
        stream=False if count else fields.boolean("stream"),
        include_usage=False,
        logprobs=None,
        tools=tools,
        structured_param="output_config.format" if spec is not None else None,
        answer_schema=answer_schema,
    )
    return MessagesRequest(parsed, prefill)


def _sampling(fields: Fields) -> pb.SamplingParams:
    params = pb.SamplingParams()
    max_tokens = fields.integer("max_tokens", 1, UINT32)
    if max_tokens is None:
        raise invalid("max_tokens", "Field required")
    params.max_tokens = max_tokens
    # Anthropic's default temperature is 1, which is also the workers'.
    temperature = fields.number("temperature", 0.0, 1.0)
    if temperature is not None:
        params.temperature = temperature
    top_p = fields.number("top_p", 0.0, 1.0)
    params.top_k = fields.integer("top_k", 0, UINT32 >> 1) or 0
    apply_top_p(params, top_p)
    stops = fields.get("stop_sequences")
    stops = [] if stops is None else stops  # null is absent; false, 0 or "" are not lists
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop_sequences", "expected an array of non-empty strings")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid("stop_sequences", f"at most {MAX_STOP_SEQUENCES}, got {len(stops)}")
    params.stop.extend(stops)
    _metadata(fields.get("metadata"))
    tier = fields.get("service_tier")
    if tier not in (None, "auto", "standard_only"):
        raise invalid("service_tier", f"{tier!r} is not one of ['auto', 'standard_only']")
    _diagnostics(fields.get("diagnostics"))
    return params


def _labels(fields: Fields) -> None:
    """`speed` and the fields that route or attribute a request at Anthropic: checked,
    and they change nothing (this server has one speed, one place, one workspace)."""
    speed = fields.get("speed")  # Claude Code's /fast
    if speed not in (None, "fast", "standard"):
        raise invalid("speed", f"{speed!r} is not one of ['fast', 'standard']")
    for name in _LABELS:
        value = fields.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(name, f"expected a string, got {json_type(value)}")


def _diagnostics(value: Any) -> None:
    """`diagnostics.previous_message_id` asks Anthropic why a prompt-cache prefix was not
    reused; this server reports no `diagnostics` (its prefix cache is per worker)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("diagnostics", f"expected an object, got {json_type(value)}")
    only_keys(value, ("previous_message_id",), "diagnostics", _EXTRA)
    previous = value.get("previous_message_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid("diagnostics.previous_message_id", "expected a string or null")


def _metadata(value: Any) -> None:
    """`metadata` identifies the caller (`user_id`, for logs); it changes nothing."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("metadata", f"expected an object, got {json_type(value)}")
    for key, item in value.items():
        if key != "user_id":
            raise invalid(f"metadata.{key}", "Extra inputs are not permitted")
        if item is not None and not isinstance(item, str):
            raise invalid("metadata.user_id", "expected a string")


def _output_config(value: Any) -> pb.StructuredOutputs | None:
    """`output_config`: `format` (a JSON Schema the answer follows, enforced by the
    workers' grammar engine) and `effort` (accepted; it changes nothing here)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("output_config", f"expected an object, got {json_type(value)}")
    for key in value:
        if key not in ("effort", "format"):
            raise invalid(f"output_config.{key}", "Extra inputs are not permitted")
    effort = value.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise invalid("output_config.effort", f"{effort!r} is not one of {list(_EFFORTS)}")
    form = value.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        raise invalid("output_config.format", "expected an object with 'type': 'json_schema'")
    for key in form:
        if key not in ("type", "schema"):
            raise invalid(f"output_config.format.{key}", "Extra inputs are not permitted")
    schema = form.get("schema")
    if schema is None:
        raise invalid("output_config.format.schema", "Field required (a JSON Schema object)")
    if not isinstance(schema, dict):
        raise invalid(
            "output_config.format.schema", f"expected a JSON Schema object, got {json_type(schema)}"
        )
    spec = json_schema_spec("output_config.format.schema", form["schema"])
    spec.disable_any_whitespace = True  # compact JSON, as Claude's answers have it
    return spec


def _tools(value: Any, choice: Any) -> ToolRequest:
    tools: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    if value is not None and not isinstance(value, list):
        raise invalid("tools", "expected an array of tools")
    for i, tool in enumerate(value or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(where, f"expected an object, got {json_type(tool)}")
        if tool.get("type", "custom") not in ("custom", None):
            raise invalid(f"{where}.type", f"server tools ({tool['type']!r}) are not supported")
        only_keys(tool, _TOOL_KEYS, where, _EXTRA)
        check_function(tool, where, "input_schema", names)
        check_cache_control(tool.get("cache_control"), f"{where}.cache_control")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"{where}.input_schema", "Field required (a JSON Schema object)")
        description = tool.get("description")  # a string (check_function)
        # The OpenAI route's function, key for key in its order: the template shows
        # the tool as JSON, so the same tool is the same prompt on both routes.
        function: dict[str, Any] = {"name": tool["name"]}
        if description is not None:  # "" too: the OpenAI route passes it as it is
            function["description"] = description
        function["parameters"] = schema
        if tool.get("strict"):  # the whole schema holds the input, as OpenAI's strict function's
            function["strict"] = True
        tools.append(function)
    return _tool_choice(choice, tuple(tools))


def _tool_choice(value: Any, tools: tuple[dict[str, Any], ...]) -> ToolRequest:
    if value is None:
        return ToolRequest(tools)
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in _CHOICES:
        raise invalid("tool_choice", f"expected an object with 'type' one of {list(_CHOICES)}")
    only_keys(value, ("type", "name", "disable_parallel_tool_use"), "tool_choice", _EXTRA)
    parallel = Fields(value, "tool_choice").boolean("disable_parallel_tool_use") is False
    name = value.get("name")
    if kind == "tool":
        if not isinstance(name, str):
            raise invalid("tool_choice.name", "Field required (the name of a tool in 'tools')")
        if name not in {t["name"] for t in tools}:
            raise invalid("tool_choice.name", f"no tool named {name!r} is in 'tools'")
    elif name is not None:
        raise invalid("tool_choice.name", "only for 'type': 'tool'")
    if kind == "any" and not tools:
        raise invalid("tool_choice", "'any' needs 'tools'")
    return ToolRequest(tools, _CHOICES[kind], name if kind == "tool" else None, parallel)
