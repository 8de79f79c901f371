"""The one place a core error `Code` becomes a gRPC status code.

Everything below the RPC edge raises `core.errors.WorkerError`s carrying a
`Code`; the servicers (the worker's and the fleet's) and the gateway turn them
into `grpc.StatusCode`s here. `Code` uses gRPC's names and numbers, so the map
is total and one-to-one: a new `Code` member needs nothing here.
"""

from __future__ import annotations

import grpc

from mlx_worker_svc.core.errors import Code


def grpc_code(code: Code) -> grpc.StatusCode:
    """The gRPC status code of a core error code (same name, same number)."""
    status: grpc.StatusCode = grpc.StatusCode[code.name]
    assert status.value[0] == code.value, code
    return status
