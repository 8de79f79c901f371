"""gRPC metrics plumbing: RPCs counted by an interceptor, the `/metrics` endpoint.

`RpcMetricsInterceptor` (for the synchronous `grpc.server` of the worker) and
`AsyncRpcMetricsInterceptor` (for the fleet's `grpc.aio` server) record every
RPC by method and final status code into `core.metrics.RpcMetrics`; a method
no service defines counts as "/unknown/unknown", so a caller cannot grow the
label set.
`MetricsEndpoint` serves a registry over HTTP (`GET /metrics`, Prometheus text
format) until it is closed. The instruments themselves live in `core/metrics.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

import grpc
import grpc.aio
from google.protobuf import descriptor_pool
from prometheus_client import CollectorRegistry, start_http_server

from mlx_worker_svc.core.flag_values import host as host_value
from mlx_worker_svc.core.flag_values import port as port_value
from mlx_worker_svc.core.metrics import RpcMetrics
from mlx_worker_svc.rpc.security import is_loopback
from mlx_worker_svc.rpc.status import deadline_passed

log = logging.getLogger(__name__)
UNKNOWN_METHOD = "/unknown/unknown"  # how a method no loaded proto defines is counted

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]


def _final_code(context: Any, exc: BaseException | None) -> grpc.StatusCode:
    """The status an RPC ends with, as its caller saw it: what abort() set, UNKNOWN for an
    escaped exception, and DEADLINE_EXCEEDED or CANCELLED when the caller left first
    (a handler that finished after the deadline still returned, but nobody got it)."""
    if isinstance(exc, GeneratorExit | asyncio.CancelledError):
        return _left(context)
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.CANCELLED:
        return code
    active = getattr(context, "is_active", None)
    if code is grpc.StatusCode.CANCELLED or (active is not None and not active()):
        return _left(context)
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN


def _left(context: Any) -> grpc.StatusCode:
    """DEADLINE_EXCEEDED if the caller's deadline has passed, else CANCELLED."""
    late = deadline_passed(context)
    return grpc.StatusCode.DEADLINE_EXCEEDED if late else grpc.StatusCode.CANCELLED


@contextlib.contextmanager
def _counted(rpcs: RpcMetrics, method: str, context: Any) -> Iterator[None]:
    """Records the RPC run inside with the status it ends with."""
    try:
        yield
    except BaseException as exc:
        rpcs.record(method, _final_code(context, exc).name)
        raise
    rpcs.record(method, _final_code(context, None).name)


def rebuild_handler(
    handler: Handler,
    wrap: Callable[[Any, bool], Any],
    *,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> Handler:
    """`handler` with its behaviour wrapped (`wrap(behaviour, response_streaming)`).

    `request_deserializer`, given, replaces the handler's own (decoding.py).
    """
    codec = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True), **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary, False), **codec)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream, True), **codec)
    return handler


@functools.lru_cache(maxsize=256)
def _label(method: str) -> str:
    """The method path as counted: "/unknown/unknown" for one no loaded proto defines
    (a call the token check or UNIMPLEMENTED refuses), so that callers without
    credentials cannot grow the label set."""
    service, _, name = method.lstrip("/").rpartition("/")
    try:
        found = descriptor_pool.Default().FindServiceByName(service)
    except KeyError:
        return UNKNOWN_METHOD
    return method if name in found.methods_by_name else UNKNOWN_METHOD


class RpcMetricsInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Counts the RPCs of a synchronous `grpc.server`; put it first, so refusals count too."""

    def __init__(self, rpcs: RpcMetrics) -> None:
        self._rpcs = rpcs

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None:  # gRPC answers UNIMPLEMENTED itself
            self._rpcs.record(UNKNOWN_METHOD, grpc.StatusCode.UNIMPLEMENTED.name)
            return None
        rpcs, method = self._rpcs, _label(handler_call_details.method)

        def wrap(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            def unary(request: Any, context: Any) -> Any:
                with _counted(rpcs, method, context):
                    return behavior(request, context)

            def stream(request: Any, context: Any) -> Iterator[Any]:
                with _counted(rpcs, method, context):
                    yield from behavior(request, context)

            return stream if streaming else unary

        return rebuild_handler(handler, wrap)


class AsyncRpcMetricsInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Counts the RPCs of a `grpc.aio.server`; put it first, so refusals count too."""

    def __init__(self, rpcs: RpcMetrics) -> None:
        self._rpcs = rpcs

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None:  # gRPC answers UNIMPLEMENTED itself
            self._rpcs.record(UNKNOWN_METHOD, grpc.StatusCode.UNIMPLEMENTED.name)
            return handler
        rpcs, method = self._rpcs, _label(handler_call_details.method)

        def wrap(behavior: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
            if inspect.isasyncgenfunction(behavior):

                async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                    with _counted(rpcs, method, context):
                        async for response in behavior(request, context):
                            yield response

                return stream
            if not inspect.iscoroutinefunction(behavior):
                return behavior  # a synchronous handler: grpc.aio runs it as it is

            async def call(request: Any, context: Any) -> Any:
                with _counted(rpcs, method, context):
                    return await behavior(request, context)

            return call

        return rebuild_handler(handler, wrap)


class MetricsEndpoint:
    """An HTTP server for one registry's `/metrics`, on a thread of its own, until closed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self.host = ""
        self.port = 0

    def start(self, host: str, port: int) -> int:
        """Binds `host:port` (0: any free port) and serves; returns the bound port.

        Raises OSError when the address cannot be bound.
        """
        try:
            self._server, self._thread = start_http_server(port, host, registry=self._registry)
        except OSError as exc:
            raise OSError(
                f"--metrics-port: cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
            ) from exc
        self.host, self.port = host, int(self._server.server_port)
        log.info("metrics on %s", self.url)
        if not is_loopback(host):
            # Counts only (no prompts, no tokens), but anyone who reaches it can read them.
            log.warning("metrics are served on %s in plaintext, without authentication", host)
        return self.port

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}/metrics"

    def close(self) -> None:
        """Stops serving and closes the socket (idempotent)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=10)


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """`--metrics-host` and `--metrics-port`, the same on `serve` and `fleet`."""
    group = parser.add_argument_group("metrics (see README: Metrics)")
    group.add_argument(
        "--metrics-port",
        type=port_value,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics over HTTP on this port (0 = any free one; default: off)",
    )
    group.add_argument(
        "--metrics-host",
        type=host_value,
        default="127.0.0.1",
        help="address of the metrics endpoint (default 127.0.0.1)",
    )


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
