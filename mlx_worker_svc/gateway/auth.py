"""API keys: every request needs `Authorization: Bearer <key>` or `x-api-key: <key>`.

A request's key matches one of the configured keys, given either way
(OpenAI's clients send the first, Anthropic's the second).

The check is the workers' and the fleet's token check (`security.TokenCheck`:
SHA-256 digests compared with `hmac.compare_digest` against every key, so
neither the time taken nor the lengths say how close a guess came). A
missing or wrong key is a 401 in the shape of the route's API (errors.py),
sent before the request body is read. Paths in `open_paths` (`/health` with
`--allow-health-without-token`) answer without a key.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_worker_svc.gateway.errors import ApiError, error_body, is_anthropic
from mlx_worker_svc.rpc.security import TokenCheck

_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_MISSING_ANTHROPIC = (
    "x-api-key header is required (or an Authorization header using Bearer auth: "
    "Authorization: Bearer YOUR_KEY)"
)
_WRONG = "Incorrect API key provided."


class ApiKeyMiddleware:
    """Refuses HTTP requests without a valid API key (pure ASGI)."""

    def __init__(self, app: ASGIApp, *, check: TokenCheck, open_paths: Iterable[str] = ()) -> None:
        self.app = app
        self.check = check
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            path = scope["path"]
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            # x-api-key is the same key, checked as a bearer token is.
            headers += [("authorization", f"Bearer {v}") for k, v in headers if k == "x-api-key"]
            if not self.check.allows(path, headers):
                given = any(k == "authorization" for k, _ in headers)
                names = [k for k, _ in headers]
                missing = _MISSING_ANTHROPIC if is_anthropic(path, names) else _MISSING
                error = ApiError(401, _WRONG if given else missing, code="invalid_api_key")
                response = JSONResponse(
                    error_body(path, error, names),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
