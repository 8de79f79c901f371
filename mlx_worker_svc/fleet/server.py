"""`mlx_worker.v1.FleetService` over gRPC (asyncio), with health and reflection (v1, v1alpha).

The servicer is thin: Generate streams `FleetScheduler.generate`, Status
returns `FleetScheduler.status`. Fleet errors map to their status codes
(RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE with no worker up,
INVALID_ARGUMENT for a malformed request, or for request bytes that do not
parse: rpc/decoding.py); a worker's error on a request keeps the worker's code
and message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.flag_values import bind_address, listening_socket
from mlx_worker_svc.fleet.errors import FleetError
from mlx_worker_svc.fleet.scheduler import FleetScheduler
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2, fleet_pb2_grpc
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.decoding import AsyncDecodeInterceptor
from mlx_worker_svc.rpc.health_service import AsyncHealthServicer
from mlx_worker_svc.rpc.metrics import AsyncRpcMetricsInterceptor
from mlx_worker_svc.rpc.reflection import enable_reflection
from mlx_worker_svc.rpc.security import (
    AsyncTokenInterceptor,
    SecurityConfig,
    check_bind,
    server_credentials,
    token_check,
)
from mlx_worker_svc.rpc.status import grpc_code

log = logging.getLogger(__name__)
SERVICE_NAME = fleet_pb2.DESCRIPTOR.services_by_name["FleetService"].full_name
_MAX_MESSAGE = 64 << 20


class FleetServicer(fleet_pb2_grpc.FleetServiceServicer):
    def __init__(self, fleet: FleetScheduler) -> None:
        self._fleet = fleet

    async def Generate(  # noqa: N802 (gRPC method name)
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse],
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for message in self._fleet.generate(request):
                yield message
        except FleetError as exc:
            await context.abort(grpc_code(exc.code), str(exc))
        except ClientError as exc:
            await context.abort(exc.code, exc.details)

    async def Status(  # noqa: N802 (gRPC method name)
        self,
        request: fleet_pb2.StatusRequest,
        context: grpc.aio.ServicerContext[fleet_pb2.StatusRequest, fleet_pb2.StatusResponse],
    ) -> fleet_pb2.StatusResponse:
        return self._fleet.status()


async def serve_fleet(
    fleet: FleetScheduler, host: str, port: int, security: SecurityConfig | None = None
) -> tuple[grpc.aio.Server, int]:
    """Starts the fleet's gRPC server; returns it and the bound port.

    `security` (default: plaintext, loopback only) adds TLS, mutual TLS and the
    bearer-token check; raises `security.UnsafeBind` for a non-loopback host
    without TLS or a token (unless insecure), OSError when it cannot bind.
    """
    security = security or SecurityConfig()
    check_bind(host, security)
    credentials = server_credentials(security)
    check = token_check(security)
    interceptors: list[grpc.aio.ServerInterceptor[Any, Any]] = [
        AsyncRpcMetricsInterceptor(fleet.metrics.rpcs)
    ]
    if check is not None:
        interceptors.append(AsyncTokenInterceptor(check))
    interceptors.append(AsyncDecodeInterceptor())
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.so_reuseport", 0),
        ],
    )
    fleet_pb2_grpc.add_FleetServiceServicer_to_server(  # type: ignore[no-untyped-call]
        FleetServicer(fleet), server
    )
    checker = AsyncHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    enable_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), server
    )
    address = bind_address(host, port)
    if port:  # a port in use: said in one line, with its cause
        listening_socket(host, port).close()
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        hint = "" if credentials is None else " (or the TLS key does not match the certificate)"
        raise OSError(f"cannot listen on {address}{hint}: {exc}") from exc
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    _health_of[id(server)] = checker
    await checker.set("", health_pb2.HealthCheckResponse.SERVING)
    # The fleet service is SERVING while at least one worker is up.
    server_tasks.add(asyncio.create_task(_track_health(fleet, checker)))
    log.info("fleet serving %s on %s:%d (%s)", SERVICE_NAME, host, bound, security.describe())
    return server, bound


server_tasks: set[asyncio.Task[None]] = set()
# Each running server's health servicer (by id(server)), for stop_fleet.
_health_of: dict[int, AsyncHealthServicer] = {}


async def stop_fleet(server: grpc.aio.Server, grace: float) -> None:
    """Stops a server serve_fleet started: its open health Watches end first (status
    OK, after the NOT_SERVING a drain set), then calls get `grace` seconds to end."""
    checker = _health_of.pop(id(server), None)
    if checker is not None:
        await checker.enter_graceful_shutdown()  # NOT_SERVING, whatever a probe saw last
        await checker.end_watches()
    await server.stop(grace=grace)


async def _track_health(fleet: FleetScheduler, checker: AsyncHealthServicer) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    while True:
        up = any(link.up for link in fleet.links) and not fleet.draining
        await checker.set(SERVICE_NAME, serving if up else not_serving)
        if fleet.draining:  # the whole server is going, as a draining worker's "" says
            await checker.set("", not_serving)
        await asyncio.sleep(0.25)
