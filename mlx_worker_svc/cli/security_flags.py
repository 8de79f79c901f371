"""The security flags of `serve`, `fleet`, `gateway` and `generate`, and what they build.

`add_server_arguments` gives a server TLS, mutual TLS, a token file and the
bind override; `server_security_from_args` turns them into the
`rpc.security.SecurityConfig` the server enforces (refusing an unsafe bind).
`add_worker_client_arguments` / `worker_client_from_args` are the other side:
credentials and a token for the calls the fleet makes to its workers. The
token variables are declared in envs.py.
"""

from __future__ import annotations

import argparse
import logging

import grpc

from mlx_worker_svc.cli.envs import MLX_WORKER_CLIENT_TOKEN, MLX_WORKER_TOKEN
from mlx_worker_svc.rpc.security import (
    SecurityConfig,
    SecurityError,
    check_bind,
    is_loopback,
    load_tokens,
    server_credentials,
)

log = logging.getLogger(__name__)


def add_server_arguments(
    parser: argparse.ArgumentParser,
    *,
    token_flag: str = "--token-file",
    token_env: str = MLX_WORKER_TOKEN,
    health: str = "grpc.health.v1 Check/Watch",
) -> None:
    """The server-side flags of `serve`, `fleet` and `gateway` (whose tokens are API keys).

    `token_flag` names the token-file flag (its value lands in `args.token_file`),
    `token_env` the variable that adds one more token, and `health` the probe that
    --allow-health-without-token opens.
    """
    parser.set_defaults(token_flag=token_flag, token_env=token_env)
    group = parser.add_argument_group("security (see README: Security)")
    group.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    group.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    group.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        help="mutual TLS: require client certificates signed by this CA",
    )
    group.add_argument(
        token_flag,
        dest="token_file",
        metavar="FILE",
        help=f"require `authorization: Bearer <token>`, one token a line (also: ${token_env})",
    )
    group.add_argument(
        "--allow-health-without-token",
        action="store_true",
        help=f"let {health} answer without a token (for probes)",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without TLS or a token",
    )


def server_security_from_args(args: argparse.Namespace) -> SecurityConfig:
    """The SecurityConfig the server flags ask for; raises SecurityError (UnsafeBind too)."""
    config = SecurityConfig(
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        tokens=load_tokens(args.token_file, env_var=args.token_env, flag=args.token_flag),
        allow_health_without_token=args.allow_health_without_token,
        insecure=args.insecure,
    )
    if config.allow_health_without_token and not config.tokens:
        log.warning("--allow-health-without-token has no effect without a token")
    check_bind(args.host, config, token_hint=f"{args.token_flag} (or {args.token_env})")
    server_credentials(config)  # reads and checks the TLS files now, not at the bind
    return config


def add_worker_client_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `fleet` and `generate` for their calls to the workers."""
    group = parser.add_argument_group("connecting to the workers")
    group.add_argument(
        "--worker-ca", metavar="PEM", help="TLS to the workers, trusting this CA bundle"
    )
    group.add_argument(
        "--worker-client-cert", metavar="PEM", help="client certificate for mTLS workers"
    )
    group.add_argument("--worker-client-key", metavar="PEM", help="the key of --worker-client-cert")
    group.add_argument(
        "--worker-token-file",
        metavar="FILE",
        help="bearer token sent to the workers: the file's first token (blank lines and # "
        f"comments skipped; also: ${MLX_WORKER_CLIENT_TOKEN})",
    )


def _flags_of(args: argparse.Namespace, said: str) -> str:
    """ "--worker-ca: " (the flags whose file `said` names), for a worker-client error."""
    given = {
        "--worker-ca": args.worker_ca,
        "--worker-client-cert": args.worker_client_cert,
        "--worker-client-key": args.worker_client_key,
    }
    named = [flag for flag, path in given.items() if path and path in said]
    return f"{', '.join(named)}: " if named else ""


def worker_client_from_args(
    args: argparse.Namespace,
) -> tuple[grpc.ChannelCredentials | None, str | None]:
    """(credentials, token) toward the workers; TLS when any --worker-* PEM flag is given."""
    from mlx_worker_svc.client.worker import channel_credentials

    credentials = None
    cert, key = args.worker_client_cert, args.worker_client_key
    if bool(cert) != bool(key):
        given, missing = (
            ("--worker-client-cert", "--worker-client-key")
            if cert
            else ("--worker-client-key", "--worker-client-cert")
        )
        raise SecurityError(f"{given} needs {missing} too (a client certificate and its key)")
    if args.worker_ca or cert or key:
        try:
            credentials = channel_credentials(
                args.worker_ca, args.worker_client_cert, args.worker_client_key
            )
        except OSError as exc:
            raise SecurityError(
                f"{_flags_of(args, str(exc.filename))}cannot read "
                f"{exc.filename or 'a --worker-* file'}: {exc.strerror or exc}"
            ) from exc
        except ValueError as exc:
            raise SecurityError(f"{_flags_of(args, str(exc))}{exc}") from exc
    tokens = load_tokens(
        args.worker_token_file, env_var=MLX_WORKER_CLIENT_TOKEN, flag="--worker-token-file"
    )
    token = tokens[0] if tokens else None
    remote = [w for w in args.worker if not is_loopback(w.rpartition(":")[0])]
    if token and credentials is None and remote:
        log.warning("sending the worker token without TLS (no --worker-ca)")
    return credentials, token
