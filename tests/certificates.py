"""Throwaway certificates for the TLS tests: two CAs, a server and client certificates."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_worker_svc.rpc.security import SecurityConfig


@dataclass(frozen=True)
class Pki:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # unrelated to everything above
    other_client_cert: str  # signed by other_ca
    other_client_key: str

    def read(self, name: str) -> bytes:
        return Path(getattr(self, name)).read_bytes()


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        ["/usr/bin/openssl", *args], cwd=cwd, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr}"


def _make_ca(directory: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip


def _make_leaf(directory: Path, name: str, ca: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=directory,
    )  # fmt: skip


def make_pki(d: Path) -> Pki:
    """Two CAs, a server certificate for 127.0.0.1 and localhost, and client certificates."""
    _make_ca(d, "ca")
    _make_ca(d, "other-ca")
    _make_leaf(
        d,
        "server",
        "ca",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    _make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _make_leaf(d, "other-client", "other-ca", "extendedKeyUsage=clientAuth\n")
    return Pki(
        ca=str(d / "ca.pem"),
        server_cert=str(d / "server.pem"),
        server_key=str(d / "server.key"),
        client_cert=str(d / "client.pem"),
        client_key=str(d / "client.key"),
        other_ca=str(d / "other-ca.pem"),
        other_client_cert=str(d / "other-client.pem"),
        other_client_key=str(d / "other-client.key"),
    )


def tls(pki: Pki, **fields: Any) -> SecurityConfig:
    """A TLS server config with the server certificate, and `fields`."""
    return SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.server_key, **fields)
