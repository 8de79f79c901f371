"""The gRPC server: WorkerService, health, reflection (v1 and v1alpha) and the one drain path.

`WorkerServer` registers the servicer, the standard `grpc.health.v1` service
and server reflection in one place. SIGTERM and the Shutdown RPC share
`shutdown()`: health turns NOT_SERVING, the worker stops taking new work,
in-flight Generate streams, and the requests schedulers are running (their
steps still run), get the grace period to finish, the server stops,
and the model and caches are freed. A second SIGTERM or SIGINT during the drain
ends the grace period at once. `ServerConfig.security` adds TLS, mutual
TLS and the bearer-token check, and enforces the bind rule (security.py).
`ServerConfig.limits` bounds the work admitted (limits.py); the thread pool and
message sizes follow from it. If the engine thread dies, health turns
NOT_SERVING, every call ends with INTERNAL, and the server stops within
`death_exit_seconds` so a supervisor can restart the process; rank 0 of a
worker group (`group`) does the same, with UNAVAILABLE, when the group breaks.
Request bytes that do not parse are refused with INVALID_ARGUMENT (decoding.py).
`ServerConfig.metrics_port` serves the worker's Prometheus metrics
(worker_metrics.py) over HTTP until the server stops.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlx_worker_svc.core.flag_values import bind_address, listening_socket
from mlx_worker_svc.core.lifecycle import EXECUTABLE
from mlx_worker_svc.core.limits import FALLBACK_CONTEXT_TOKENS, AdmissionLimits, message_limit
from mlx_worker_svc.core.reports import WorkerState
from mlx_worker_svc.core.signals import STOP_SIGNALS, Signals
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.decoding import DecodeInterceptor
from mlx_worker_svc.rpc.health_service import HealthServicer
from mlx_worker_svc.rpc.metrics import MetricsEndpoint, RpcMetricsInterceptor
from mlx_worker_svc.rpc.reflection import enable_reflection
from mlx_worker_svc.rpc.security import (
    SecurityConfig,
    TokenInterceptor,
    check_bind,
    server_credentials,
    token_check,
)
from mlx_worker_svc.rpc.servicer import WorkerServicer
from mlx_worker_svc.worker.metrics import WorkerMetrics
from mlx_worker_svc.worker.worker import Worker

if TYPE_CHECKING:
    from mlx_worker_svc.engine.group.channel import GroupChannel

log = logging.getLogger(__name__)

# The least time a stopping server gives calls already ended to send their status.
END_SECONDS = 0.1
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    grace_seconds: float = 30.0
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    """Running requests and queued steps admitted; past them RESOURCE_EXHAUSTED."""
    max_context_tokens: int = FALLBACK_CONTEXT_TOKENS
    """The model's context length, which sizes the message limit."""
    max_message_bytes: int = 0
    """Largest message either way; 0 derives it from the context and the limits."""
    death_exit_seconds: float = 10.0
    """After the engine thread dies, the server stops within this time."""
    keepalive_seconds: float = 60.0
    """The server pings a client this often to find dead connections (and free their KV)."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS, mTLS and tokens; the default is plaintext and loopback only (security.py)."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    """Prometheus metrics over HTTP on this port (0: any free one); None: not served."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """The engine's options (engine/options.py), the same for every runner it builds."""
    profile_dir: str | os.PathLike[str] | None = None
    """Where StartProfile/StopProfile write profiles (a str or a Path); None: profiling is off."""

    @property
    def message_bytes(self) -> int:
        return self.max_message_bytes or message_limit(self.max_context_tokens, self.limits)


class WorkerServer:
    """A running worker process: server, worker, health and drain."""

    def __init__(
        self, config: ServerConfig, worker: Worker | None = None, group: GroupChannel | None = None
    ) -> None:
        self.config = config
        self._health = HealthServicer(experimental_non_blocking=True)
        self.worker = worker or Worker(
            on_state=self._on_state,
            on_death=self._on_engine_death,
            limits=config.limits,
            group=group,
            options=config.engine,
            profile_dir=config.profile_dir,
        )
        self.engine_died = threading.Event()
        self.metrics: WorkerMetrics = self.worker.metrics
        self.metrics.watch(
            lambda: self.worker.health(deep=False), lambda: self.worker.queued_steps, config.limits
        )
        self._metrics_endpoint = MetricsEndpoint(self.metrics.registry)
        interceptors: list[grpc.ServerInterceptor[Any, Any]] = [
            RpcMetricsInterceptor(self.metrics.rpcs)
        ]
        check = token_check(config.security)
        if check is not None:
            interceptors.append(TokenInterceptor(check))
        interceptors.append(DecodeInterceptor())
        threads = config.limits.threads
        self._server = grpc.server(
            interceptors=interceptors,
            thread_pool=futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grpc"),
            # Admission keeps the pool from filling; if it ever does, further
            # calls are refused at once rather than queued.
            maximum_concurrent_rpcs=threads,
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", config.message_bytes),
                ("grpc.max_send_message_length", config.message_bytes),
                ("grpc.keepalive_time_ms", int(config.keepalive_seconds * 1000)),
                ("grpc.keepalive_timeout_ms", 20_000),
                # Clients ping every 30 s during long calls (client.py): allow it.
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ],
        )
        pb_grpc.add_WorkerServiceServicer_to_server(  # type: ignore[no-untyped-call]
            WorkerServicer(self.worker, self.shutdown, max_message_bytes=config.message_bytes),
            self._server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        enable_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
            self._server,
        )
        self._stopped = threading.Event()
        self._drain_lock = threading.Lock()
        self._cut = threading.Event()  # a second signal: the grace period ends now
        self._draining = False
        self._deadline = 0.0  # time.monotonic() at which the drain's grace ends
        self.port = 0
        self.metrics_port = 0
        """The bound metrics port (0 until started, or when not served)."""

    def _on_state(self, state: WorkerState) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        self._health.set(SERVICE_NAME, serving if state in EXECUTABLE else not_serving)

    def _on_engine_death(self, cause: BaseException) -> None:
        log.critical("the engine thread died (%r): stopping the server", cause)
        self.engine_died.set()
        # For half the time, probes can still read NOT_SERVING and the cause; then
        # the server stops. The command line's watchdog ends the process at the full time.
        half = self.config.death_exit_seconds / 2

        def stop() -> None:
            time.sleep(half)
            self.shutdown(grace_seconds=max(half / 2, 0.1), abort=True)

        threading.Thread(target=stop, name="engine-death", daemon=True).start()

    def start(self) -> int:
        """Binds and starts serving; returns the bound port.

        Raises `security.UnsafeBind` for a non-loopback host without TLS or a
        token (unless insecure), `security.SecurityError` for unreadable PEM
        files and OSError when the address cannot be bound.
        """
        address = bind_address(self.config.host, self.config.port)
        security = self.config.security
        check_bind(self.config.host, security)
        credentials = server_credentials(security)
        if self.config.port:  # a port in use: said in one line, with its cause
            listening_socket(self.config.host, self.config.port).close()
        try:
            if credentials is None:
                self.port = self._server.add_insecure_port(address)
            else:
                self.port = self._server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            hint = "" if credentials is None else " (or the TLS key does not match the certificate)"
            raise OSError(f"cannot listen on {address}{hint}: {exc}") from exc
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (in use or not a local address)")
        if self.config.metrics_port is not None:
            self.metrics_port = self._metrics_endpoint.start(
                self.config.metrics_host, self.config.metrics_port
            )
        self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._on_state(self.worker.state)
        self._server.start()
        log.info(
            "serving %s on %s:%d (%s)",
            SERVICE_NAME,
            self.config.host,
            self.port,
            security.describe(),
        )
        return self.port

    @property
    def draining(self) -> bool:
        """Whether the drain has begun (SIGTERM, SIGINT or Shutdown)."""
        return self._draining

    def shutdown(self, grace_seconds: float = 0.0, abort: bool = False) -> None:
        """Starts the drain; during one, `abort` or a shorter grace cuts it short.

        Returns once the worker refuses new work (UNAVAILABLE) and health says
        NOT_SERVING, in that order; the wait for open streams and the stop run
        in the background. A later call never lengthens the grace period.
        """
        grace = grace_seconds or self.config.grace_seconds
        with self._drain_lock:
            if self._draining:
                if abort:
                    self.cut_drain()
                elif time.monotonic() + grace < self._deadline:
                    log.info("draining: the grace period is shortened to %.1fs", grace)
                    self._deadline = time.monotonic() + grace
                return
            self._draining = True
            self._deadline = time.monotonic() + grace
        log.info("draining (grace %.1fs, abort=%s)", grace, abort)
        try:
            self.worker.begin_drain()
        except Exception:
            log.exception("drain: the worker could not stop taking work")
        self._health.enter_graceful_shutdown()
        threading.Thread(target=self._drain, args=(abort,), name="drain", daemon=True).start()

    def cut_drain(self) -> None:
        """Ends the grace period of a drain under way at once (a second signal)."""
        if self._draining and not self._cut.is_set():
            log.info("draining: the grace period is cut short; work in flight ends now")
            self._cut.set()

    def _drain(self, abort: bool) -> None:
        try:
            # In slices, so that cut_drain() or a shorter grace ends the wait within one.
            while not abort and not self._cut.is_set():
                left = self._deadline - time.monotonic()
                if left <= 0 or self.worker.wait_idle(min(left, 0.1)):
                    break
        except Exception:
            log.exception("drain: the worker could not drain cleanly")
        finally:
            self.worker.close()
            # A probe's open Watch would hold up the stop: it ends (OK) first, so that a
            # stop with no grace left does not cancel it.
            self._health.end_watches()
            # Calls ended by close() (and the Watches) still send their status within what
            # is left, and at least END_SECONDS.
            left = 0.0 if self._cut.is_set() else self._deadline - time.monotonic()
            stopped = self._server.stop(max(left, END_SECONDS))  # no call starts from here on
            stopped.wait()
            self._metrics_endpoint.close()
            self._stopped.set()
            log.info("stopped")

    def install_signal_handlers(self) -> None:
        """SIGTERM, SIGINT and SIGHUP start the same drain as the Shutdown RPC; a second one
        during the drain cuts its grace period short (`cut_drain`)."""

        signals = Signals()

        def handle(signum: int, _frame: object) -> None:
            seen = signals.arrived()
            if seen == "same":  # one signal delivered twice
                return
            if self._draining and seen == "again":
                log.info("signal %d again", signum)
                self.cut_drain()
                return
            log.info("signal %d: shutting down", signum)
            self.shutdown()

        for signum in STOP_SIGNALS:
            signal.signal(signum, handle)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the server has stopped; returns whether it has."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._stopped.is_set():
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._stopped.wait(0.5 if left is None else min(left, 0.5))
        return True
