"""The gateway's Prometheus metrics (`mlx_gateway_*`): HTTP requests, latency, TTFT, tokens.

Each app has its own registry (several gateways may live in one process, as
in tests); `/metrics` renders it followed by the embedded fleet's registry
(`mlx_fleet_*`: requests by outcome, queue, workers up, their KV blocks).
`MetricsMiddleware` counts every HTTP request by route, method and status,
and times it to its last byte (a stream included). Route labels are the
gateway's route templates, anything else "other", and method labels HTTP's
methods, anything else "other", so a scanner cannot grow the label set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)


class GatewayMetrics:
    """Every gateway metric, in one registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "mlx_gateway_http_requests",
            "HTTP requests by route, method and status code.",
            ["route", "method", "status"],
            registry=reg,
        )
        self.duration = Histogram(
            "mlx_gateway_http_request_duration_seconds",
            "Time from a request's arrival to its last byte (streams included).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.ttft = Histogram(
            "mlx_gateway_time_to_first_token_seconds",
            "Time from a completion request's arrival to its first generated token.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.tokens = Counter(
            "mlx_gateway_tokens",
            "Tokens of finished completions, by kind (prompt, completion).",
            ["kind"],
            registry=reg,
        )
        self.disconnects = Counter(
            "mlx_gateway_client_disconnects",
            "Completions cancelled because the client went away first.",
            ["route"],
            registry=reg,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts and times every HTTP request (pure ASGI, so streams pass through untouched)."""

    def __init__(self, app: ASGIApp, *, metrics: GatewayMetrics, routes: Sequence[Route]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def _route(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return route.path
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route(scope)
        start = time.monotonic()
        status = 500  # what the server answers when the app raises before starting

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.duration.labels(route).observe(time.monotonic() - start)
