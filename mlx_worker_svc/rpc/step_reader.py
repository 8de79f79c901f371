"""Reads one ExecuteStream's requests ahead of its replies, at most `depth` of them.

A thread of its own takes each request off the stream as soon as there is
room (fewer than `depth` steps read and not yet answered), converts it and
submits it to the worker's `StepStream`, so the engine thread has the next
step queued while the servicer's thread converts and sends the previous
reply. Iterating the reader yields each step's outcome in the order the
steps came. A step that does not convert (a bad field, a field this server
does not know, or a message without its `step`) gets its error in its own
reply, as a failing step does. Past
`depth`, the reader does not read: gRPC's flow control holds the scheduler's
further steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

from mlx_worker_svc.core.errors import InvalidArgument, Unimplemented, WorkerError
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc import convert
from mlx_worker_svc.rpc.decoding import Undecodable
from mlx_worker_svc.worker.step_stream import StepStream, StreamedStep

log = logging.getLogger(__name__)
_END = object()


class StepReader:
    """The steps of one stream, submitted as they arrive; iterate for the outcomes."""

    def __init__(
        self,
        requests: Iterator[pb.ExecuteStreamRequest | Undecodable],
        stream: StepStream,
        depth: int,
    ) -> None:
        self._requests = requests
        self._stream = stream
        self._room = threading.Semaphore(depth)
        self._outcomes: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._read, name="execute-stream", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[StreamedStep]:
        while True:
            item = self._outcomes.get()
            if item is _END:
                return
            step = item.result() if isinstance(item, Future) else item
            assert isinstance(step, StreamedStep)
            self._room.release()
            yield step

    def stop(self) -> None:
        """Stops reading (the reply side ended); steps already submitted still run."""
        self._stopped = True
        self._room.release()  # wake the reader if it waits for room

    def _refuse(self, request: pb.ExecuteStreamRequest, error: WorkerError) -> object:
        """A step that did not convert: its error, in order with the others'."""
        step = request.step
        new_ids = [new.req_id for new in step.new_requests]
        return self._stream.refuse(step.step_id, new_ids, error)

    def _read(self) -> None:
        try:
            while True:
                self._room.acquire()
                if self._stopped:
                    return
                request = next(self._requests, None)
                if request is None or self._stopped:
                    return
                received = time.perf_counter_ns()
                if isinstance(request, Undecodable):  # it sets a field unknown here
                    self._outcomes.put(self._refuse(request.parsed, Unimplemented(request.details)))
                    continue
                if not request.HasField("step"):
                    missing = InvalidArgument("ExecuteStreamRequest.step is required")
                    self._outcomes.put(StreamedStep(0, error=missing))
                    continue
                try:
                    plan = convert.step_plan(request.step)
                except WorkerError as exc:
                    self._outcomes.put(self._refuse(request, exc))
                    continue
                self._outcomes.put(self._stream.submit(plan, received))
        except Exception:  # the call ended under the reader (cancelled, dropped)
            log.debug("an ExecuteStream ended while its requests were read", exc_info=True)
        finally:
            self._outcomes.put(_END)
