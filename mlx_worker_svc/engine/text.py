"""Text in and out: tokenizing prompts and chats, and streaming detokenization.

Wraps the tokenizer mlx-lm loads (a Hugging Face tokenizer behind
`TokenizerWrapper`) so the worker never touches it directly, and turns
tokenizer failures into InvalidArgument with the reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)

from mlx_worker_svc.core.errors import FailedPrecondition, InvalidArgument
from mlx_worker_svc.core.generate import ChatMessage

ROLES = ("system", "user", "assistant", "tool")
# A chat template that renders tools reads the `tools` variable somewhere.
_READS_TOOLS = re.compile(r"\btools\b")
_READS_TOOL_CALLS = re.compile(r"\btool_calls\b")


def encode_text(tokenizer: TokenizerWrapper, text: str, *, add_special_tokens: bool) -> list[int]:
    """`text`'s token ids; `add_special_tokens` adds the tokenizer's (a BOS) as
    `mlx_lm.generate` does: not to a text that starts with the BOS token already."""
    bos = getattr(tokenizer, "bos_token", None)
    if add_special_tokens and bos and text.startswith(bos):
        add_special_tokens = False
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=add_special_tokens)]


def render_chat(
    tokenizer: TokenizerWrapper,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool,
    tools_json: str = "",
) -> tuple[list[int], str]:
    """Token ids and text of `messages` (and `tools_json`) rendered through the chat template."""
    if not tokenizer.has_chat_template:
        raise FailedPrecondition(
            "messages: the loaded model has no chat template (GetInfo's chat_template is "
            "empty): send the prompt as text"
        )
    payload = [_message(i, m) for i, m in enumerate(messages)]
    options: dict[str, Any] = {}
    tools = _objects(tools_json, "tools_json") if tools_json else []
    if tools:  # an empty array offers no tools, as none does
        options["tools"] = tools
        if not renders_tools(tokenizer):
            raise InvalidArgument(
                "tools_json: the model's chat template does not render tools "
                "(it never reads `tools`)"
            )
    calling = next((i for i, m in enumerate(messages) if m.tool_calls_json), None)
    if calling is not None and not _reads(tokenizer, _READS_TOOL_CALLS):
        raise InvalidArgument(
            f"messages[{calling}].tool_calls_json: the model's chat template does not render "
            "tool calls (it never reads `tool_calls`), so the model would not see them"
        )
    try:
        text = tokenizer.apply_chat_template(
            payload, tokenize=False, add_generation_prompt=add_generation_prompt, **options
        )
    except Exception as exc:  # jinja errors carry the template's own message
        raise InvalidArgument(
            f"messages could not be rendered by the chat template: {exc}"
        ) from exc
    return encode_text(tokenizer, str(text), add_special_tokens=False), str(text)


def renders_tools(tokenizer: TokenizerWrapper) -> bool:
    """Whether the chat template reads `tools` (renders the tools offered to the model)."""
    return _reads(tokenizer, _READS_TOOLS)


def _reads(tokenizer: TokenizerWrapper, name: re.Pattern[str]) -> bool:
    template = tokenizer.chat_template
    sources = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(s, str) and name.search(s) for s in sources)


def _message(i: int, message: ChatMessage) -> dict[str, Any]:
    """One message as chat templates read it (tool fields only where set)."""
    if message.role not in ROLES:
        raise InvalidArgument(
            f"messages[{i}].role is {message.role!r}; expected one of {', '.join(ROLES)}"
        )
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls_json:
        out["tool_calls"] = _tool_calls(message, f"messages[{i}].tool_calls_json")
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def _tool_calls(message: ChatMessage, field: str) -> list[dict[str, Any]]:
    """An assistant message's calls, each with its function's name (OpenAI's shape)."""
    if message.role != "assistant":
        raise InvalidArgument(
            f"{field}: only an assistant message makes tool calls (this one's role is "
            f"{message.role!r}): a chat template would drop them"
        )
    calls = _objects(message.tool_calls_json, field)
    for j, call in enumerate(calls):
        function = call.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidArgument(
                f"{field}[{j}].function.name: a call needs its function's name, in OpenAI's "
                'shape {"id", "type": "function", "function": {"name", "arguments"}}'
            )
    return calls


def _objects(value: str, field: str) -> list[dict[str, Any]]:
    """A JSON array of objects, or InvalidArgument naming `field`."""
    try:
        parsed = json.loads(value, parse_constant=_not_json)
    except ValueError as exc:
        raise InvalidArgument(f"{field}: not JSON ({exc})") from exc
    if not isinstance(parsed, list) or not all(isinstance(x, dict) for x in parsed):
        raise InvalidArgument(f"{field}: expected a JSON array of objects")
    return parsed


def _not_json(word: str) -> Any:
    """Python's json module reads NaN and Infinity, which JSON has not."""
    raise ValueError(f"{word} is not a JSON value")


def special_ids(tokenizer: TokenizerWrapper, eos_ids: Iterable[int]) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` leaves out, and the model's EOS ids:
    the named special tokens and every added token marked special (SmolLM2's
    `<repo_name>`, `<file_sep>`..., which `all_special_ids` does not list)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    marked = {int(i) for i, token in added.items() if getattr(token, "special", False)}
    return frozenset(int(t) for t in tokenizer.all_special_ids) | marked | frozenset(eos_ids)


def decode(tokenizer: TokenizerWrapper, ids: Sequence[int], *, skip_special_tokens: bool) -> str:
    return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def token_bytes(tokenizer: TokenizerWrapper, ids: Sequence[int]) -> list[bytes]:
    """Each token's own bytes: a piece of a multi-byte character is just its bytes.

    Byte-level BPE pieces (GPT-2's alphabet) map back to their bytes and
    SentencePiece's byte tokens (`<0xF0>`) to that byte, its `▁` to a space;
    a tokenizer of another kind, or a piece outside its alphabet (an added
    token), gives the UTF-8 of the token decoded alone.
    """
    kind = type(tokenizer.detokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    out = []
    for token, piece in zip(ids, pieces, strict=True):
        raw: bytes | None = None
        if isinstance(piece, str) and issubclass(kind, BPEStreamingDetokenizer):
            if all(c in _GPT2_BYTES for c in piece):
                raw = bytes(_GPT2_BYTES[c] for c in piece)
        elif isinstance(piece, str) and issubclass(kind, SPMStreamingDetokenizer):
            byte = _SPM_BYTE.fullmatch(piece)
            raw = bytes([int(byte[1], 16)]) if byte else piece.replace("\u2581", " ").encode()
        if raw is None:
            raw = str(tokenizer.decode([token])).encode()
        out.append(raw)
    return out


def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (its `bytes_to_unicode` inverted)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    shown = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in shown]
    shown |= {b: chr(256 + n) for n, b in enumerate(others)}
    return {c: b for b, c in shown.items()}


_GPT2_BYTES = _gpt2_bytes()
_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TextStream:
    """Incremental detokenization of one request's output.

    Decodes a small window (the previous piece plus the new tokens) rather
    than the whole output, and holds text back while it ends in an incomplete
    character, so the concatenated pieces equal `decode(all tokens)`.
    """

    def __init__(self, tokenizer: TokenizerWrapper, *, skip_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_ids
        self._tokens: list[int] = []
        self._prefix = 0
        self._read = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return str(self._tokenizer.decode(self._tokens[start:end]))

    def add(self, token: int) -> str:
        """Adds a token; returns the text it completed (may be empty)."""
        if token in self._skip:
            return ""
        self._tokens.append(token)
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return after[len(before) :]

    def take(self, tokens: Iterable[int], *, last: bool = False) -> str:
        """Adds `tokens`; returns the text they completed, and with `last` all held back."""
        text = "".join([self.add(token) for token in tokens])
        return text + self.finish() if last else text

    def finish(self) -> str:
        """Returns text held back waiting for more tokens."""
        before = self._decode(self._prefix, self._read)
        after = self._decode(self._prefix)
        self._prefix = self._read = len(self._tokens)
        return after[len(before) :]
