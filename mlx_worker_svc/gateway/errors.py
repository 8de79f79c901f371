"""Errors in OpenAI's and Anthropic's shapes, and the HTTP status each gRPC status becomes.

An error on an OpenAI route is `{"error": {"message", "type", "param",
"code"}}`; on Anthropic's (`/v1/messages...`) it is `{"type": "error",
"error": {"type", "message"}}`, the type following the status as Anthropic's
does (`error_body`); so is any error of a request from Anthropic's SDK (it
sends `anthropic-version`), such as its `models.retrieve` of an unknown model.
The status codes are those the SDKs map to their
exception classes (400 `BadRequestError`, 401 `AuthenticationError`, 404
`NotFoundError`, 429 `RateLimitError`, 5xx `InternalServerError`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import grpc

_S = grpc.StatusCode
# gRPC status of a fleet or worker error -> (HTTP status, OpenAI error type, code).
_FROM_GRPC: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    _S.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    _S.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_value"),
    # A field the workers define but do not honour yet: the request's fault.
    _S.UNIMPLEMENTED: (400, "invalid_request_error", "unsupported_value"),
    _S.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    _S.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    _S.CANCELLED: (499, "invalid_request_error", "cancelled"),
    # The gateway's own credentials toward the workers are wrong: not the caller's fault.
    _S.UNAUTHENTICATED: (502, "server_error", "bad_gateway"),
    _S.PERMISSION_DENIED: (502, "server_error", "bad_gateway"),
    _S.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    _S.ABORTED: (503, "server_error", "service_unavailable"),
    _S.FAILED_PRECONDITION: (503, "server_error", "service_unavailable"),
    _S.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}

ANTHROPIC_PATH = "/v1/messages"  # Anthropic's routes: this one and those below it
# HTTP status -> Anthropic's error type; any other 4xx is invalid_request_error, 5xx api_error.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind  # OpenAI's `type`
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """The error in Anthropic's shape."""
        fallback = "invalid_request_error" if self.status < 500 else "api_error"
        kind = _ANTHROPIC_TYPES.get(self.status, fallback)
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def is_anthropic(path: str, headers: Iterable[str] = ()) -> bool:
    """Whether a request is one of Anthropic's API: to its routes, or from its SDK (which
    sends `anthropic-version` on every call, /v1/models too); `headers`: their names."""
    route = path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")
    return route or any(name.lower() == "anthropic-version" for name in headers)


def error_body(path: str, error: ApiError, headers: Iterable[str] = ()) -> dict[str, Any]:
    """The error in the shape of the API the request belongs to (`is_anthropic`)."""
    return error.anthropic_body() if is_anthropic(path, headers) else error.body()


def raise_as(error: ApiError, cause: BaseException) -> NoReturn:
    """Raises `error` from `cause`; a rewording that gave back `cause` itself is raised as
    it is, its own cause kept (`raise e from e` loses it: the fleet's error under it, which
    the fleet's queue counts a request's end by)."""
    if error is cause:
        raise error
    raise error from cause


def invalid(param: str, why: str) -> ApiError:
    """A 400 for one bad field."""
    return ApiError(400, f"Invalid value for '{param}': {why}", param=param, code="invalid_value")


def from_grpc(code: grpc.StatusCode, message: str) -> ApiError:
    """The OpenAI error for a fleet or worker error with this gRPC status."""
    status, kind, short = _FROM_GRPC.get(code, (500, "server_error", None))
    return ApiError(status, message, kind=kind, code=short)
