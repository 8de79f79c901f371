"""Security on the worker: TLS, mutual TLS and bearer tokens, through grpc, the SDK, grpcurl.

The certificates are made once per module with the openssl command line (the `pki`
fixture, conftest.py): a CA, a server certificate for 127.0.0.1 and localhost, a
client certificate, and a second, unrelated CA with its own client certificate.
Servers run in-process on port 0. The token matrix calls every method of the service
descriptors, with no token, a wrong one and a malformed header, and counts the
servicer methods that ran: none may. The fleet's side is test_security_fleet.py, the
bind rule and the command line test_security_cli.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from certificates import Pki, tls
from driver import code_of
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpcurl_cli import grpcurl_binary
from rpc.secured import (
    BAD_METADATA,
    GOOD_METADATA,
    OTHER_TOKEN,
    SERVING,
    TIMEOUT,
    TOKEN,
    UNAUTHENTICATED,
    WORKER_SERVICE,
    WRONG_TOKEN,
    call_empty,
    health_status,
    is_reflection_refused,
    is_refused,
    secure_channel,
    worker_server,
)

from mlx_worker_svc.cli.envs import MLX_WORKER_CLIENT_TOKEN as CLIENT_TOKEN_ENV
from mlx_worker_svc.cli.envs import MLX_WORKER_TOKEN as TOKEN_ENV
from mlx_worker_svc.client.worker import (
    ClientConfig,
    ClientError,
    WorkerClient,
    channel_credentials,
)
from mlx_worker_svc.core.reports import WorkerState
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.security import (
    UNAUTHENTICATED_DETAILS,
    SecurityConfig,
    SecurityError,
    TokenCheck,
    load_tokens,
)
from mlx_worker_svc.rpc.servicer import WorkerServicer

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def _security_doc_protoset_script() -> str:
    """The Python that docs/security.md runs to write the health service's protoset."""
    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    found = re.search(r'\.venv/bin/python -c "(.*?)"\n', doc, re.DOTALL)
    assert found is not None, "docs/security.md lost its protoset example"
    return found.group(1)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the WorkerService methods that actually ran (servers made after this fixture)."""
    counts: Counter[str] = Counter()
    for method in WORKER_SERVICE.methods:
        original = getattr(WorkerServicer, method.name)

        def counting(
            self: WorkerServicer,
            request: Any,
            context: Any,
            _o: Any = original,
            _n: str = method.name,
        ) -> Any:
            counts[_n] += 1
            return _o(self, request, context)

        monkeypatch.setattr(WorkerServicer, method.name, counting)
    return counts


def _watch(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> int:
    """The first answer of a health Watch."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(), timeout=TIMEOUT, metadata=metadata
    )
    try:
        return int(next(stream).status)
    finally:
        stream.cancel()


def _health_code(
    channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        health_status(channel, metadata)
    return code_of(error.value)


def test_plaintext_client_cannot_talk_to_a_tls_server(pki: Pki) -> None:
    with worker_server(tls(pki)) as server:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert _health_code(channel) == UNAVAILABLE
        with secure_channel(server.port, pki.read("ca")) as channel:
            assert health_status(channel) == SERVING


def test_client_trusting_another_ca_is_refused(pki: Pki) -> None:
    with worker_server(tls(pki)) as server:
        with secure_channel(server.port, pki.read("other_ca")) as channel:
            assert _health_code(channel) == UNAVAILABLE
        # The certificate names both 127.0.0.1 and localhost.
        credentials = channel_credentials(pki.ca)
        with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
            assert health_status(channel) == SERVING


def test_mutual_tls_requires_a_client_certificate(pki: Pki) -> None:
    with worker_server(tls(pki, tls_client_ca=pki.ca)) as server:
        ca = pki.read("ca")
        with secure_channel(server.port, ca) as channel:  # no client certificate
            assert _health_code(channel) == UNAVAILABLE
        other = (pki.read("other_client_cert"), pki.read("other_client_key"))
        with secure_channel(server.port, ca, *other) as channel:  # signed by another CA
            assert _health_code(channel) == UNAVAILABLE
        mine = (pki.read("client_cert"), pki.read("client_key"))
        with secure_channel(server.port, ca, *mine) as channel:
            assert health_status(channel) == SERVING


# --------------------------------------------------------------- tokens


def test_every_worker_rpc_is_refused_without_the_token(served: Counter[str]) -> None:
    with worker_server(SecurityConfig(tokens=(TOKEN,))) as server:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            refused = Counter[str]()
            for metadata in BAD_METADATA:
                for method in WORKER_SERVICE.methods:
                    refusal = is_refused(call_empty, channel, WORKER_SERVICE, method, metadata)
                    assert refusal, f"{method.name} with {metadata} was served"
                    refused[method.name] += 1
                assert is_reflection_refused(channel, metadata)
                refused["ServerReflectionInfo"] += 1
                # Health too: the probe flag is off.
                assert is_refused(health_status, channel, metadata)
                refused["Health.Check"] += 1
                assert is_refused(_watch, channel, metadata)
                refused["Health.Watch"] += 1
                # An unknown method reveals nothing either.
                unknown = channel.unary_unary(
                    "/mlx_worker.v1.WorkerService/NoSuchMethod", None, None
                )
                assert is_refused(unknown, b"", TIMEOUT, metadata)
        assert len(WORKER_SERVICE.methods) == 22
        assert set(refused.values()) == {len(BAD_METADATA)}
        assert sum(refused.values()) == (22 + 3) * len(BAD_METADATA) == 175
        assert sum(served.values()) == 0, served  # 0 RPCs ran unauthenticated
        assert server.worker.state is WorkerState.NEW  # no InitDevice, no Shutdown

        # The right token: a real InitDevice and GetInfo, through the SDK.
        with WorkerClient(f"127.0.0.1:{server.port}", ClientConfig(token=TOKEN)) as client:
            assert client.init_device().state == pb.WORKER_STATE_DEVICE_READY
            assert client.get_info().state == pb.WORKER_STATE_DEVICE_READY
            assert client.health() == SERVING
        assert served == Counter({"InitDevice": 1, "GetInfo": 1})
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            [answer] = stub.ServerReflectionInfo(iter([ask]), metadata=GOOD_METADATA)
            names = {s.name for s in answer.list_services_response.service}
            assert WORKER_SERVICE.full_name in names


def test_the_sdk_reports_unauthenticated_without_retrying() -> None:
    with worker_server(SecurityConfig(tokens=(TOKEN,))) as server:
        config = ClientConfig(token=WRONG_TOKEN, backoff=0.01)
        with WorkerClient(f"127.0.0.1:{server.port}", config) as client:
            with pytest.raises(ClientError) as error:
                client.get_info()
            assert error.value.code == UNAUTHENTICATED and error.value.attempts == 1
            assert error.value.details == UNAUTHENTICATED_DETAILS


def test_health_answers_without_a_token_only_with_the_flag(served: Counter[str]) -> None:
    security = SecurityConfig(tokens=(TOKEN,), allow_health_without_token=True)
    with (
        worker_server(security) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        assert health_status(channel) == SERVING
        assert _watch(channel) == SERVING
        # Only health: the worker's own CheckHealth and reflection still need the token.
        for method in WORKER_SERVICE.methods:
            assert is_refused(call_empty, channel, WORKER_SERVICE, method, ())
        assert is_reflection_refused(channel, ())
        assert health_status(channel, GOOD_METADATA) == SERVING
    assert sum(served.values()) == 0


def test_several_tokens_from_a_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"# rotated weekly\n\n  {TOKEN}  \n# {WRONG_TOKEN}\n{TOKEN}\n")
    tokens = load_tokens(path, env_var=TOKEN_ENV, environ={TOKEN_ENV: f" {OTHER_TOKEN}\n"})
    assert tokens == (TOKEN, OTHER_TOKEN)
    assert load_tokens(None, environ={}) == ()
    assert load_tokens(None, env_var=TOKEN_ENV, environ={TOKEN_ENV: "  "}) == ()
    assert load_tokens(None, env_var=CLIENT_TOKEN_ENV, environ={CLIENT_TOKEN_ENV: "c"}) == ("c",)
    with worker_server(SecurityConfig(tokens=tokens)) as server:
        for token in tokens:
            with WorkerClient(f"127.0.0.1:{server.port}", ClientConfig(token=token)) as client:
                assert client.check_health().state == pb.WORKER_STATE_NEW
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(SecurityError, match="holds no token"):
        load_tokens(tmp_path / "empty", environ={})
    with pytest.raises(SecurityError, match="cannot read the token file"):
        load_tokens(tmp_path / "missing", environ={})
    (tmp_path / "spaced").write_text("two words\n")
    with pytest.raises(SecurityError, match="printable ASCII"):
        load_tokens(tmp_path / "spaced", environ={})


def test_token_check_compares_every_token() -> None:
    check = TokenCheck([TOKEN, OTHER_TOKEN])
    assert check.allows("/x/Y", [("authorization", f"Bearer {TOKEN}")])
    assert check.allows("/x/Y", [("authorization", f"bearer {OTHER_TOKEN}")])
    assert check.allows("/x/Y", [("authorization", b"Bearer " + TOKEN.encode())])
    assert not check.allows("/x/Y", [("authorization", "Bearer tök")])
    assert not check.allows("/grpc.health.v1.Health/Check", [])
    assert TokenCheck([TOKEN], allow_health_without_token=True).allows(
        "/grpc.health.v1.Health/Watch", None
    )
    with pytest.raises(SecurityError):
        TokenCheck([])


# ------------------------------------------------------ TLS + mTLS + token


def test_everything_at_once_through_the_sdk(pki: Pki, served: Counter[str]) -> None:
    security = tls(pki, tls_client_ca=pki.ca, tokens=(TOKEN,))
    with worker_server(security, host="0.0.0.0") as server:  # safe: TLS and a token
        target = f"127.0.0.1:{server.port}"
        credentials = channel_credentials(pki.ca, pki.client_cert, pki.client_key)
        with WorkerClient(target, ClientConfig(credentials=credentials)) as client:
            with pytest.raises(ClientError) as error:
                client.init_device()
            assert error.value.code == UNAUTHENTICATED
        assert sum(served.values()) == 0
        config = ClientConfig(credentials=credentials, token=TOKEN)
        with WorkerClient(target, config) as client:
            assert client.init_device().state == pb.WORKER_STATE_DEVICE_READY
            assert client.get_info().state == pb.WORKER_STATE_DEVICE_READY
    assert served == Counter({"InitDevice": 1, "GetInfo": 1})


def test_grpcurl_with_tls_a_client_certificate_and_a_token(pki: Pki, tmp_path: Path) -> None:
    """The README's grpcurl lines, as written there."""
    security = tls(pki, tls_client_ca=pki.ca, tokens=(TOKEN,), allow_health_without_token=True)
    with worker_server(security) as server:
        base = [str(grpcurl_binary()), "-cacert", pki.ca, "-cert", pki.client_cert]
        base += ["-key", pki.client_key]
        address = f"127.0.0.1:{server.port}"

        def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*base, *args], capture_output=True, text=True, timeout=60, check=False
            )

        listed = grpcurl("-H", f"authorization: Bearer {TOKEN}", address, "list")
        assert listed.returncode == 0, listed.stderr
        assert WORKER_SERVICE.full_name in listed.stdout.split()
        info = grpcurl(
            "-H", f"authorization: Bearer {TOKEN}", address, f"{WORKER_SERVICE.full_name}/GetInfo"
        )
        assert info.returncode == 0 and '"WORKER_STATE_NEW"' in info.stdout, info.stderr
        refused = grpcurl(address, "list")
        assert refused.returncode != 0 and UNAUTHENTICATED_DETAILS in refused.stderr
        # grpcurl finds methods through reflection, which needs the token: a probe
        # without one brings the health proto itself.
        assert grpcurl(address, "grpc.health.v1.Health/Check").returncode != 0
        script = _security_doc_protoset_script()  # as the docs write it out
        subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=60)
        protoset = ["-protoset", str(tmp_path / "health.protoset")]
        probe = grpcurl(*protoset, address, "grpc.health.v1.Health/Check")
        assert probe.returncode == 0 and '"SERVING"' in probe.stdout, probe.stderr
        plaintext = subprocess.run(
            [str(grpcurl_binary()), "-plaintext", address, "grpc.health.v1.Health/Check"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert plaintext.returncode != 0
