"""Prometheus plumbing shared by the worker and the fleet: instruments, RPC counting, endpoint.

Every server keeps its metrics in a `CollectorRegistry` of its own (never the
process-wide default, so several servers can live in one process, as in the
tests): `ServerMetrics` holds it, with the RPC and token counters the worker
and the fleet both have. What is counted on the hot path (every engine step)
uses `OneWriterCounter` and `OneWriterHistogram`: written by one thread only
(the engine thread, or the fleet's event loop), so an update is an add with no
lock (prometheus_client's histogram takes ~8 us an observation, these <1 us).
`RpcMetrics` counts every RPC by method and final status code through a server
interceptor: `RpcMetricsInterceptor` for the synchronous `grpc.server` (the
worker), `AsyncRpcMetricsInterceptor` for `grpc.aio` (the fleet). Unknown
method names are not counted, so a caller cannot grow the label set.
`MetricsEndpoint` serves a registry over HTTP (`GET /metrics`, Prometheus text
format) until it is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import inspect
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIServer

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from mlx_worker_svc.rpc.security import is_loopback

log = logging.getLogger(__name__)

# Step and request latencies: a tiny model's step is ~1 ms, a large prefill seconds.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# Requests per step.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]


class OneWriterCounter:
    """A counter only one thread increments (no lock); any thread may read it."""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc = name, doc
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def family(self) -> Metric:
        return CounterMetricFamily(self.name, self.doc, value=self.value)


class OneWriterHistogram:
    """A histogram only one thread observes: a bisect and two adds, no lock.

    A scrape may see it an observation late (the sum read before a bucket
    moved), but `_count` is always the +Inf bucket: both come from one read.
    """

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc = name, doc
        self._bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def family(self) -> Metric:
        total, cumulative = self._sum, list(itertools.accumulate(self._counts))
        # `cumulative` has one more entry than `_bounds`: the +Inf bucket.
        buckets = [(str(b), n) for b, n in zip(self._bounds, cumulative, strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


class ServerMetrics(Collector):
    """A registry of its own, with what every server counts: RPCs and tokens.

    The one-writer instruments made by `counter` and `histogram` are
    reported through this collector.
    """

    def __init__(self, prefix: str, *, prompt_doc: str, generation_doc: str) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self.rpcs = RpcMetrics(prefix, self.registry)
        self._instruments: list[OneWriterCounter | OneWriterHistogram] = []
        self.prompt_tokens = self.counter("prompt_tokens", prompt_doc)
        self.generation_tokens = self.counter("generation_tokens", generation_doc)
        self.registry.register(self)

    def counter(self, name: str, doc: str) -> OneWriterCounter:
        counter = OneWriterCounter(f"{self.prefix}_{name}", doc)
        self._instruments.append(counter)
        return counter

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> OneWriterHistogram:
        histogram = OneWriterHistogram(f"{self.prefix}_{name}", doc, buckets)
        self._instruments.append(histogram)
        return histogram

    def collect(self) -> Iterator[Metric]:
        for instrument in self._instruments:
            yield instrument.family()


class RpcMetrics:
    """`<prefix>_rpcs_total{service, method, code}`: every RPC by its final status code."""

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self._total = Counter(
            f"{prefix}_rpcs",
            "RPCs handled, by service, method and final gRPC status code",
            ["service", "method", "code"],
            registry=registry,
        )

    def record(self, method: str, code: grpc.StatusCode | None) -> None:
        """Counts one RPC; `method` is the full path ("/pkg.Service/Method")."""
        service, _, name = method.lstrip("/").rpartition("/")
        self._total.labels(service, name, (code or grpc.StatusCode.OK).name).inc()


def _final_code(context: Any, exc: BaseException | None) -> grpc.StatusCode:
    """The status an RPC ends with: what abort() set, UNKNOWN for an escaped exception."""
    if isinstance(exc, GeneratorExit | asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN


@contextlib.contextmanager
def _counted(rpcs: RpcMetrics, method: str, context: Any) -> Iterator[None]:
    """Records the RPC run inside with the status it ends with."""
    try:
        yield
    except BaseException as exc:
        rpcs.record(method, _final_code(context, exc))
        raise
    rpcs.record(method, _final_code(context, None))


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
        if handler is None:
            return None
        rpcs, method = self._rpcs, handler_call_details.method

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
        if handler is None:
            return handler
        rpcs, method = self._rpcs, handler_call_details.method

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
        self._server, self._thread = start_http_server(port, host, registry=self._registry)
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
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics over HTTP on this port (0 = any free one; default: off)",
    )
    group.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (127.0.0.1)"
    )


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
