"""The error a failed WorkerService call raises, shared by the unary and stream clients."""

from __future__ import annotations

from typing import Any, cast

import grpc


class ClientError(Exception):
    """A WorkerService call failed (after any retries)."""

    def __init__(self, code: grpc.StatusCode, details: str, method: str, attempts: int = 1) -> None:
        self.code = code
        self.details = details
        self.method = method
        self.attempts = attempts
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        super().__init__(f"{method} failed with {code.name}{tries}: {details}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.code, self.details, self.method, self.attempts))


def client_error(exc: grpc.RpcError, method: str, attempts: int = 1) -> ClientError:
    call = cast(grpc.Call, exc)
    return ClientError(call.code(), call.details() or "", method, attempts)
