"""A scheduler's end of ExecuteStream: blocking (`ExecuteStreamCall`) and asyncio.

In blocking code (benchmarks, tests, scripts), `ExecuteStreamCall.send` queues
a step and returns at once; `receive` returns the next reply, in the order the
steps were sent. Keep up to `GetInfo.limits.max_steps_in_flight` steps sent and
not yet received to keep the worker busy. `close` half-closes the stream (the
worker answers what it has and ends it); `cancel` ends it at once. Either way
the worker frees every request the stream created. `AsyncExecuteStream` is the
same for asyncio code (`AsyncWorkerClient.execute_stream`).
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator
from typing import Any

import grpc
import grpc.aio

from mlx_worker_svc.client.errors import ClientError, client_error
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

_CLOSE = object()


class ExecuteStreamCall:
    """One open ExecuteStream over a blocking stub."""

    def __init__(
        self,
        stub: pb_grpc.WorkerServiceStub,
        *,
        timeout: float | None = None,
        metadata: tuple[tuple[str, str], ...] | None = None,
    ) -> None:
        self._outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._call: Any = stub.ExecuteStream(self._requests(), timeout=timeout, metadata=metadata)
        self.in_flight = 0
        """Steps sent and not yet received."""

    def _requests(self) -> Iterator[pb.ExecuteStreamRequest]:
        while True:
            item = self._outgoing.get()
            if item is _CLOSE:
                return
            yield item

    def send(self, request: pb.ExecuteRequest) -> None:
        self._outgoing.put(pb.ExecuteStreamRequest(step=request))
        self.in_flight += 1

    def receive(self) -> pb.ExecuteStreamResponse:
        """The next step's reply; raises grpc.RpcError if the stream ended with a status."""
        response: pb.ExecuteStreamResponse = next(self._call)
        self.in_flight -= 1
        return response

    def close(self) -> None:
        """Sends no more steps; `receive` still returns the replies owed."""
        self._outgoing.put(_CLOSE)

    def cancel(self) -> None:
        self._outgoing.put(_CLOSE)
        self._call.cancel()

    def __enter__(self) -> ExecuteStreamCall:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.cancel()


def raise_for_error(response: pb.ExecuteStreamResponse) -> pb.ExecuteResponse:
    """The step's result, or a `StepFailed` carrying its error."""
    if response.HasField("error"):
        code = _CODES.get(response.error.code, grpc.StatusCode.UNKNOWN)
        raise StepFailed(code, response.error.message)
    return response.result


class StepFailed(Exception):
    """A step of an ExecuteStream failed; the stream goes on."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class AsyncExecuteStream:
    """One open ExecuteStream on a grpc.aio channel (`AsyncWorkerClient.execute_stream`).

    `send` writes a step, `receive` reads the next reply; a failure of the stream
    itself (the worker gone, the call cancelled) raises `ClientError` from either.
    """

    def __init__(self, call: Any) -> None:
        self._call = call

    async def send(self, request: pb.ExecuteRequest) -> None:
        try:
            await self._call.write(pb.ExecuteStreamRequest(step=request))
        except grpc.aio.AioRpcError as exc:
            raise client_error(exc, _METHOD) from exc
        except asyncio.InvalidStateError as exc:  # the call has ended
            raise ClientError(grpc.StatusCode.CANCELLED, str(exc), _METHOD) from exc

    async def receive(self) -> pb.ExecuteStreamResponse:
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            raise client_error(exc, _METHOD) from exc
        if not isinstance(message, pb.ExecuteStreamResponse):  # grpc.aio's EOF
            raise ClientError(grpc.StatusCode.UNAVAILABLE, "the stream ended", _METHOD)
        return message

    def cancel(self) -> None:
        self._call.cancel()


def step_error(response: pb.ExecuteStreamResponse) -> ClientError | None:
    """The step's error as a ClientError (what Execute would have raised), or None."""
    if not response.HasField("error"):
        return None
    code = _CODES.get(response.error.code, grpc.StatusCode.UNKNOWN)
    return ClientError(code, response.error.message, _METHOD)


_METHOD = "ExecuteStream"
