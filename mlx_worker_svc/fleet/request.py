"""One fleet request: what the caller asked for and everything produced so far.

A request outlives the worker it runs on. Its tokens, text and counts live
here, in the scheduler, so that when a worker dies the request continues on
another one from prompt + generated tokens (`continuation`), and the caller's
stream never notices beyond a pause.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

# The caller's stream ends after a message carrying a finish reason or an error.
Message = pb.GenerateResponse | BaseException


class Phase(enum.Enum):
    QUEUED = "queued"  # admitted, waiting for a worker
    RUNNING = "running"  # on a worker (prefilling or decoding)
    PREEMPTED = "preempted"  # on a worker's waiting list, KV freed
    DONE = "done"


@dataclass(eq=False)
class FleetRequest:
    request_id: str
    prompt: list[int]
    params: pb.SamplingParams  # as the caller sent it, stop strings included
    model: str = ""  # the fleet's name for it ("": the only model there is)
    lora_name: str = ""  # its LoRA adapter (GenerateRequest.lora_name; "": none)
    waited_for_load: bool = False  # no worker held its model when it came
    stop: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    generated: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)  # not streamed yet
    text: str = ""  # the output's text so far, as its workers detokenized it (RequestOutput.text)
    sent_text: int = 0  # characters of `text` already streamed
    sent_tokens: int = 0  # tokens already streamed
    streamed: bool = False  # the first message went out
    phase: Phase = Phase.QUEUED
    finish_reason: pb.FinishReason = pb.FINISH_REASON_UNSPECIFIED
    cancelled: bool = False
    # The id the workers know it by: request_id, unless another live request has that id
    # (request_id is the caller's, for logs): then request_id~n (scheduler.py).
    worker_key: str = ""
    # Per attempt on a worker: the worker-side id, its computed count and length.
    attempt: int = 0
    computed: int = 0
    cached_tokens: int = 0
    reported_cached: bool = False
    affinity: int = 0
    outbox: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    admitted: float = field(default_factory=time.monotonic)  # when Generate was called

    @property
    def worker_id(self) -> str:
        """The id on the worker: a new one per attempt, so nothing stale collides."""
        return self.id_for(self.attempt)

    def id_for(self, attempt: int) -> str:
        """The id on the worker of attempt `attempt`."""
        return f"{self.worker_key or self.request_id}#{attempt}"

    def final_length(self, context: int) -> int:
        """The tokens its sequence holds at its end if it runs to max_tokens, or to the
        model's `context` (0: unknown) when max_tokens is unset."""
        if self.params.HasField("max_tokens"):
            end = len(self.prompt) + self.params.max_tokens
            return min(end, context) if context else end
        return context or len(self.tokens) + 1

    @property
    def tokens(self) -> list[int]:
        """The sequence the worker holds: prompt, then generated tokens."""
        return self.prompt + self.generated

    def continuation(self) -> tuple[list[int], pb.SamplingParams]:
        """Prompt and sampling parameters that continue this request elsewhere.

        The generated tokens end the prompt; NewRequest.num_generated_tokens
        (len(generated)) tells a structured-outputs grammar they are output.
        """
        params = pb.SamplingParams()
        params.CopyFrom(self.params)
        del params.stop[:]
        done = len(self.generated)
        if params.HasField("max_tokens"):
            params.max_tokens = max(params.max_tokens - done, 1)
        params.min_tokens = max(params.min_tokens - done, 0)
        return self.tokens, params

    # ------------------------------------------------------------- stream
    def next_message(self) -> tuple[pb.GenerateResponse, bool]:
        """What to stream now, and whether a stop string ended the request.

        The tokens and text not streamed yet; the first message carries the
        prefix-cache hit. The last one (a stop string hit, or the worker's
        finish: `phase` DONE) carries the finish, the rest of the text and the
        counts, and leaves the request DONE.
        """
        piece, stop = self.new_text()
        tokens, logprobs = self.take_tokens()
        message = pb.GenerateResponse(
            token_ids=tokens, text=piece, logprobs=logprobs, request_id=self.request_id
        )
        if not self.streamed:
            self.streamed = True
            message.num_cached_prompt_tokens = self.cached_tokens
        if stop is not None:
            message.finish_reason = pb.FINISH_REASON_STOP_STRING
            message.stop_string = stop
        elif self.phase is Phase.DONE:
            message.finish_reason = self.finish_reason
            message.text += self.flush()
        if message.finish_reason:
            message.prompt_tokens = len(self.prompt)
            message.completion_tokens = len(self.generated)
            self.phase = Phase.DONE
        return message, stop is not None

    def new_text(self) -> tuple[str, str | None]:
        """Text to stream now and the stop string hit, from the output's text so far.

        Text is held back while it ends in a partial character or could be
        the start of a stop string, so a stop string never leaks out.
        """
        full = self.text
        found = _first_stop(full, self.stop, self.sent_text)
        if found is not None:
            cut, stop = found
            piece = full[self.sent_text : cut]
            self.sent_text = cut
            return piece, stop
        end = len(full)
        if full.endswith("\ufffd"):
            end = len(full.rstrip("\ufffd"))
        end = min(end, _safe_end(full, self.stop))
        piece = full[self.sent_text : max(end, self.sent_text)]
        self.sent_text = max(end, self.sent_text)
        return piece, None

    def flush(self) -> str:
        """The rest of the text, at the end of a request that did not stop on a string."""
        piece = self.text[self.sent_text :]
        self.sent_text = len(self.text)
        return piece

    def take_tokens(self) -> tuple[list[int], list[pb.TokenLogprobs]]:
        """Tokens (and their logprobs, when asked for) not streamed yet."""
        out = self.generated[self.sent_tokens :]
        self.sent_tokens = len(self.generated)
        logprobs, self.logprobs = self.logprobs, []
        return out, logprobs


def _first_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """Where the earliest stop string begins in text[start - longest:], and which, if any.

    Of two beginning at the same character, the first listed wins.
    """
    found: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(start - len(stop) + 1, 0))
        if at != -1 and (found is None or at < found[0]):
            found = (at, stop)
    return found


def _safe_end(text: str, stops: tuple[str, ...]) -> int:
    """Text up to here can be streamed: no stop string could start after it."""
    end = len(text)
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                end = min(end, len(text) - size)
                break
    return end
