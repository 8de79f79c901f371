"""The one place a core error `Code` becomes a gRPC status code, and where a call's
deadline is read (`deadline_passed`).

Everything below the RPC edge raises `core.errors.WorkerError`s carrying a
`Code`; the servicers (the worker's and the fleet's) and the gateway turn them
into `grpc.StatusCode`s here. `Code` uses gRPC's names and numbers, so the map
is total and one-to-one: a new `Code` member needs nothing here.
"""

from __future__ import annotations

from typing import Any

import grpc

from mlx_worker_svc.core.errors import Code


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
