"""Generate streams: the worker-side end of one Generate call.

The engine thread pushes each step's output for a Generate request into its
`GenerateStream`; the gRPC thread serving the call reads chunks from it. The
stream turns token ids into text pieces (incremental detokenization), counts
tokens, and always ends with exactly one final chunk or one error.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from dataclasses import dataclass, field

from mlx_worker_svc.domain import FinishReason, GenerateChunk, RequestOutput
from mlx_worker_svc.engine.text import TextStream
from mlx_worker_svc.errors import WorkerError

_END = object()


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
        pieces = [self.text.add(t) for t in output.sampled_token_ids]
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

    def abort(self, reason: FinishReason = FinishReason.ABORTED) -> None:
        """Ends the stream normally with `reason` (e.g. a cancelled call)."""
        if not self.done:
            self._finish(GenerateChunk(request_id=self.request_id), reason)

    def fail(self, error: WorkerError) -> None:
        """Ends the stream with an error status."""
        if not self.done:
            self.done = True
            self._chunks.put(error)
            self._chunks.put(_END)

    def _finish(self, chunk: GenerateChunk, reason: FinishReason) -> None:
        chunk.text += self.text.finish()
        chunk.finish_reason = reason
        chunk.prompt_tokens = self.prompt_tokens
        chunk.completion_tokens = self.completion_tokens
        self.done = True
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
