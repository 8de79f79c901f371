"""A link's health probes: one CheckHealth at a time, never retried, misses counted.

`Prober.check` answers None while the worker is usable, else why it is not: a
refused connection at once, `probe_misses` timeouts in a row (hung), a new
`worker_epoch` (restarted) or a state that takes no requests. A retry would
stretch the detection time, so the prober's client makes one attempt a call.
"""

from __future__ import annotations

from dataclasses import replace

import grpc

from mlx_worker_svc.client.worker import AsyncWorkerClient, ClientError
from mlx_worker_svc.fleet.bring_up import FINAL
from mlx_worker_svc.fleet.config import LinkConfig
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


class Prober:
    def __init__(self, target: str, config: LinkConfig) -> None:
        self.config = config
        self.client = AsyncWorkerClient(target, replace(config.client, retries=0))
        self.misses = 0

    async def health(self) -> pb.CheckHealthResponse:
        """One CheckHealth with the probe deadline (raises ClientError)."""
        return await self.client.check_health(timeout=self.config.probe_timeout)

    async def answers(self) -> bool:
        """Whether the worker answers a health check now."""
        try:
            await self.health()
        except (ClientError, RuntimeError):
            return False
        return True

    async def check(self, epoch: int) -> str | None:
        """None while the worker of `epoch` is usable, else why it is not."""
        timeout = self.config.probe_timeout
        try:
            health = await self.health()
        except ClientError as exc:
            if exc.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"{exc.code.name}: {exc.details}"
            self.misses += 1
            if self.misses < self.config.probe_misses:
                return None
            return f"the worker answered no health check in {self.misses} tries of {timeout:g} s"
        self.misses = 0
        if health.worker_epoch != epoch:
            return f"the worker restarted (worker_epoch {health.worker_epoch}, was {epoch})"
        if health.state not in FINAL:
            return f"the worker is {pb.WorkerState.Name(health.state)}"
        return None

    async def close(self) -> None:
        await self.client.close()


def hint(exc: Exception, config: LinkConfig) -> str:
    """What an operator may do about a worker that cannot be reached ("" when nothing
    more is known): the flags behind a refused token or a TLS mismatch."""
    if not isinstance(exc, ClientError):
        return ""
    if exc.code is grpc.StatusCode.UNAUTHENTICATED:
        sent = (
            "the fleet sends the first token of --worker-token-file (or $MLX_WORKER_CLIENT_TOKEN)"
            if config.client.token
            else "the fleet sends no token: give --worker-token-file or $MLX_WORKER_CLIENT_TOKEN"
        )
        return f" ({sent})"
    # First what the fleet's own check of the worker's certificate said: gRPC words it
    # as a failed handshake too.
    if "CERTIFICATE_VERIFY_FAILED" in exc.details:
        return (
            " (--worker-ca must hold the CA that signed the worker's certificate, and the "
            "certificate must be valid now)"
        )
    if "WRONG_VERSION_NUMBER" in exc.details:  # TLS spoken to a plaintext listener
        return (
            " (the worker does not serve TLS: start it with --tls-cert and --tls-key, or "
            "dial it in plaintext: no --worker-ca, --worker-client-cert or --worker-client-key)"
        )
    if "Hostname Verification" in exc.details:
        return " (the worker's certificate must name the host or IP address --worker gives)"
    # A stream gRPC removed was up: the worker died or restarted, no TLS mismatch.
    closed = exc.code is grpc.StatusCode.UNAVAILABLE and "Stream removed" not in exc.details
    closed = closed and ("Socket closed" in exc.details or "handshake" in exc.details.lower())
    if closed and config.client.credentials is None:
        return " (does the worker serve TLS? then give --worker-ca)"
    if closed:  # over TLS: a worker with --tls-client-ca refused the fleet's certificate
        return (
            " (a worker that requires client certificates closes the connection on a "
            "missing, expired or unknown one: check --worker-client-cert and "
            "--worker-client-key)"
        )
    return ""
