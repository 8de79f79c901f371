"""API keys: every request needs `Authorization: Bearer <key>` matching one of the keys.

The check is the workers' and the fleet's token check (`security.TokenCheck`:
SHA-256 digests compared with `hmac.compare_digest` against every key, so
neither the time taken nor the lengths say how close a guess came). A
missing or wrong key is a 401 in OpenAI's shape, sent before the request body
is read. Paths in `open_paths` (`/health` with `--allow-health-without-token`)
answer without a key.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_worker_svc.gateway.errors import ApiError
from mlx_worker_svc.rpc.security import TokenCheck

_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
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
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
            if not self.check.allows(scope["path"], headers):
                given = any(k == "authorization" for k, _ in headers)
                error = ApiError(401, _WRONG if given else _MISSING, code="invalid_api_key")
                response = JSONResponse(
                    error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
