"""The worker's error hierarchy: every expected failure carries its gRPC status.

Layers below the servicer raise these; the servicer maps them to a status code
and message in one place. Anything else that escapes is a bug and surfaces as
INTERNAL with the exception text, never as a silent UNKNOWN.
"""

from __future__ import annotations

import grpc


class WorkerError(Exception):
    """Base class: an expected failure with a gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(WorkerError):
    """The request is malformed; nothing was changed."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(WorkerError):
    """A named thing (model path, request id) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(WorkerError):
    """The worker is in the wrong state for this call."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(WorkerError):
    """A budget (KV blocks, memory, admission) would be exceeded."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unimplemented(WorkerError):
    """The call or field is defined by the protocol but not built yet."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Unavailable(WorkerError):
    """The worker is draining or stopped; retry elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class Aborted(WorkerError):
    """The request was ended by the worker (shutdown, abort) before finishing."""

    code = grpc.StatusCode.ABORTED


class Internal(WorkerError):
    """A failure inside the engine that is not the caller's fault."""

    code = grpc.StatusCode.INTERNAL
