"""Request ids: the `x-request-id` header in, the answer's id, and the headers out.

A client, or a proxy in front of the gateway, may send `x-request-id`: 1 to 128
visible ASCII characters (another value, or the header sent twice, is left aside,
as if none were sent).
It is the base of the answer's `id` (`chatcmpl-<id>`, `cmpl-<id>`, `msg_<id>`,
as vLLM builds them), which the fleet's log lines show as `req_id`; without
one the base is a fresh uuid's hex. Every response carries `x-request-id`,
the one sent or else the answer's `id` (`req_<hex>` for a response without an
answer: /v1/models, an error before one), so that what the OpenAI SDK reads as
`_request_id` is what the logs show; a response of Anthropic's API
(`errors.is_anthropic`) carries it in `request-id` too, the header Anthropic's
SDK reads.
"""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_worker_svc.gateway.errors import is_anthropic

HEADER = "x-request-id"
MAX_LENGTH = 128
_GIVEN = "request_id_given"  # scope["state"] keys: the header sent, if valid
_ANSWER = "request_id"  # and the answer's id, once a route has made it


def _valid(value: str | None) -> str | None:
    if value and len(value) <= MAX_LENGTH and all("!" <= c <= "~" for c in value):
        return value
    return None


def base(request: Request) -> str:
    """The base of the answer's id: the client's `x-request-id`, or a fresh uuid's hex."""
    given: str | None = request.scope.get("state", {}).get(_GIVEN)
    return given or uuid.uuid4().hex


def answered(request: Request, answer_id: str) -> None:
    """Records the answer's id, for the response's headers."""
    request.scope.setdefault("state", {})[_ANSWER] = answer_id


class RequestIdMiddleware:
    """Reads `x-request-id` and sets the response's id headers (pure ASGI; module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        sent = headers.getlist(HEADER)  # twice is one value "a, b" (RFC 9110): no id
        given = _valid(sent[0]) if len(sent) == 1 else None
        state = scope.setdefault("state", {})
        state[_GIVEN] = given
        anthropic = is_anthropic(scope["path"], headers.keys())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                value = given or state.get(_ANSWER) or f"req_{uuid.uuid4().hex}"
                out = MutableHeaders(scope=message)
                out[HEADER] = value
                if anthropic:
                    out["request-id"] = value
            await send(message)

        await self.app(scope, receive, send_with_id)
