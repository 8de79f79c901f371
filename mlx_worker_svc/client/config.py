"""How a WorkerService client connects, waits and retries: `ClientConfig`, TLS credentials.

client/worker.py's module docstring has the deadlines, retries and credentials
these settings drive; both names are exported from there too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from mlx_worker_svc.core.tls_files import check_tls_files, valid_token


@dataclass(frozen=True)
class ClientConfig:
    """How a client connects, waits and retries (see the module docstring)."""

    timeout: float = 30.0
    """Default deadline, in seconds, of each attempt of a unary call."""
    execute_timeout: float = 600.0
    """Default deadline of Execute, whose step may be a long prefill."""
    retries: int = 3
    """Extra attempts of an idempotent call after UNAVAILABLE or DEADLINE_EXCEEDED."""
    backoff: float = 0.1
    """Wait before the first retry, in seconds; doubles for each further one."""
    max_backoff: float = 2.0
    """Longest wait between two attempts."""
    max_message_bytes: int = 64 << 20
    """Largest message sent or received."""
    keepalive_ms: int = 30_000
    """Interval of HTTP/2 keepalive pings while calls are open."""
    credentials: grpc.ChannelCredentials | None = None
    """TLS (or mTLS) credentials; a secure channel when set."""
    token: str | None = None
    """Sent as `authorization: Bearer <token>` on every call."""
    options: tuple[tuple[str, Any], ...] = ()
    """Extra gRPC channel options, after the ones above."""

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.execute_timeout <= 0:
            raise ValueError("timeout and execute_timeout must be > 0")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("backoff and max_backoff must be >= 0")
        if self.max_message_bytes <= 0 or self.keepalive_ms <= 0:
            raise ValueError("max_message_bytes and keepalive_ms must be > 0")
        if self.token is not None and not valid_token(self.token):
            raise ValueError(
                "token must be non-empty printable ASCII without spaces (a token read from a "
                "file: strip its newline)"
            )

    def channel_options(self) -> list[tuple[str, Any]]:
        """The gRPC channel options this config stands for."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", self.keepalive_ms),
            # Idle channels send no pings: servers count those as abuse.
            ("grpc.keepalive_permit_without_calls", 0),
            # Reconnect on the retry schedule. With gRPC's default (1 s, growing
            # to 120 s) every retry made while the channel waits to reconnect
            # fails at once, and a restarted worker is seen only at the next
            # reconnect, up to two minutes later.
            ("grpc.initial_reconnect_backoff_ms", max(int(self.backoff * 1000), 10)),
            ("grpc.max_reconnect_backoff_ms", max(int(self.max_backoff * 1000), 10)),
            *self.options,
        ]

    def backoff_delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (0-based), with jitter."""
        ceiling = min(self.max_backoff, self.backoff * 2.0**retry)
        return random.uniform(ceiling / 2, ceiling)


def channel_credentials(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """TLS credentials for `ClientConfig.credentials` from PEM files.

    `ca_file`: the CA bundle that signed the server's certificate (None: the
    system's roots); `cert_file` and `key_file` (both or neither): the client
    certificate and key a mutual-TLS server requires. Raises OSError for a file
    that cannot be read, ValueError for a certificate without its key, a file
    that is not PEM, a CA file without a certificate, or a certificate and key
    that do not go together (gRPC would only fail each handshake later).
    """
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        data = Path(path).read_bytes()
        if b"-----BEGIN " not in data:
            raise ValueError(f"{path} is not a PEM file")
        return data

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(ca_file),
        private_key=read(key_file),
        certificate_chain=read(cert_file),
    )
    check_tls_files(ca_file, cert_file, key_file)
    return credentials
