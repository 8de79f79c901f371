"""Fleet `GenerateResponse` messages out as OpenAI objects: completions, chunks, usage, logprobs.

`Reply` holds one request's answer as it streams: each fleet message becomes
one chunk (chat: `chat.completion.chunk` with a `delta`; legacy:
`text_completion`), and the messages of a whole request become one
`chat.completion` or `text_completion`. Logprobs need each token's bytes, which
only the workers' tokenizer knows: `TokenTexts` asks the fleet once per token
id (Detokenize's token_bytes) and keeps the answer. As OpenAI's, the logprobs
are those of the text: the stop token that ended an answer has none unless the
text shows it; a token's `bytes` are its own, so the pieces of a character
split over tokens join to it, and its `token` is its text, or `bytes:\\xNN...`
when its bytes are not whole characters (tiktoken's and OpenAI's notation).

With tools the model may call, a `ToolCallParser` splits the text into
content and calls: a whole answer's calls are the message's `tool_calls`; a
stream sends each call as OpenAI's deltas (id, type and function.name with
empty arguments, then the arguments). An answer with calls that the model
ended itself has `finish_reason` "tool_calls".
"""

from __future__ import annotations

import codecs
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from mlx_worker_svc.gateway.schema import ParsedRequest
from mlx_worker_svc.gateway.tool_calls import Call, Event, ToolCallParser
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

_FINISH: dict[int, str] = {
    pb.FINISH_REASON_EOS: "stop",
    pb.FINISH_REASON_STOP_TOKEN: "stop",
    pb.FINISH_REASON_STOP_STRING: "stop",
    pb.FINISH_REASON_GRAMMAR_COMPLETE: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CONTEXT_LENGTH: "length",
    pb.FINISH_REASON_ABORTED: "abort",
}
# Finish reasons whose last token is a stop token, sampled but not part of the text.
_BY_STOP_TOKEN = frozenset({pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP_TOKEN})
# JSON has no -inf; OpenAI-compatible servers report impossible tokens like this.
_FLOOR = -9999.0

Detokenize = Callable[[pb.DetokenizeRequest], Awaitable[pb.DetokenizeResponse]]


class TokenTexts:
    """The bytes of single token ids, asked of the workers once per id."""

    def __init__(self, detokenize: Detokenize) -> None:
        self._detokenize = detokenize
        self._known: dict[int, bytes] = {}  # bounded by the vocabulary

    async def lookup(self, ids: Iterable[int]) -> dict[int, bytes]:
        """A mapping that holds at least `ids` (asked in one call when new)."""
        missing = sorted({t for t in ids if t not in self._known})
        if missing:
            ask = pb.DetokenizeRequest(token_ids=missing, return_token_bytes=True)
            answer = await self._detokenize(ask)
            self._known.update(zip(missing, answer.token_bytes, strict=True))
        return self._known


def token_ids(logprobs: Iterable[pb.TokenLogprobs]) -> set[int]:
    """Every token a list of logprobs names: the sampled ones and their alternatives."""
    return {t for lp in logprobs for t in (lp.token_id, *(top.token_id for top in lp.top))}


def shown_logprobs(message: pb.GenerateResponse, texts: dict[int, bytes]) -> list[pb.TokenLogprobs]:
    """The message's logprobs, less the stop token's when it ended the answer outside the text.

    EOS and special stop tokens are not rendered (the fleet skips special
    tokens), so they have no entry; a plain token of `stop_token_ids` is
    rendered at the end of the text, so it keeps its entry.
    """
    logprobs = list(message.logprobs)
    if message.finish_reason in _BY_STOP_TOKEN and logprobs and message.token_ids:
        stop = message.token_ids[-1]
        shown = texts.get(stop, b"")
        if logprobs[-1].token_id == stop and not (shown and message.text.encode().endswith(shown)):
            logprobs.pop()
    return logprobs


def _logprob(value: float) -> float:
    return max(value, _FLOOR) if math.isfinite(value) else _FLOOR


def _shown(raw: bytes) -> str:
    """A token's `token`: its text, or `bytes:\\xf0\\x9f` when it is not whole characters."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _token(token: int, logprob: float, texts: dict[int, bytes]) -> dict[str, Any]:
    raw = texts[token]
    return {"token": _shown(raw), "logprob": _logprob(logprob), "bytes": list(raw)}


def _legacy_top(lp: pb.TokenLogprobs, texts: dict[int, bytes]) -> dict[str, float]:
    """Legacy `top_logprobs`: the top `logprobs` tokens and the sampled one, always
    (OpenAI's rule: up to `logprobs` + 1 entries; vLLM's too)."""
    top = {_shown(texts[t.token_id]): _logprob(t.logprob) for t in lp.top}
    top.setdefault(_shown(texts[lp.token_id]), _logprob(lp.logprob))
    return top


class Reply:
    """Builds the OpenAI objects of one request from the fleet's messages."""

    def __init__(
        self,
        parsed: ParsedRequest,
        model: str,
        tools: ToolCallParser | None = None,
        index: int = 0,
    ) -> None:
        self.parsed = parsed
        self.model = model
        self.tools = tools  # set when the answer may hold tool calls
        self.index = index  # the choice's (n > 1: choices.py)
        self.created = int(time.time())
        self.chat = parsed.kind == "chat"
        self._role_sent = False
        self._offset = 0  # legacy logprobs: characters of the text so far
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # ... read from bytes
        self.cached_tokens = 0

    def _envelope(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.parsed.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def logprobs(
        self, logprobs: list[pb.TokenLogprobs], texts: dict[int, bytes]
    ) -> dict[str, Any] | None:
        """The choice's `logprobs` object for these tokens (None when not asked for)."""
        if self.parsed.logprobs is None:
            return None
        if self.chat:
            content = [
                _token(lp.token_id, lp.logprob, texts)
                | {"top_logprobs": [_token(t.token_id, t.logprob, texts) for t in lp.top]}
                for lp in logprobs
            ]
            return {"content": content, "refusal": None}  # OpenAI's shape: no refusals here
        offsets = []
        for lp in logprobs:  # where the character a token's first byte is in begins
            offsets.append(self._offset)
            self._offset += len(self._utf8.decode(texts[lp.token_id]))
        return {
            "tokens": [_shown(texts[lp.token_id]) for lp in logprobs],
            "token_logprobs": [_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [_legacy_top(lp, texts) for lp in logprobs],
            "text_offset": offsets,
        }

    def chunk(self, text: str, logprobs: dict[str, Any] | None, finish: int = 0) -> dict[str, Any]:
        """One streamed chunk: text (and its tokens' logprobs), or the finish reason."""
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            delta: dict[str, Any] = {} if finish else {"content": text}
            if not self._role_sent:
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = self._finish(finish) if finish else None
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", choice)
        if self.parsed.include_usage:
            out["usage"] = None
        return out

    def _finish(self, reason: int) -> str | None:
        name = _FINISH.get(reason)
        return "tool_calls" if name == "stop" and self.tools and self.tools.calls else name

    def events(self, events: list[Event], logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The chunks of a tool parser's events; the logprobs go with the first."""
        chunks: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Call):
                head = {"index": event.index, "id": event.id, "type": "function"}
                head["function"] = {"name": event.name, "arguments": ""}
                tail = {"index": event.index, "function": {"arguments": event.arguments}}
                chunks += [self._tool_chunk(head), self._tool_chunk(tail)]
            elif event:
                chunks.append(self.chunk(event, None))
        if logprobs is not None:
            if not chunks:
                chunks.append(self.chunk("", None))
            chunks[0]["choices"][0]["logprobs"] = logprobs
        return chunks

    def _tool_chunk(self, call: dict[str, Any]) -> dict[str, Any]:
        chunk = self.chunk("", None)
        chunk["choices"][0]["delta"].pop("content")
        chunk["choices"][0]["delta"]["tool_calls"] = [call]
        return chunk

    def usage(self, last: pb.GenerateResponse) -> dict[str, Any]:
        return {
            "prompt_tokens": last.prompt_tokens,
            "completion_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def usage_chunk(self, last: pb.GenerateResponse) -> dict[str, Any]:
        """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", {})
        out["choices"] = []
        out["usage"] = self.usage(last)
        return out

    def complete(
        self, messages: list[pb.GenerateResponse], texts: dict[int, bytes]
    ) -> dict[str, Any]:
        """The whole answer (non-streaming) from every message of the request."""
        text = "".join(m.text for m in messages)
        logprobs = self.logprobs([lp for m in messages for lp in shown_logprobs(m, texts)], texts)
        last = messages[-1]
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            if self.tools is not None:
                found = self.tools.feed(text) + self.tools.finish()
                calls = [_call(e) for e in found if isinstance(e, Call)]
                content = "".join(e for e in found if isinstance(e, str))
                if calls:
                    choice["message"] = {
                        "role": "assistant",
                        "content": content if content.strip() else None,
                        "tool_calls": calls,
                    }
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = self._finish(last.finish_reason)
        out = self._envelope("chat.completion" if self.chat else "text_completion", choice)
        out["usage"] = self.usage(last)
        return out


def _call(call: Call) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}
