"""Secured servers and the calls that probe them, for the security tests (test_security*.py).

The tokens the tests configure, every way of not presenting one (`BAD_METADATA`),
an in-process worker server with a `SecurityConfig`, a TLS channel, and calls that
say whether the server refused them with UNAUTHENTICATED and the fixed message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import grpc.aio
from driver import code_of, details_of
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.security import UNAUTHENTICATED_DETAILS, SecurityConfig
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer

TOKEN = "tok-3f9a1c"
OTHER_TOKEN = "tok-rotated-7b2e"
WRONG_TOKEN = "tok-3f9a1d"  # one character off
WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
SERVING = health_pb2.HealthCheckResponse.SERVING
TIMEOUT = 10.0
# Every way of not presenting the token: none, a wrong one, a malformed header.
BAD_METADATA: tuple[tuple[tuple[str, str], ...], ...] = (
    (),
    (("authorization", f"Bearer {WRONG_TOKEN}"),),
    (("authorization", f"Bearer {TOKEN}x"),),
    (("authorization", f"Basic {TOKEN}"),),
    (("authorization", TOKEN),),
    (("authorization", "Bearer "),),
    (("x-token", TOKEN),),
)
GOOD_METADATA = (("authorization", f"Bearer {TOKEN}"),)


@contextmanager
def worker_server(security: SecurityConfig, host: str = "127.0.0.1") -> Iterator[WorkerServer]:
    server = WorkerServer(ServerConfig(host=host, port=0, grace_seconds=5.0, security=security))
    server.start()
    try:
        yield server
    finally:
        server.shutdown(grace_seconds=1.0, abort=True)
        assert server.wait(timeout=30)


@contextmanager
def secure_channel(
    port: int, ca: bytes | None, cert: bytes | None = None, key: bytes | None = None
) -> Iterator[grpc.Channel]:
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        yield channel


def health_status(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest()
    return int(stub.Check(request, timeout=TIMEOUT, metadata=metadata).status)


def call_empty(
    channel: grpc.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    metadata: tuple[tuple[str, str], ...],
) -> None:
    """Calls `method` with an empty request (one on a request stream) and reads every answer."""
    path = f"/{service.full_name}/{method.name}"
    request = message_factory.GetMessageClass(method.input_type)()
    response = message_factory.GetMessageClass(method.output_type)
    if method.client_streaming:
        both = channel.stream_stream(path, type(request).SerializeToString, response.FromString)
        list(both(iter([request]), timeout=TIMEOUT, metadata=metadata))
    elif method.server_streaming:
        stream = channel.unary_stream(path, type(request).SerializeToString, response.FromString)
        list(stream(request, timeout=TIMEOUT, metadata=metadata))
    else:
        unary = channel.unary_unary(path, type(request).SerializeToString, response.FromString)
        unary(request, timeout=TIMEOUT, metadata=metadata)


def is_refused(call: Callable[..., object], *args: Any) -> bool:
    """Whether `call(*args)` failed with UNAUTHENTICATED and the fixed message."""
    try:
        call(*args)
    except grpc.RpcError as exc:
        assert code_of(exc) == UNAUTHENTICATED, f"{code_of(exc)}: {details_of(exc)}"
        assert details_of(exc) == UNAUTHENTICATED_DETAILS
        return True
    return False


def is_reflection_refused(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> bool:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    return is_refused(lambda: list(stub.ServerReflectionInfo(iter([ask]), metadata=metadata)))
