"""The one place a core error `Code` becomes a gRPC status code, where the worker's
servicer ends a call with an error (`abort_for`, logged), and where a call's
deadline and activity are read (`deadline_passed`, `gave_up`, `settle_stream_end`).

Everything below the RPC edge raises `core.errors.WorkerError`s carrying a
`Code`; the servicers (the worker's and the fleet's) and the gateway turn them
into `grpc.StatusCode`s here. `Code` uses gRPC's names and numbers, so the map
is total and one-to-one: a new `Code` member needs nothing here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from mlx_worker_svc.core.errors import Code, WorkerError
from mlx_worker_svc.core.log_format import clip

log = logging.getLogger(__name__)


def grpc_code(code: Code) -> grpc.StatusCode:
    """The gRPC status code of a core error code (same name, same number)."""
    status: grpc.StatusCode = grpc.StatusCode[code.name]
    assert status.value[0] == code.value, code
    return status


def deadline_passed(context: Any) -> bool:
    """Whether the caller's deadline has passed (False without one). A server marks a
    call inactive only once its own thread has seen the deadline: this reads it now."""
    remaining = getattr(context, "time_remaining", lambda: None)()
    return remaining is not None and remaining <= 0


# Status messages travel in a header; gRPC refuses headers past 8 KiB, and a
# message may quote the caller's input (a path, say), so keep them short.
MAX_MESSAGE = 2000
# How long a stream whose requests ended waits for gRPC to tell a cancel (settle_stream_end).
STREAM_END_SETTLE_S = 0.02


def short_message(message: str) -> str:
    """`message`, cut to MAX_MESSAGE characters (saying how long it was)."""
    if len(message) <= MAX_MESSAGE:
        return message
    return message[: MAX_MESSAGE - 30] + f"... ({len(message)} characters)"


def abort_for(
    context: grpc.ServicerContext, exc: BaseException, method: str, req_id: str = ""
) -> NoReturn:
    """Ends the call with `exc`'s status: a WorkerError's own code, logged at INFO as
    `rpc failed`; anything else (a bug) INTERNAL with its text, logged with its trace."""
    fields = {"rpc": method, "req_id": clip(req_id)} if req_id else {"rpc": method}
    if isinstance(exc, WorkerError):
        message = short_message(exc.message)
        log.info("rpc failed", extra={**fields, "code": exc.code.name, "error": message})
        context.abort(grpc_code(exc.code), message)
    log.exception(
        "%s failed with an unexpected error", method, extra={**fields, "code": "INTERNAL"}
    )
    context.abort(grpc.StatusCode.INTERNAL, short_message(f"{method}: {type(exc).__name__}: {exc}"))


def settle_stream_end(context: grpc.ServicerContext, seconds: float = STREAM_END_SETTLE_S) -> None:
    """Waits (briefly) for gRPC to say whether a stream whose requests ended was cancelled:
    it may end a cancelled call's request iterator as if the caller had closed its side,
    and only then mark the call inactive; the call's status is then counted as its
    caller saw it (CANCELLED, not OK). A caller that did close its side waits that long
    for the status."""
    deadline = time.monotonic() + seconds
    while context.is_active() and time.monotonic() < deadline:
        time.sleep(0.001)


def gave_up(context: grpc.ServicerContext) -> Callable[[], bool]:
    """Whether the caller left (deadline passed, cancelled): lifecycle calls stop waiting,
    and a queued Execute step does not run."""
    return lambda: not context.is_active() or deadline_passed(context)
