"""The worker's error hierarchy: every expected failure carries a status `Code`.

Layers below the RPC edge raise these and never import grpc: `Code` names the
status with gRPC's names and numbers, and `rpc/status.py` maps it to
`grpc.StatusCode` in one place. The servicer turns a `WorkerError` into that
status and its message; anything else that escapes is a bug and surfaces as
INTERNAL with the exception text, never as a silent UNKNOWN.
"""

from __future__ import annotations

import enum


class Code(enum.Enum):
    """The status of an expected failure: gRPC's code names and numbers."""

    CANCELLED = 1
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class WorkerError(Exception):
    """Base class: an expected failure with a status code."""

    code: Code = Code.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class CallerGone(WorkerError):
    """The caller left (its deadline passed, it cancelled) before the work began: it did
    not run. The caller never reads this; the server records the call as it ended."""

    code = Code.CANCELLED


class InvalidArgument(WorkerError):
    """The request is malformed; nothing was changed."""

    code = Code.INVALID_ARGUMENT


class NotFound(WorkerError):
    """A named thing (model path, request id) does not exist."""

    code = Code.NOT_FOUND


class AlreadyExists(WorkerError):
    """A name is taken by something else (a LoRA adapter loaded from another path)."""

    code = Code.ALREADY_EXISTS


class FailedPrecondition(WorkerError):
    """The worker is in the wrong state for this call."""

    code = Code.FAILED_PRECONDITION


class ResourceExhausted(WorkerError):
    """A budget (KV blocks, memory, admission) would be exceeded."""

    code = Code.RESOURCE_EXHAUSTED


class Unimplemented(WorkerError):
    """The call or field is defined by the protocol but not built yet."""

    code = Code.UNIMPLEMENTED


class Unavailable(WorkerError):
    """The worker is draining or stopped; retry elsewhere."""

    code = Code.UNAVAILABLE


class Aborted(WorkerError):
    """The request was ended by the worker (shutdown, abort) before finishing."""

    code = Code.ABORTED


class Internal(WorkerError):
    """A failure inside the engine that is not the caller's fault."""

    code = Code.INTERNAL
