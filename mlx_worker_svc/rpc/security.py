"""Transport security for the worker and the fleet: TLS, mutual TLS and bearer tokens.

`SecurityConfig` says how a server listens:

- `tls_cert` + `tls_key` (PEM files): the server speaks TLS only;
- `tls_client_ca` as well: mutual TLS, every client must present a certificate
  signed by that CA (a handshake without one fails);
- `tokens`: every call must carry `authorization: Bearer <token>` matching one
  of them, compared in constant time (`hmac.compare_digest`) against each
  configured token; anything else, reflection included, is answered
  UNAUTHENTICATED before the method runs. With `allow_health_without_token`
  the standard `grpc.health.v1.Health` Check and Watch answer without one (for
  load-balancer and orchestrator probes); nothing else does.

The bind rule (`check_bind`): a server listens on a loopback address unless it
is told otherwise, and a non-loopback address needs TLS or a token, or
`insecure=True` given explicitly.

`TokenInterceptor` is for the synchronous `grpc.server` (the worker),
`AsyncTokenInterceptor` for `grpc.aio.server` (the fleet); both share
`TokenCheck`. `load_tokens` reads tokens from a file (one a line; blank lines
and `#` comments ignored) and/or the environment variable it is given. The
flags that build a `SecurityConfig`, and the variables they read, are the
command line's (cli/security_flags.py, cli/envs.py).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from mlx_worker_svc.core.tls_files import check_tls_files, valid_token

log = logging.getLogger(__name__)

UNAUTHENTICATED_DETAILS = "missing or invalid bearer token"
HEALTH_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
"""The methods `allow_health_without_token` opens."""


class SecurityError(ValueError):
    """A security setting is unusable (a missing file, a bad token) or unsafe."""


class UnsafeBind(SecurityError):
    """A non-loopback address without TLS or a token, and `insecure` not given."""


@dataclass(frozen=True)
class SecurityConfig:
    """How a server listens (see the module docstring). The default: plaintext, loopback only."""

    tls_cert: str | None = None
    """PEM certificate chain of the server; with `tls_key`, the server speaks TLS."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""
    tls_client_ca: str | None = None
    """PEM CA bundle; set, every client must present a certificate it signed (mTLS)."""
    tokens: tuple[str, ...] = field(default=(), repr=False)
    """Accepted bearer tokens; set, every call needs one (kept out of repr and logs)."""
    allow_health_without_token: bool = False
    """grpc.health.v1 Check and Watch answer without a token (for probes)."""
    insecure: bool = False
    """Allow a non-loopback address without TLS or a token."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SecurityError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SecurityError("mutual TLS (--tls-client-ca) needs --tls-cert and --tls-key")
        for token in self.tokens:
            if not valid_token(token):
                raise SecurityError(
                    "a bearer token must be non-empty printable ASCII without spaces"
                )

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def mtls(self) -> bool:
        return self.tls_client_ca is not None

    def describe(self) -> str:
        """A short summary for logs, e.g. "TLS, client certificates, bearer token"."""
        parts = ["TLS" if self.tls else "plaintext"]
        if self.mtls:
            parts.append("client certificates required")
        if self.tokens:
            parts.append("bearer token")
            if self.allow_health_without_token:
                parts.append("health open")
        return ", ".join(parts)


def _read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"cannot read the {what} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in data:
        raise SecurityError(f"the {what} {path} is not a PEM file")
    return data


def server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """The server's TLS credentials (client certificates required with a CA); None: plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    chain = _read_pem(config.tls_cert, "TLS certificate (--tls-cert)")
    key = _read_pem(config.tls_key, "TLS key (--tls-key)")
    client_ca = None
    if config.tls_client_ca is not None:
        client_ca = _read_pem(config.tls_client_ca, "client CA file (--tls-client-ca)")
    try:
        check_tls_files(
            config.tls_client_ca,
            config.tls_cert,
            config.tls_key,
            ca="the client CA file (--tls-client-ca)",
            cert="the TLS certificate (--tls-cert)",
            key="the key (--tls-key)",
        )
    except ValueError as exc:
        raise SecurityError(str(exc)) from exc
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine ("localhost", 127.0.0.0/8, ::1)."""
    name = host.strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name, "0.0.0.0", "::", "": reachable from elsewhere


def check_bind(
    host: str, config: SecurityConfig, *, token_hint: str = "--token-file (or MLX_WORKER_TOKEN)"
) -> None:
    """Raises `UnsafeBind` for a non-loopback host without TLS or a token, unless insecure.

    `token_hint` names the flag that gives tokens, for the message. A warning
    is logged once a process, though the command line and the server both check.
    """
    if is_loopback(host):
        return
    if config.tls or config.tokens:
        if not config.tls:
            _warn_once(f"listening on {host} with a token but no TLS: tokens travel in clear")
        return
    if config.insecure:
        _warn_once(f"listening on {host} without TLS or a token (--insecure)")
        return
    raise UnsafeBind(
        f"refusing to listen on {host} (--host) without TLS or a token: give --tls-cert and "
        f"--tls-key, or {token_hint}, or pass --insecure"
    )


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def load_tokens(
    path: str | os.PathLike[str] | None = None,
    *,
    env_var: str | None = None,
    environ: Mapping[str, str] | None = None,
    flag: str = "the token file",
) -> tuple[str, ...]:
    """Tokens from `path` (one a line; blank lines and `#` comments ignored) and `env_var`.

    A file that holds no token is an error (it would silently turn the check
    off); an unset or empty variable adds nothing. Duplicates are dropped.
    `flag` names the file in errors (the command's flag).
    """
    tokens: list[str] = []
    sources: list[str] = []  # where each token came from, for the error
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise SecurityError(f"cannot read {flag} {path}: {reason}") from exc
        lines = [line.strip() for line in text.splitlines()]
        found = [line for line in lines if line and not line.startswith("#")]
        if not found:
            raise SecurityError(f"{flag} {path} holds no token")
        tokens += found
        sources += [f"{flag} {path}"] * len(found)
    if env_var is not None:
        value = (os.environ if environ is None else environ).get(env_var, "").strip()
        if value:
            tokens.append(value)
            sources.append(f"${env_var}")
    for token, source in zip(tokens, sources, strict=True):
        if not valid_token(token):
            raise SecurityError(
                f"a bearer token must be non-empty printable ASCII without spaces (check {source})"
            )
    return tuple(dict.fromkeys(tokens))


# ------------------------------------------------------------------ the check


class TokenCheck:
    """Decides whether a call may run: an open health method or a matching bearer token."""

    def __init__(self, tokens: Iterable[str], *, allow_health_without_token: bool = False) -> None:
        # Digests, so that the comparison takes the same time whatever the lengths.
        self._tokens = tuple(hashlib.sha256(token.encode("ascii")).digest() for token in tokens)
        if not self._tokens:
            raise SecurityError("a token check needs at least one token")
        self._open = HEALTH_METHODS if allow_health_without_token else frozenset()

    def allows(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        if method in self._open:
            return True
        ok = False
        for key, value in metadata or ():
            if key.lower() != "authorization":
                continue
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, presented = text.strip().partition(" ")
            if scheme.lower() != "bearer":
                continue
            candidate = hashlib.sha256(presented.strip().encode("utf-8", "replace")).digest()
            # Every configured token is compared, each in constant time, so the
            # time taken says nothing about which one (if any) came close.
            for expected in self._tokens:
                ok |= hmac.compare_digest(candidate, expected)
        return ok


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)


async def _deny_async(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)


def _denying_handler(
    handler: grpc.RpcMethodHandler[Any, Any] | None, behavior: Callable[..., Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as `handler` that only refuses (the request is never parsed)."""
    request_streaming = handler is not None and handler.request_streaming
    response_streaming = handler is not None and handler.response_streaming
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior)
    # An unknown method is refused too: without a token nothing is revealed.
    return grpc.unary_unary_rpc_method_handler(behavior)


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """The token check for the synchronous `grpc.server` (the worker)."""

    def __init__(self, check: TokenCheck) -> None:
        self._check = check

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        details = handler_call_details
        if self._check.allows(details.method, details.invocation_metadata):
            return handler
        log.debug("refused %s: %s", details.method, UNAUTHENTICATED_DETAILS)
        return _denying_handler(handler, _deny)


class AsyncTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """The token check for `grpc.aio.server` (the fleet)."""

    def __init__(self, check: TokenCheck) -> None:
        self._check = check

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        details = handler_call_details
        if self._check.allows(details.method, details.invocation_metadata):
            return handler
        log.debug("refused %s: %s", details.method, UNAUTHENTICATED_DETAILS)
        return _denying_handler(handler, _deny_async)


def token_check(config: SecurityConfig) -> TokenCheck | None:
    """The config's token check; None without tokens."""
    if not config.tokens:
        return None
    return TokenCheck(config.tokens, allow_health_without_token=config.allow_health_without_token)
