"""The standard `grpc.health.v1` servicers, with the `List` RPC that grpcio-health leaves out.

grpcio-health-checking 1.85 generates `Health/List` but implements only Check and
Watch: a List call runs the generated stub, which raises NotImplementedError
(UNIMPLEMENTED for the client, a traceback in the server's log). These
subclasses answer it from the statuses the servicer holds: every service set,
with its status, and "" for the whole server. A Check of a service the server
does not have is NOT_FOUND, as grpcio-health answers it, but with a message
naming it and the names the server has (grpcio-health's has none).
"""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import _async, health, health_pb2


def _unknown(service: str, statuses: dict[str, int]) -> str:
    names = ", ".join(repr(name) for name in sorted(statuses))
    return f"no service {service!r} on this server (its health names: {names})"


def _listing(statuses: dict[str, int]) -> health_pb2.HealthListResponse:
    return health_pb2.HealthListResponse(
        statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in statuses.items()}
    )


class HealthServicer(health.HealthServicer):
    """grpcio-health's servicer for a synchronous `grpc.server`, with List; a status
    set again unchanged sends Watch streams nothing (grpcio-health would send it again)."""

    def set(self, service: str, status: int) -> None:
        with self._lock:
            if self._server_status.get(service) == status:
                return
        super().set(service, status)

    def Check(  # noqa: N802 (gRPC method name)
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        with self._lock:
            statuses = dict(self._server_status)
        if request.service not in statuses:
            context.abort(grpc.StatusCode.NOT_FOUND, _unknown(request.service, statuses))
        return health_pb2.HealthCheckResponse(status=statuses[request.service])

    def List(  # noqa: N802 (gRPC method name)
        self, request: health_pb2.HealthListRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthListResponse:
        with self._lock:
            return _listing(dict(self._server_status))

    def end_watches(self) -> None:
        """Ends every open Watch stream with status OK, for a server that stops: the
        stop's grace period waits for open calls, and a probe's Watch never ends."""
        with self._lock:
            ends = [end for watchers in self._send_response_callbacks.values() for end in watchers]
        for end in ends:
            end(None)  # grpcio-health's end of a Watch: the callback closes it


class AsyncHealthServicer(_async.HealthServicer):  # type: ignore[misc] # untyped in grpc-stubs
    """grpcio-health's servicer for `grpc.aio.server`, with List, and Watch streams that
    `end_watches` ends with status OK (grpcio-health's never end, so a stopping server
    cancels them: UNAVAILABLE)."""

    def __init__(self) -> None:
        super().__init__()
        self._ending = False

    async def Watch(  # noqa: N802 (gRPC method name)
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """grpcio-health's Watch (each change of the status, once), until `end_watches`."""
        service = request.service
        condition = self._server_watchers[service]
        self._watcher_count_by_service[service] += 1
        last = None
        try:
            async with condition:
                while True:
                    status = self._server_status.get(
                        service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                    )
                    if status != last:
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                    if self._ending:
                        return
                    await condition.wait()
        finally:
            self._watcher_count_by_service[service] -= 1
            if self._watcher_count_by_service[service] == 0:
                del self._server_watchers[service]
                del self._watcher_count_by_service[service]

    async def end_watches(self) -> None:
        """Ends every open Watch stream (and any opened later) with status OK, after the
        status it holds, for a server that stops."""
        self._ending = True
        for condition in list(self._server_watchers.values()):
            async with condition:
                condition.notify_all()

    async def Check(  # noqa: N802 (gRPC method name)
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        statuses = dict(self._server_status)
        if request.service not in statuses:
            await context.abort(grpc.StatusCode.NOT_FOUND, _unknown(request.service, statuses))
        return health_pb2.HealthCheckResponse(status=statuses[request.service])

    async def List(  # noqa: N802 (gRPC method name)
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthListResponse:
        return _listing(dict(self._server_status))
