"""Tool calls in the model's own format: the grammar that forces one, the parser that finds them.

The format follows the model's chat template (`tool_format`):

- `hermes` (Hermes, Qwen, and any template without another marker):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block a call;
- `llama3_json` (templates with `<|python_tag|>` or the `ipython` role): a bare
  `{"name": ..., "parameters": {...}}` object (several separated by `;`);
- `mistral` (templates with `[TOOL_CALLS]`): `[TOOL_CALLS]` then a JSON array of
  `{"name": ..., "arguments": {...}}` (the marker is a special token, so the
  text may show only the array).

`call_grammar` is the Lark grammar (llguidance's dialect, with `%json` for the
arguments, so they validate against each tool's `parameters` schema) of one
call, or of one or more with `parallel`, of the given tools: what
`tool_choice` "required" or a named function constrains the output to.

`ToolCallParser` reads the output as it streams: text before a call is content
(streamed at once, less a tail that could begin a call's marker); a call is
emitted when its text is complete, as `Call(index, id, name, arguments)`; text
that looked like a call but does not parse is content after all. A parser fed
the whole text at once gives what it gives a stream, so both paths agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from mlx_worker_svc.gateway.relaxed import relaxed

Format = Literal["hermes", "llama3_json", "mistral"]
# The key that holds a call's arguments, per format.
ARGUMENTS: dict[Format, str] = {
    "hermes": "arguments",
    "llama3_json": "parameters",
    "mistral": "arguments",
}
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL = "[TOOL_CALLS]"
_PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# The arguments' JSON as the chat templates render it (Python's json.dumps).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_format(chat_template: str) -> Format:
    """The tool-call format the chat template teaches the model."""
    if _MISTRAL in chat_template:
        return "mistral"
    if _HERMES_OPEN in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return "hermes"


_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def call_grammar(
    tools: tuple[dict[str, Any], ...],
    fmt: Format,
    *,
    parallel: bool,
    answer: dict[str, Any] | None = None,
) -> str:
    """The Lark grammar of one call (or, with `parallel`, one or more) of `tools`; with
    `answer` (a JSON Schema), of either those calls or an answer of that schema."""
    key = ARGUMENTS[fmt]
    rules = []
    for i, tool in enumerate(tools):
        head = f'{{"name": {json.dumps(tool["name"])}, "{key}": '
        parameters = tool.get("parameters")
        # OpenAI: "Omitting parameters defines a function with an empty parameter list."
        schema = dict(_NO_PARAMETERS if parameters is None else parameters or {"type": "object"})
        schema.setdefault("type", "object")  # arguments are an object (tools.check_function)
        if tool.get("strict") is not True:  # OpenAI's default: not held to every keyword
            schema = relaxed(schema)
        schema.setdefault("x-guidance", _JSON_STYLE)
        opening, closing = head, "}"
        if fmt == "hermes":
            opening, closing = f"{_HERMES_OPEN}\n{head}", f"}}\n{_HERMES_CLOSE}"
        body = f"{_lit(opening)} args_{i} {_lit(closing)}"
        rules += [f"call_{i}: {body}", f"args_{i}: %json {json.dumps(schema)}"]
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    separator = {"hermes": "\n", "llama3_json": "; ", "mistral": ", "}[fmt]
    more = f" ({_lit(separator)} call)*" if parallel else ""
    sequence = (
        f"{_lit(_MISTRAL + '[')} call{more} {_lit(']')}" if fmt == "mistral" else f"call{more}"
    )
    if answer is None:
        return "\n".join([f"start: {sequence}", f"call: {calls}", *rules])
    # Structured output beside tools (OpenAI's response_format with tools): the model
    # calls tools or answers in the schema.
    schema = {"x-guidance": _JSON_STYLE, **answer}
    top = ["start: calls | answer", f"calls: {sequence}", f"answer: %json {json.dumps(schema)}"]
    return "\n".join([*top, f"call: {calls}", *rules])


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes)."""
    return json.dumps(text)


@dataclass(frozen=True)
class Call:
    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


Event = str | Call  # content text, or a complete call


class ToolCallParser:
    """Splits a streamed output into content and tool calls (see the module doc)."""

    def __init__(self, fmt: Format, *, parallel: bool = True) -> None:
        self.fmt = fmt
        self.parallel = parallel  # False: calls after the first are dropped
        self._text = ""  # everything fed so far
        self._sent = 0  # characters of content emitted
        self._calls_at: int | None = None  # where the calls begin, once seen
        self._parsed = 0  # where the calls not parsed yet begin
        self.calls: list[Call] = []
        self._emitted = 0  # calls emitted

    def feed(self, piece: str) -> list[Event]:
        """Takes the next text of the output; returns what can be emitted now."""
        self._text += piece
        out: list[Event] = []
        if self._calls_at is None:
            start = self._calls_start()
            end = len(self._text) - self._held_tail() if start is None else start
            piece = self._text[self._sent : end]
            if piece and (start is None or piece.strip()):  # no blank text just before calls
                out.append(piece)
            self._sent = max(self._sent, end)
            if start is None:
                return out
            self._calls_at = self._parsed = start
        if self.fmt == "hermes":
            for match in _HERMES_BLOCK.finditer(self._text, self._parsed):
                found = self._values(match.group(1))
                if len(found) != 1:
                    break
                self._add(found)
                self._parsed = match.end()
        return out + self._new_calls()

    def finish(self) -> list[Event]:
        """The rest, at the end of the output."""
        rest = self._text[self._parsed if self._calls_at is not None else self._sent :]
        found = self._rest_calls(rest) if self._calls_at is not None else None
        out: list[Event] = []
        if found is None:
            if rest.strip() or not self.calls:  # text after all
                out.append(self._text[max(self._sent, self._parsed) :])
        else:
            self._add(found)
        self._sent = self._parsed = len(self._text)
        return [e for e in out if e] + self._new_calls()

    def _new_calls(self) -> list[Event]:
        new: list[Event] = list(self.calls[self._emitted :])
        self._emitted = len(self.calls)
        return new

    def _rest_calls(self, region: str) -> list[tuple[str, str]] | None:
        """The calls in what is left of the calls region; None when it is not calls."""
        text = region.strip()
        if self.fmt == "hermes":
            if not text:
                return []
            if text.startswith(_HERMES_OPEN):  # an unclosed last block
                found = self._values(text.removeprefix(_HERMES_OPEN))
                return found if len(found) == 1 else None
            return None
        if self.fmt == "mistral":
            values = _json_values(text.removeprefix(_MISTRAL).strip())
            if len(values) != 1 or not isinstance(values[0], list) or not values[0]:
                return None
            found = [c for c in map(self._call, values[0]) if c is not None]
            return found if len(found) == len(values[0]) else None
        values = _json_values(text.removeprefix(_PYTHON_TAG), ";")
        found = [c for c in map(self._call, values) if c is not None]
        return found if found and len(found) == len(values) else None

    def _values(self, text: str) -> list[tuple[str, str]]:
        """The one call `text` holds as JSON, as a list ([] when it holds no call)."""
        values = _json_values(text)
        call = self._call(values[0]) if len(values) == 1 else None
        return [call] if call is not None else []

    def _call(self, value: Any) -> tuple[str, str] | None:
        """(name, arguments as JSON text) of one call's JSON value, or None."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(ARGUMENTS[self.fmt], value.get("arguments", value.get("parameters")))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return value["name"], json.dumps(arguments, ensure_ascii=False)

    def _add(self, found: list[tuple[str, str]]) -> None:
        for name, arguments in found:
            if self.parallel or not self.calls:
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                self.calls.append(Call(len(self.calls), call_id, name, arguments))

    def _calls_start(self) -> int | None:
        """Where the calls begin in the text, once that is known."""
        text = self._text
        if self.fmt == "hermes":
            at = text.find(_HERMES_OPEN)
            return None if at == -1 else at
        if self.fmt == "mistral":
            at = text.find(_MISTRAL)
            if at != -1:
                return at
        # A bare JSON value opening the output: llama3_json's object, mistral's array.
        stripped = text.lstrip()
        opener = "{" if self.fmt == "llama3_json" else "["
        if self.fmt == "llama3_json" and stripped.startswith(_PYTHON_TAG):
            return len(text) - len(stripped)
        if self._sent == 0 and stripped.startswith(opener):
            return len(text) - len(stripped)
        return None

    def _held_tail(self) -> int:
        """Characters at the end held back: they could begin a call."""
        text = self._text
        if self._sent == 0 and not text.strip():
            return len(text)  # only whitespace yet: a bare JSON call may follow
        markers = {"hermes": [_HERMES_OPEN], "mistral": [_MISTRAL], "llama3_json": []}[self.fmt]
        if self._sent == 0 and self.fmt == "llama3_json":
            markers = [_PYTHON_TAG]
        for marker in markers:
            for size in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:size]):
                    return size
        return 0


def _json_values(text: str, separator: str = "") -> list[Any]:
    """The JSON values `text` holds back to back (whitespace or `separator` between)."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or (separator and text[at] == separator)):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return []
        values.append(value)
