"""What gRPC checks of TLS files only at each handshake, checked once up front.

gRPC takes PEM bytes as they are: a key given as a certificate, a CA bundle
that holds no certificate, or a certificate with another's key fail only
when a connection is made (or, for a server, as a bind error that blames
the address). `check_tls_files` reads them with the ssl module at start-up
instead and raises ValueError saying which file is wrong and why. So with a
bearer token: one a header cannot carry fails every call with gRPC's
"Illegal header value"; `valid_token` is the check servers and clients make
when they are given one.
"""

from __future__ import annotations

import ssl


def valid_token(token: str) -> bool:
    """Whether `token` can be a bearer token: gRPC metadata values are printable ASCII,
    and a space would split the header."""
    return bool(token) and all(0x21 <= ord(c) <= 0x7E for c in token)


def check_tls_files(
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
    *,
    ca: str = "the CA file",
    cert: str = "the client certificate",
    key: str = "key",
) -> None:
    """Raises ValueError unless `ca_file` holds a certificate and `cert_file` and
    `key_file` are a certificate (chain) and its key; `ca`, `cert` and `key` name
    the files in the message (a flag, for a server's)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=ca_file)
        except ssl.SSLError as exc:
            raise ValueError(f"{ca} {ca_file} holds no certificate ({exc.reason})") from exc
    if cert_file is not None and key_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except ssl.SSLError as exc:
            raise ValueError(
                f"{cert} {cert_file} and {key} {key_file} are not a certificate and its "
                f"key ({exc.reason or 'no certificate in the first file'})"
            ) from exc
