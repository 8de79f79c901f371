"""Security settings and the command line: the bind rule, config checks, `serve` flags.

Without TLS or a token a server listens on loopback only (`--insecure` to bind
elsewhere); the security config refuses half-set or unreadable settings; `mlx-worker
serve` subprocesses take their token from the environment and serve health
without one only with the probe flag.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import grpc.aio
import pytest
from certificates import Pki, tls
from rpc.secured import (
    OTHER_TOKEN,
    SERVING,
    TOKEN,
    WORKER_SERVICE,
    call_empty,
    health_status,
    is_refused,
    secure_channel,
)

from mlx_worker_svc.cli.envs import MLX_WORKER_CLIENT_TOKEN as CLIENT_TOKEN_ENV
from mlx_worker_svc.cli.envs import MLX_WORKER_TOKEN as TOKEN_ENV
from mlx_worker_svc.client.worker import channel_credentials
from mlx_worker_svc.rpc.security import (
    SecurityConfig,
    SecurityError,
    UnsafeBind,
    check_bind,
    is_loopback,
)
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer


def test_bind_rule(pki: Pki) -> None:
    for host in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
        check_bind(host, SecurityConfig())
    for host in ("0.0.0.0", "::", "[::]", "", "10.0.0.5", "example.com"):
        assert not is_loopback(host), host
        with pytest.raises(UnsafeBind, match="--insecure"):
            check_bind(host, SecurityConfig())
        check_bind(host, SecurityConfig(insecure=True))
        check_bind(host, SecurityConfig(tokens=(TOKEN,)))
        check_bind(host, tls(pki))
    unsafe = WorkerServer(ServerConfig(host="0.0.0.0", port=0))
    with pytest.raises(UnsafeBind):
        unsafe.start()
    unsafe.worker.close()


def test_config_validation(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="--tls-key"):
        SecurityConfig(tls_cert=pki.server_cert)
    with pytest.raises(SecurityError, match="--tls-cert"):
        SecurityConfig(tls_client_ca=pki.ca)
    with pytest.raises(SecurityError, match="printable ASCII"):
        SecurityConfig(tokens=("",))
    assert TOKEN not in repr(SecurityConfig(tokens=(TOKEN,)))
    (tmp_path / "not.pem").write_text("hello")
    broken = SecurityConfig(tls_cert=str(tmp_path / "not.pem"), tls_key=pki.server_key)
    server = WorkerServer(ServerConfig(port=0, security=broken))
    with pytest.raises(SecurityError, match="not a PEM file"):
        server.start()
    server.worker.close()
    # PEM files of the wrong kind, which gRPC would refuse only as a bind error.
    server_files: list[tuple[str, str, str | None, str]] = [
        (pki.server_cert, pki.client_key, None, "(KEY_VALUES_MISMATCH)"),
        (pki.server_key, pki.server_cert, None, "are not a certificate and its key"),
        (pki.server_cert, pki.server_key, pki.server_key, "(--tls-client-ca)"),
    ]
    for tls_cert, tls_key, client_ca, says in server_files:
        wrong = SecurityConfig(tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=client_ca)
        server = WorkerServer(ServerConfig(port=0, security=wrong))
        with pytest.raises(SecurityError, match=re.escape(says)):
            server.start()
        server.worker.close()
    swapped = _cli("serve", "--tls-cert", pki.server_key, "--tls-key", pki.server_cert)
    assert swapped.returncode == 2
    assert swapped.stderr.strip() == (
        f"mlx-worker serve: the TLS certificate (--tls-cert) {pki.server_key} and the key "
        f"(--tls-key) {pki.server_cert} are not a certificate and its key "
        "(no certificate in the first file)"
    )
    with pytest.raises(ValueError, match="needs its key"):
        channel_credentials(pki.ca, cert_file=pki.client_cert)
    for given, missing, path in (
        ("--worker-client-cert", "--worker-client-key", pki.client_cert),
        ("--worker-client-key", "--worker-client-cert", pki.client_key),
    ):  # the fleet's flags: the one left out is named
        half = _cli("fleet", "--worker", "127.0.0.1:1", "--port", "0", given, path)
        assert half.returncode == 2, half.stderr
        assert half.stderr.strip() == (
            f"mlx-worker fleet: {given} needs {missing} too (a client certificate and its key)"
        )
    # PEM files of the wrong kind, which gRPC refuses only at each handshake.
    for ca, cert, key, says in (
        (pki.server_key, None, None, f"the CA file {pki.server_key} holds no certificate"),
        (pki.ca, pki.client_key, pki.client_cert, "are not a certificate and its key"),
        (pki.ca, pki.client_cert, pki.server_key, "(KEY_VALUES_MISMATCH)"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            channel_credentials(ca, cert, key)
    channel_credentials(pki.ca, pki.client_cert, pki.client_key)
    done = _cli("fleet", "--worker", "127.0.0.1:1", "--port", "0", "--worker-ca", pki.server_key)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"mlx-worker fleet: --worker-ca: the CA file {pki.server_key} holds no certificate "
        "(NO_CERTIFICATE_OR_CRL_FOUND)"
    )


# ------------------------------------------------------------ the CLI


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, CLIENT_TOKEN_ENV)}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlx_worker_svc", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=_env(),
    )


def test_cli_refuses_an_unsafe_bind() -> None:
    done = _cli("serve", "--host", "0.0.0.0", "--port", "0", "--model", "/nonexistent")
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(
        "mlx-worker serve: refusing to listen on 0.0.0.0 (--host) without TLS or a token"
    )
    assert "--insecure" in line
    fleet = _cli("fleet", "--worker", "127.0.0.1:1", "--host", "0.0.0.0", "--port", "0")
    assert fleet.returncode == 2 and "fleet: refusing to listen on 0.0.0.0" in fleet.stderr
    half = _cli("serve", "--tls-cert", "cert.pem", "--model", "/nonexistent")
    assert half.returncode == 2 and "--tls-key" in half.stderr


class _Serve:
    """`mlx-worker serve` (no model needed without --auto-init), stopped with SIGTERM."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_worker_svc", "serve", "--port", "0", "--model", "x", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env or _env(),
        )
        self.lines: list[str] = []
        listening = threading.Event()
        self.port = 0

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if match := re.search(r"listening on [\d.]+:(\d+)", line):
                    self.port = int(match.group(1))
                    listening.set()
            listening.set()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()
        assert listening.wait(120) and self.port, "".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self._reader.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return code


def test_cli_insecure_starts_on_all_interfaces() -> None:
    serve = _Serve("--host", "0.0.0.0", "--insecure")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{serve.port}") as channel:
            assert health_status(channel) == SERVING
    finally:
        assert serve.stop() == 0, "".join(serve.lines)
    assert "".join(serve.lines).count("without TLS or a token (--insecure)") == 1


def test_cli_token_from_the_environment_and_the_probe_flag(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(f"# the worker token\n{TOKEN}\n")
    env = {**_env(), TOKEN_ENV: OTHER_TOKEN}
    serve = _Serve(
        "--host", "0.0.0.0", "--token-file", str(tmp_path / "tokens"),
        "--allow-health-without-token", env=env,
    )  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{serve.port}") as channel:
            assert health_status(channel) == SERVING
            get_info = WORKER_SERVICE.methods_by_name["GetInfo"]
            assert is_refused(call_empty, channel, WORKER_SERVICE, get_info, ())
            for token in (TOKEN, OTHER_TOKEN):
                call_empty(
                    channel, WORKER_SERVICE, get_info, (("authorization", f"Bearer {token}"),)
                )
    finally:
        assert serve.stop() == 0, "".join(serve.lines)
    assert "".join(serve.lines).count("tokens travel in clear") == 1  # not once a check


def test_a_token_file_that_cannot_work_is_named_by_its_flag(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("# nothing yet\n")
    (tmp_path / "spaced").write_text("a token with spaces\n")
    worker = ["--worker", "127.0.0.1:1", "--port", "0"]
    for command, flag, path, says in (
        ("gateway", "--api-key-file", tmp_path / "empty", "holds no token"),
        ("fleet", "--worker-token-file", tmp_path / "missing", "cannot read"),
        ("serve", "--token-file", tmp_path / "empty", "holds no token"),
        ("serve", "--token-file", tmp_path / "spaced", "printable ASCII without spaces (check"),
    ):
        args = ["--port", "0"] if command == "serve" else worker
        done = _cli(command, *args, flag, str(path))
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert f"{flag} {path}" in line and says in line, line


def test_a_failed_handshake_adds_no_line_to_the_json_log(pki: Pki) -> None:
    """gRPC's C library logged each client's failed TLS handshake on its own, a line the
    client chose to cause, not JSON beside `--log-format json`: it logs errors only."""
    serve = _Serve(
        "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
        "--tls-client-ca", pki.ca, "--log-format", "json",
    )  # fmt: skip
    try:
        for _ in range(3):  # no client certificate: the server ends the handshake
            with (
                secure_channel(serve.port, pki.read("ca")) as channel,
                pytest.raises(grpc.RpcError),
            ):
                health_status(channel)
        with secure_channel(
            serve.port, pki.read("ca"), pki.read("client_cert"), pki.read("client_key")
        ) as channel:
            assert health_status(channel) == SERVING
    finally:
        assert serve.stop() == 0, "".join(serve.lines)
    logged = [line for line in serve.lines if not line.startswith("mlx-worker listening on")]
    assert logged and all(json.loads(line)["level"] for line in logged), "".join(logged)
