"""Serving the gateway app with uvicorn: the socket, TLS, the listening line, the stop.

The socket is bound here (so a taken port or a bad address is an `OSError`
before anything starts, and port 0 reports the port it got); TLS and mutual
TLS come from the same `SecurityConfig` as the workers' and the fleet's. The
caller owns the signals: `stop()` drains the fleet (new requests get 503, the
ones in flight may finish for `grace` seconds, then end with an error in the
API's shape) and then ends the server, which stops the fleet (the app's
lifespan).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Iterator

import uvicorn

from mlx_worker_svc.core.flag_values import listening_socket
from mlx_worker_svc.fleet import FleetScheduler
from mlx_worker_svc.gateway.app import GatewayConfig, create_app

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server without its own signal handling: the command installs its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    """One gateway: `start()` binds and serves, `stop()` ends it, `wait()` until it has."""

    def __init__(
        self,
        fleet: FleetScheduler,
        host: str,
        port: int,
        config: GatewayConfig,
        *,
        grace: float = 30.0,
    ) -> None:
        security = config.security
        self.host = host
        self._fleet, self._grace = fleet, grace
        self._draining: asyncio.Task[None] | None = None
        self._sock = listening_socket(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._server = _Server(
            uvicorn.Config(
                create_app(fleet, config),
                lifespan="on",
                log_config=None,  # the command's logging setup
                timeout_graceful_shutdown=5,  # after the drain: the last replies go out
                ssl_certfile=security.tls_cert,
                ssl_keyfile=security.tls_key,
                ssl_ca_certs=security.tls_client_ca,
                ssl_cert_reqs=ssl.CERT_REQUIRED if security.mtls else ssl.CERT_NONE,
            )
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serves; returns once connections are accepted (OSError: unusable TLS files)."""
        try:
            self._server.config.load()  # reads the TLS files now, not in the serving task
        except (OSError, ValueError) as exc:
            self._sock.close()
            raise OSError(f"cannot serve TLS: {exc}") from exc
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._sock.close()
                await self._task  # raises what stopped it
                raise OSError("the gateway stopped while starting")
            await asyncio.sleep(0.02)
        scheme = "https" if self._server.config.is_ssl else "http"
        log.info("gateway serving %s://%s:%d", scheme, self.host, self.port)

    def stop(self) -> None:
        """Drains the fleet, then ends the server; a second call cuts the drain's grace
        period short (requests in flight end with an error in the API's shape)."""
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain())
        else:
            self._fleet.hurry()

    async def _drain(self) -> None:
        await self._fleet.drain(self._grace)
        self._server.should_exit = True

    async def wait(self) -> None:
        if self._task is not None:
            await self._task
        self._sock.close()
