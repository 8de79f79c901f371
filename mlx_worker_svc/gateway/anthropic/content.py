"""The content of Anthropic messages: text, tool_use and tool_result blocks, as ChatMessages.

schema.py's `parse_messages` reads a body's fields; this module reads what
its `system` and `messages` hold. Content is a string or an array of blocks:
`text` (its `cache_control` changes nothing), `tool_use` (an assistant's
calls, which become the message's `tool_calls_json`) and `tool_result` (a
user's answers, which become `tool` messages with the `tool_call_id` and
`name` of the call they answer). A block the turn cannot hold is a 400
naming it; a final assistant message is a prefill (`prefill_text`).
"""

from __future__ import annotations

import json
from typing import Any

from mlx_worker_svc.gateway.anthropic.thinking import EXTRA, is_thinking
from mlx_worker_svc.gateway.body import json_type, only_keys
from mlx_worker_svc.gateway.errors import ApiError, invalid
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

_EXTRA = EXTRA
# The fields each block takes; others are refused by name. A tool_use's `caller` and
# `toolset_name` (the anthropic SDK's, for programmatic calls and tool sets) change nothing.
BLOCK_KEYS = {
    "text": ("type", "text", "cache_control", "citations"),
    "tool_use": ("type", "id", "name", "input", "cache_control", "caller", "toolset_name"),
    "tool_result": (
        "type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name",
    ),
}  # fmt: skip


def system_messages(value: Any) -> list[pb.ChatMessage]:
    if value is None:
        return []
    text = value if isinstance(value, str) else _texts(value, "system", "text blocks are")
    return [pb.ChatMessage(role="system", content=text)] if text else []


def _texts(value: Any, where: str, allowed: str, *, assistant: bool = False) -> str:
    """The text of an array of text blocks, joined by newlines (an assistant's empty
    ones left out: see `_empty_answer`); another block is refused saying which are
    `allowed` there."""
    if not isinstance(value, list):
        raise invalid(where, "expected a string or an array of text blocks")
    texts = []
    for j, block in enumerate(value):
        if assistant and is_thinking(block, f"{where}[{j}]"):  # a prefill's: left out
            continue
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _unsupported(block, f"{where}[{j}]", allowed)
        _block_keys(block, "text", f"{where}[{j}]")
        if not (assistant and _empty_answer(block)):
            texts.append(_text(block, f"{where}[{j}]"))
    return "\n".join(texts)


def _empty_answer(block: dict[str, Any]) -> bool:
    """An assistant's empty text block: an answer cut to nothing has one (gateway.md)."""
    return block.get("type") == "text" and block.get("text") == ""


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text", "expected a string")
    if not text:
        raise invalid(f"{where}.text", "text content blocks must be non-empty")
    if block.get("citations"):  # null or [] (as the SDK dumps a text block) is none
        raise invalid(f"{where}.citations", "citations are not supported by this server")
    return text


def _unsupported(block: Any, where: str, allowed: str) -> ApiError:
    """The 400 for a content block the place does not take (`allowed`: those it takes)."""
    if not isinstance(block, dict):
        return invalid(where, f"expected a content block (an object), got {json_type(block)}")
    kind = block.get("type")
    what = "a block without a type" if kind is None else f"{kind!r} blocks"
    verb = "is" if kind is None else "are"
    return invalid(where, f"{what} {verb} not supported here ({allowed})")


def _block_keys(block: dict[str, Any], kind: str, where: str) -> None:
    """Refuses a field a block of `kind` does not take, and a malformed cache_control."""
    only_keys(block, BLOCK_KEYS[kind], where, _EXTRA)
    check_cache_control(block.get("cache_control"), f"{where}.cache_control")


def check_cache_control(value: Any, where: str) -> None:
    """`cache_control` (on the request, a block or a tool) changes nothing (the workers'
    prefix cache reuses every prompt); its shape is checked as Anthropic's API checks it."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise invalid(where, "expected an object with 'type': 'ephemeral'")
    only_keys(value, ("type", "ttl"), where, _EXTRA)
    if value.get("ttl") not in (None, "5m", "1h"):
        raise invalid(f"{where}.ttl", f"{value['ttl']!r} is not one of ['5m', '1h']")


def turn_messages(
    turn: Any, where: str, asked: dict[str, str], calls: dict[str, str]
) -> list[pb.ChatMessage]:
    """The ChatMessages of one user or assistant message.

    Its tool_result blocks answer (and take out of) `asked`, the tool_use
    blocks of the message before; its tool_use blocks go into `calls`.
    """
    if not isinstance(turn, dict):
        raise invalid(where, f"expected an object, got {json_type(turn)}")
    only_keys(turn, ("role", "content"), where, _EXTRA)
    role = turn.get("role")
    if role not in ("user", "assistant"):
        said = "Field required" if role is None else repr(role)
        raise invalid(f"{where}.role", f"{said}: one of ['assistant', 'user']")
    content = turn.get("content")
    if content in ("", []):
        raise invalid(
            f"{where}.content",
            "all messages must have non-empty content except for the optional final "
            "assistant message",
        )
    if isinstance(content, str):
        return [pb.ChatMessage(role=role, content=content)]
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "expected a string or an array of content blocks")
    texts: list[str] = []
    uses: list[dict[str, Any]] = []
    out: list[pb.ChatMessage] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in BLOCK_KEYS:
            _block_keys(block, kind, at)
        if role == "assistant" and (_empty_answer(block) or is_thinking(block, at)):
            continue
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use" and role == "assistant":
            uses.append(_tool_use(block, at, calls))
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(block, at, asked))
        else:
            allowed = "text and tool_use" if role == "assistant" else "text and tool_result"
            raise _unsupported(block, at, f"{allowed} blocks are")
    if texts or uses or not out:
        message = pb.ChatMessage(role=role, content="\n".join(texts))
        if uses:
            message.tool_calls_json = json.dumps(uses, ensure_ascii=False)
        out.append(message)
    return out


def _tool_use(block: dict[str, Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.id", "expected a non-empty string")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name", "expected a non-empty string")
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input", "expected an object")
    if call_id in names:
        raise invalid(f"{where}.id", f"`tool_use` ids must be unique: {call_id!r} is repeated")
    names[call_id] = name
    # OpenAI's shape, the arguments parsed, as chat templates read them (ChatMessage).
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(block: dict[str, Any], where: str, asked: dict[str, str]) -> pb.ChatMessage:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in asked:
        raise invalid(
            f"{where}.tool_use_id",
            f"unexpected tool_use_id found in tool_result blocks: {call_id}. Each tool_result "
            "block must have a corresponding tool_use block in the previous message.",
        )
    name = asked.pop(call_id)
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        allowed = "text, image and document blocks are"
        text = _texts(_visible(content, f"{where}.content"), f"{where}.content", allowed)
    failed = block.get("is_error")
    if failed is not None and not isinstance(failed, bool):
        raise invalid(f"{where}.is_error", "expected a boolean")
    if failed:  # the model reads the result as text: a line says the call failed
        text = f"{_FAILED}\n{text}" if text else _FAILED
    return pb.ChatMessage(role="tool", content=text, tool_call_id=call_id, name=name)


_FAILED = "[the tool call failed]"


# A tool's image or document, which a text model cannot read: the result says so in text.
_UNSEEN = {
    "image": "[an image the tool returned: this model reads text only]",
    "document": "[a document the tool returned: this model reads text only]",
}


def _visible(content: Any, where: str) -> Any:
    """A tool_result's content blocks with its images and documents written as a line of
    text saying so: an agent's tool (Claude Code's Read) returns them, and the result
    stays in every later turn's history, so a 400 would end the session."""
    if not isinstance(content, list):
        return content
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _UNSEEN:
            out.append(part)
            continue
        keys = ("type", "source", "cache_control", "title", "context", "citations")
        only_keys(part, keys, f"{where}[{j}]", _EXTRA)
        check_cache_control(part.get("cache_control"), f"{where}[{j}].cache_control")
        out.append({"type": "text", "text": _UNSEEN[kind]})
    return out


_PREFILL_BLOCKS = "a final assistant message, the answer's start, takes text and thinking blocks"


def prefill_text(turn: dict[str, Any], where: str) -> str:
    """The text a final assistant message starts the answer with."""
    only_keys(turn, ("role", "content"), where, _EXTRA)
    content = turn.get("content")
    text = (
        content
        if isinstance(content, str)
        else _texts(content, f"{where}.content", _PREFILL_BLOCKS, assistant=True)
    )
    if text != text.rstrip():
        raise invalid(
            f"{where}.content", "final assistant content cannot end with trailing whitespace"
        )
    return text
