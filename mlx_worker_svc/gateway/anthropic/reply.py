"""Fleet `GenerateResponse` messages out as Anthropic objects: a `message`, or its stream of events.

`Blocks` turns an answer's pieces (text, and the calls a `ToolCallParser`
finds) into content blocks, the same way for a whole answer and for a
stream, so both agree: text goes into a `text` block (a new one after a
call), each call becomes a `tool_use` block (`id` "toolu_...", `name`,
`input`). A stream sends each block as `content_block_start`, its deltas
(`text_delta`, or the call's whole arguments as one `input_json_delta`) and
`content_block_stop`. Without tools the answer is one text block, opened
before the first token; with tools, an answer cut to nothing before its
first text or call ends with an empty text block (never with no content).

Usage is Anthropic's: `input_tokens` are the prompt tokens computed for this
request and `cache_read_input_tokens` those the workers' prefix cache served
(together, the prompt); `output_tokens` counts every generated token.
"""

from __future__ import annotations

import json
from typing import Any

from mlx_worker_svc.gateway.schema import ParsedRequest
from mlx_worker_svc.gateway.tool_calls import Call, Event
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

# An SSE event: its name (also the data's `type`) and its data.
Sse = tuple[str, dict[str, Any]]

_STOP: dict[int, str] = {
    pb.FINISH_REASON_EOS: "end_turn",
    pb.FINISH_REASON_STOP_TOKEN: "end_turn",
    pb.FINISH_REASON_GRAMMAR_COMPLETE: "end_turn",
    pb.FINISH_REASON_STOP_STRING: "stop_sequence",
    pb.FINISH_REASON_LENGTH: "max_tokens",
    pb.FINISH_REASON_CONTEXT_LENGTH: "model_context_window_exceeded",
    pb.FINISH_REASON_ABORTED: "end_turn",
}


def tool_use_id(call: Call) -> str:
    """Anthropic's id of a call ("toolu_..." for the parser's "call_...")."""
    return "toolu_" + call.id.removeprefix("call_")


def _event(kind: str, **data: Any) -> Sse:
    return kind, {"type": kind, **data}


class Blocks:
    """The content blocks of one answer, built as its pieces come (see the module doc)."""

    def __init__(self, *, text_first: bool) -> None:
        self.content: list[dict[str, Any]] = []
        self._open = False  # the last block takes more deltas
        self.opening: list[Sse] = self._start({"type": "text", "text": ""}) if text_first else []

    def feed(self, pieces: list[Event]) -> list[Sse]:
        """Adds text and calls; returns the stream events that say so."""
        out: list[Sse] = []
        for piece in pieces:
            if isinstance(piece, Call):
                out += self.close()
                block = {"type": "tool_use", "id": tool_use_id(piece), "name": piece.name}
                out += self._start(block | {"input": {}})
                self.content[-1]["input"] = json.loads(piece.arguments)
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                out.append(self._delta(delta))
                out += self.close()
            elif piece:
                if not (self._open and self.content[-1]["type"] == "text"):
                    out += self.close()
                    out += self._start({"type": "text", "text": ""})
                self.content[-1]["text"] += piece
                out.append(self._delta({"type": "text_delta", "text": piece}))
        return out

    def finish(self) -> list[Sse]:
        """Ends the answer: closes the open block, and gives an answer of no block (cut
        to nothing before its first text or call) the empty text block an answer without
        tools has, so that a client can send it back as it came."""
        opened = [] if self.content else self._start({"type": "text", "text": ""})
        return opened + self.close()

    def close(self) -> list[Sse]:
        """Ends the open block, if any."""
        if not self._open:
            return []
        self._open = False
        return [_event("content_block_stop", index=len(self.content) - 1)]

    @property
    def calls(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.content)

    def _start(self, block: dict[str, Any]) -> list[Sse]:
        self.content.append(block)
        self._open = True
        start = _event("content_block_start", index=len(self.content) - 1, content_block=block)
        return [(start[0], json.loads(json.dumps(start[1])))]  # as it is now, not as it grows

    def _delta(self, delta: dict[str, Any]) -> Sse:
        return _event("content_block_delta", index=len(self.content) - 1, delta=delta)


class MessageReply:
    """Builds the Anthropic objects of one request from the fleet's messages."""

    def __init__(self, parsed: ParsedRequest, model: str, input_tokens: int) -> None:
        self.parsed = parsed
        self.model = model
        self.input_tokens = input_tokens  # the prompt's tokens
        self.cached_tokens = 0

    def stop_reason(self, last: pb.GenerateResponse, blocks: Blocks) -> str | None:
        """An answer that ended with calls is `tool_use`, a stop sequence right after them
        too (the OpenAI route's `tool_calls`): an agent loop runs calls on `tool_use`."""
        reason = _STOP.get(last.finish_reason)
        ended = reason in ("end_turn", "stop_sequence")
        return "tool_use" if ended and blocks.calls else reason

    def stop_sequence(self, last: pb.GenerateResponse, blocks: Blocks) -> str | None:
        """The stop sequence that ended the answer, where `stop_sequence` is the reason."""
        matched = self.stop_reason(last, blocks) == "stop_sequence"
        return (last.stop_string or None) if matched else None

    def usage(self, output_tokens: int) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens - self.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
            "output_tokens": output_tokens,
        }

    def message(self, blocks: Blocks, last: pb.GenerateResponse | None) -> dict[str, Any]:
        """The `message` object: whole (with the last fleet message), or as a stream opens."""
        return {
            "id": self.parsed.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": blocks.content if last is not None else [],
            "stop_reason": self.stop_reason(last, blocks) if last is not None else None,
            "stop_sequence": self.stop_sequence(last, blocks) if last is not None else None,
            "usage": self.usage(last.completion_tokens if last is not None else 0),
        }

    def start(self, blocks: Blocks) -> list[Sse]:
        """A stream's first events: message_start, the first block (if known), ping."""
        start = _event("message_start", message=self.message(blocks, None))
        return [start, *blocks.opening, _event("ping")]

    def end(self, blocks: Blocks, last: pb.GenerateResponse) -> list[Sse]:
        """A stream's last events: the open block's stop, message_delta, message_stop."""
        delta = {
            "stop_reason": self.stop_reason(last, blocks),
            "stop_sequence": self.stop_sequence(last, blocks),
        }
        usage = self.usage(last.completion_tokens)
        return [
            *blocks.finish(),
            _event("message_delta", delta=delta, usage=usage),
            _event("message_stop"),
        ]
