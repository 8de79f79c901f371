"""Chat's tool fields (`tools`, `tool_choice`, `parallel_tool_calls`), read in one place.

Agent and IDE clients send these on every call, most often as "no tools":
`tools: []`, `tool_choice: "none"`, or `"auto"` with nothing to call. Those
are no-ops. Tool calling itself is not served yet, so a request whose answer
could be a tool call (a tool with `tool_choice` `"auto"`, the default, or
`"required"` or a named function) is a 400 naming the field that asks for it;
tools offered under `"none"` are accepted and not shown to the model, which
answers in text as `"none"` asks. `parse_tools` validates the shapes in full,
so serving tool calls later only has to consume a `ToolRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

from mlx_worker_svc.gateway.errors import ApiError, invalid

Choice = Literal["none", "auto", "required", "function"]
_MODES = ("none", "auto", "required")


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


def parse_tools(body: dict[str, Any]) -> ToolRequest:
    """The request's tool fields; raises `ApiError` (400) naming the bad or unserved field."""
    tools = _tools(body.get("tools"))
    choice, function = _choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", f"expected a boolean, got {parallel!r}")
    request = ToolRequest(tools, choice, function, True if parallel is None else parallel)
    if request.may_call:
        param = "tools" if choice == "auto" else "tool_choice"
        raise ApiError(
            400,
            f"'{param}': tool calls are not supported by this server; send no tools, "
            "or tool_choice 'none' for an answer in text",
            param=param,
            code="unsupported_value",
        )
    return request


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid("tools", "expected an array of tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(where, "expected an object with type 'function'")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", "expected an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.function.name", "expected a non-empty string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters", "expected a JSON Schema object")
        out.append(function)
    return tuple(out)


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
    if name not in {t["name"] for t in tools}:
        raise invalid("tool_choice", f"no tool named {name!r} is in 'tools'")
    return "function", name
