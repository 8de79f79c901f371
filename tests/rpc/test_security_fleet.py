"""Security on the fleet: its own token and TLS, and TLS, mutual TLS and a token toward its workers.

The fleet runs in-process (FleetScheduler and serve_fleet on port 0) in front of an
in-process worker that requires a client certificate and a token: every FleetService
method is refused without the fleet's token, and the link reaches the worker.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest
from certificates import Pki, tls
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rpc.secured import (
    BAD_METADATA,
    GOOD_METADATA,
    OTHER_TOKEN,
    SERVING,
    TIMEOUT,
    TOKEN,
    UNAUTHENTICATED,
    WRONG_TOKEN,
    is_reflection_refused,
    worker_server,
)

from mlx_worker_svc.client.worker import ClientConfig, channel_credentials
from mlx_worker_svc.core.reports import WorkerState
from mlx_worker_svc.fleet import FleetConfig, FleetScheduler, LinkConfig
from mlx_worker_svc.fleet.server import serve_fleet
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2, fleet_pb2_grpc
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.security import UNAUTHENTICATED_DETAILS

FLEET_SERVICE = fleet_pb2.DESCRIPTOR.services_by_name["FleetService"]


def test_fleet_with_a_token_and_tls_toward_a_secured_worker(pki: Pki) -> None:
    """The fleet refuses its own RPCs without its token, and reaches an mTLS+token worker."""
    worker_security = tls(pki, tls_client_ca=pki.ca, tokens=(OTHER_TOKEN,))
    with worker_server(worker_security) as worker:
        target = f"127.0.0.1:{worker.port}"
        asyncio.run(_fleet_scenario(pki, target))
        # The link went through TLS and the token: InitDevice ran on the worker.
        assert worker.worker.state is WorkerState.DEVICE_READY


def _fleet_reflection_refused(port: int, pki: Pki, metadata: tuple[tuple[str, str], ...]) -> bool:
    credentials = grpc.ssl_channel_credentials(pki.read("ca"))
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        return is_reflection_refused(channel, metadata)


async def _fleet_scenario(pki: Pki, target: str) -> None:
    credentials = channel_credentials(pki.ca, pki.client_cert, pki.client_key)

    def link(token: str) -> LinkConfig:
        client = ClientConfig(credentials=credentials, token=token, backoff=0.01, max_backoff=0.05)
        return LinkConfig(client=client, retry_backoff=0.05, max_backoff=0.2)

    wrong = FleetScheduler([target], FleetConfig(link=link(WRONG_TOKEN)))
    fleet = FleetScheduler([target], FleetConfig(link=link(OTHER_TOKEN)))
    await wrong.start()
    await fleet.start()
    server, port = await serve_fleet(
        fleet, "127.0.0.1", 0, tls(pki, tokens=(TOKEN,), allow_health_without_token=True)
    )
    try:
        channel_creds = grpc.ssl_channel_credentials(pki.read("ca"))
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", channel_creds) as channel:
            stub = fleet_pb2_grpc.FleetServiceStub(channel)
            refused = 0
            for metadata in BAD_METADATA:
                for call in (
                    lambda md: stub.Status(fleet_pb2.StatusRequest(), timeout=TIMEOUT, metadata=md),
                    lambda md: _drain(stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=md)),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await call(metadata)
                    assert error.value.code() == UNAUTHENTICATED, error.value
                    assert error.value.details() == UNAUTHENTICATED_DETAILS
                    refused += 1
                # Through the sync client: grpc.aio reports a stream refused before it
                # read its first request as INTERNAL in ~2 % of calls (a client-side race).
                assert await asyncio.to_thread(_fleet_reflection_refused, port, pki, metadata)
            assert refused == len(FLEET_SERVICE.methods) * len(BAD_METADATA) == 14
            assert fleet.num_finished == 0 and fleet.status().num_queued == 0
            # Probes pass with the flag; the right token opens the rest.
            health = health_pb2_grpc.HealthStub(channel)
            answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
            assert answer.status == SERVING
            status = await stub.Status(fleet_pb2.StatusRequest(), metadata=GOOD_METADATA)
            assert [w.target for w in status.workers] == [target]
        for _ in range(200):  # the links retry quickly; give them a few rounds
            if "no --model" in fleet.links[0].last_error and wrong.links[0].last_error:
                break
            await asyncio.sleep(0.05)
        assert "no --model" in fleet.links[0].last_error  # past TLS, the token and InitDevice
        assert "UNAUTHENTICATED" in wrong.links[0].last_error
        assert wrong.links[0].last_error.endswith(  # what the operator may change
            "(the fleet sends the first token of --worker-token-file (or $MLX_WORKER_CLIENT_TOKEN))"
        )
    finally:
        await server.stop(0)
        await fleet.stop()
        await wrong.stop()


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


def test_a_worker_that_cannot_be_reached_names_the_flag_to_look_at() -> None:
    """The causes an operator sees in Status and the log end with the flag behind them."""
    import grpc

    from mlx_worker_svc.client.worker import ClientConfig, ClientError
    from mlx_worker_svc.fleet import LinkConfig
    from mlx_worker_svc.fleet.probe import hint

    plain = LinkConfig()
    refused = ClientError(
        grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token", "CheckHealth"
    )
    assert hint(refused, plain) == (
        " (the fleet sends no token: give --worker-token-file or $MLX_WORKER_CLIENT_TOKEN)"
    )
    closed = ClientError(
        grpc.StatusCode.UNAVAILABLE, "ipv4:127.0.0.1:1: Socket closed", "CheckHealth"
    )
    assert hint(closed, plain) == " (does the worker serve TLS? then give --worker-ca)"
    died = ClientError(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)", "Execute")
    assert hint(died, plain) == ""  # a worker killed mid-call: no TLS mismatch
    tls = LinkConfig(client=ClientConfig(credentials=grpc.ssl_channel_credentials()))
    assert hint(closed, tls).endswith("check --worker-client-cert and --worker-client-key)")
    # gRPC's words for a certificate the fleet's own check refuses: a failed handshake too.
    unknown = ClientError(
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Ssl "
        "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL "
        "routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get local issuer "
        "certificate",
        "CheckHealth",
    )
    assert hint(unknown, tls).startswith(" (--worker-ca must hold the CA")
    misnamed = ClientError(
        grpc.StatusCode.UNAVAILABLE,
        "Custom verification check failed with error: UNAUTHENTICATED: Hostname "
        "Verification Check failed.",
        "CheckHealth",
    )
    assert hint(misnamed, tls).startswith(" (the worker's certificate must name the host")
    plaintext = ClientError(
        grpc.StatusCode.UNAVAILABLE,
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Ssl "
        "handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL "
        "routines:OPENSSL_internal:WRONG_VERSION_NUMBER",
        "CheckHealth",
    )
    assert hint(plaintext, tls).startswith(" (the worker does not serve TLS")
