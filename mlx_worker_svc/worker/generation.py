"""Generate streams: the worker-side end of one Generate call.

The engine thread pushes each step's output for a Generate request into its
`GenerateStream`; the gRPC thread serving the call reads chunks from it. The
stream turns token ids into text pieces (incremental detokenization), counts
tokens, and always ends with exactly one final chunk or one error. Each
stream logs one line when it opens and one when it ends, with its `req_id`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from mlx_worker_svc.core.domain import FinishReason, Origin, RequestOutput
from mlx_worker_svc.core.errors import Code, WorkerError
from mlx_worker_svc.core.generate import GenerateChunk
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.engine.text import TextStream

_END = object()
log = logging.getLogger(__name__)


@dataclass
class GenerateStream:
    request_id: str
    prompt_tokens: int
    text: TextStream
    completion_tokens: int = 0
    done: bool = False
    _chunks: queue.Queue[object] = field(default_factory=queue.Queue)

    def emit(self, output: RequestOutput) -> None:
        """Pushes one step's output; the final one closes the stream."""
        if self.done:
            return
        pieces = [self.text.add(t) for t in output.text_token_ids]
        self.completion_tokens += len(output.sampled_token_ids)
        chunk = GenerateChunk(
            request_id=self.request_id,
            token_ids=list(output.sampled_token_ids),
            text="".join(pieces),
            logprobs=list(output.logprobs),
            num_cached_prompt_tokens=output.num_cached_prompt_tokens,
        )
        if output.finish_reason is not None:
            self._finish(chunk, output.finish_reason)
        elif chunk.token_ids:
            self._chunks.put(chunk)

    def cancel(self) -> None:
        """Ends the stream as its caller left it: FINISH_REASON_ABORTED, logged cancelled."""
        if not self.done:
            chunk = GenerateChunk(request_id=self.request_id)
            self._finish(chunk, FinishReason.ABORTED, "request cancelled")

    def fail(self, error: WorkerError) -> None:
        """Ends the stream with an error status (ABORTED: a drain or a Sleep cut it)."""
        if not self.done:
            self.done = True
            log.info(
                "request aborted" if error.code is Code.ABORTED else "request failed",
                extra={
                    "req_id": clip(self.request_id),
                    "code": error.code.name,
                    "error": error.message,
                    "completion_tokens": self.completion_tokens,
                },
            )
            self._chunks.put(error)
            self._chunks.put(_END)

    def _finish(
        self, chunk: GenerateChunk, reason: FinishReason, event: str = "request finished"
    ) -> None:
        chunk.text += self.text.finish()
        chunk.finish_reason = reason
        chunk.prompt_tokens = self.prompt_tokens
        chunk.completion_tokens = self.completion_tokens
        self.done = True
        log.info(
            event,
            extra={
                "req_id": clip(self.request_id),
                "finish_reason": reason.value,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
            },
        )
        self._chunks.put(chunk)
        self._chunks.put(_END)

    def chunks(self) -> Iterator[GenerateChunk]:
        """Blocks for chunks until the stream ends; raises its error, if any."""
        while True:
            item = self._chunks.get()
            if item is _END:
                return
            if isinstance(item, WorkerError):
                raise item
            assert isinstance(item, GenerateChunk)
            yield item


class StreamTable:
    """The open Generate streams, keyed by request id.

    Mutated only on the engine thread; `wait_empty` lets another thread (the
    drain) wait for the last stream to close.
    """

    def __init__(self) -> None:
        self._streams: dict[str, GenerateStream] = {}
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def ids(self) -> list[str]:
        """Request ids, oldest first."""
        return list(self._streams)

    def open(self, stream: GenerateStream) -> None:
        self._streams[stream.request_id] = stream
        log.info(
            "request admitted",
            extra={"req_id": clip(stream.request_id), "prompt_tokens": stream.prompt_tokens},
        )

    def close(self, request_id: str, error: WorkerError | None = None) -> None:
        """Ends a stream: its caller cancelled it when `error` is None, else the error."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            if error is None:
                stream.cancel()
            else:
                stream.fail(error)
        self._notify()

    def dispatch(self, outputs: dict[tuple[Origin, str], RequestOutput]) -> None:
        """Pushes a step's Generate outputs to their streams; closes finished ones."""
        for (origin, request_id), output in outputs.items():
            stream = self._streams.get(request_id) if origin is Origin.GENERATE else None
            if stream is None:
                continue
            stream.emit(output)
            if stream.done:
                self._streams.pop(request_id, None)
                self._notify()

    def wait_empty(self, timeout: float) -> bool:
        """Waits until no stream is open; returns whether that happened in time."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._streams:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
