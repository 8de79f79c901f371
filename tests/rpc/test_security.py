"""Security: TLS, mutual TLS and bearer tokens on the worker and the fleet; the bind rule.

The certificates are made once per module with the openssl command line: a CA, a
server certificate for 127.0.0.1 and localhost, a client certificate, and a second,
unrelated CA with its own client certificate. Servers run in-process on port 0
(`mlx-worker serve` and `fleet` subprocesses only for the command-line checks). The
token matrix calls every method of the service descriptors, with no token, a wrong
one and a malformed header, and counts the servicer methods that ran: none may.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from certificates import Pki, make_pki, tls
from driver import code_of, details_of
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpcurl_cli import grpcurl_binary

from mlx_worker_svc.cli.envs import MLX_WORKER_CLIENT_TOKEN as CLIENT_TOKEN_ENV
from mlx_worker_svc.cli.envs import MLX_WORKER_TOKEN as TOKEN_ENV
from mlx_worker_svc.client.worker import (
    ClientConfig,
    ClientError,
    WorkerClient,
    channel_credentials,
)
from mlx_worker_svc.core.reports import WorkerState
from mlx_worker_svc.fleet import FleetConfig, FleetScheduler, LinkConfig
from mlx_worker_svc.fleet.server import serve_fleet
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2, fleet_pb2_grpc
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.security import (
    UNAUTHENTICATED_DETAILS,
    SecurityConfig,
    SecurityError,
    TokenCheck,
    UnsafeBind,
    check_bind,
    is_loopback,
    load_tokens,
)
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer
from mlx_worker_svc.rpc.servicer import WorkerServicer

TOKEN = "tok-3f9a1c"
OTHER_TOKEN = "tok-rotated-7b2e"
WRONG_TOKEN = "tok-3f9a1d"  # one character off
WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"]
FLEET_SERVICE = fleet_pb2.DESCRIPTOR.services_by_name["FleetService"]
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
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
# grpc's src/proto/grpc/health/v1/health.proto, comments left out.
HEALTH_PROTO = """syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health {
  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);
  rpc Watch(HealthCheckRequest) returns (stream HealthCheckResponse);
}
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


# ---------------------------------------------------------------- servers


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


def _health(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest()
    return int(stub.Check(request, timeout=TIMEOUT, metadata=metadata).status)


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
        _health(channel, metadata)
    return code_of(error.value)


def _call(
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


def _refused(call: Callable[..., object], *args: Any) -> bool:
    """Whether `call(*args)` failed with UNAUTHENTICATED and the fixed message."""
    try:
        call(*args)
    except grpc.RpcError as exc:
        assert code_of(exc) == UNAUTHENTICATED, f"{code_of(exc)}: {details_of(exc)}"
        assert details_of(exc) == UNAUTHENTICATED_DETAILS
        return True
    return False


def _reflection_refused(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> bool:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    ask = reflection_pb2.ServerReflectionRequest(list_services="")
    return _refused(lambda: list(stub.ServerReflectionInfo(iter([ask]), metadata=metadata)))


# ------------------------------------------------------------------ TLS


def test_plaintext_client_cannot_talk_to_a_tls_server(pki: Pki) -> None:
    with worker_server(tls(pki)) as server:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            assert _health_code(channel) == UNAVAILABLE
        with secure_channel(server.port, pki.read("ca")) as channel:
            assert _health(channel) == SERVING


def test_client_trusting_another_ca_is_refused(pki: Pki) -> None:
    with worker_server(tls(pki)) as server:
        with secure_channel(server.port, pki.read("other_ca")) as channel:
            assert _health_code(channel) == UNAVAILABLE
        # The certificate names both 127.0.0.1 and localhost.
        credentials = channel_credentials(pki.ca)
        with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
            assert _health(channel) == SERVING


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
            assert _health(channel) == SERVING


# --------------------------------------------------------------- tokens


def test_every_worker_rpc_is_refused_without_the_token(served: Counter[str]) -> None:
    with worker_server(SecurityConfig(tokens=(TOKEN,))) as server:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            refused = Counter[str]()
            for metadata in BAD_METADATA:
                for method in WORKER_SERVICE.methods:
                    refusal = _refused(_call, channel, WORKER_SERVICE, method, metadata)
                    assert refusal, f"{method.name} with {metadata} was served"
                    refused[method.name] += 1
                assert _reflection_refused(channel, metadata)
                refused["ServerReflectionInfo"] += 1
                # Health too: the probe flag is off.
                assert _refused(_health, channel, metadata)
                refused["Health.Check"] += 1
                assert _refused(_watch, channel, metadata)
                refused["Health.Watch"] += 1
                # An unknown method reveals nothing either.
                unknown = channel.unary_unary(
                    "/mlx_worker.v1.WorkerService/NoSuchMethod", None, None
                )
                assert _refused(unknown, b"", TIMEOUT, metadata)
        assert len(WORKER_SERVICE.methods) == 21
        assert set(refused.values()) == {len(BAD_METADATA)}
        assert sum(refused.values()) == (21 + 3) * len(BAD_METADATA) == 168
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
        assert _health(channel) == SERVING
        assert _watch(channel) == SERVING
        # Only health: the worker's own CheckHealth and reflection still need the token.
        for method in WORKER_SERVICE.methods:
            assert _refused(_call, channel, WORKER_SERVICE, method, ())
        assert _reflection_refused(channel, ())
        assert _health(channel, GOOD_METADATA) == SERVING
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
        proto = ["-import-path", str(tmp_path), "-proto", "health.proto"]
        (tmp_path / "health.proto").write_text(HEALTH_PROTO)
        probe = grpcurl(*proto, address, "grpc.health.v1.Health/Check")
        assert probe.returncode == 0 and '"SERVING"' in probe.stdout, probe.stderr
        plaintext = subprocess.run(
            [str(grpcurl_binary()), "-plaintext", address, "grpc.health.v1.Health/Check"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert plaintext.returncode != 0


# ---------------------------------------------------------------- fleet


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
        return _reflection_refused(channel, metadata)


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
    finally:
        await server.stop(0)
        await fleet.stop()
        await wrong.stop()


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


# ------------------------------------------------------------ bind rule


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
    mismatched = SecurityConfig(tls_cert=pki.server_cert, tls_key=pki.client_key)
    server = WorkerServer(ServerConfig(port=0, security=mismatched))
    with pytest.raises(OSError, match="TLS key does not match"):
        server.start()
    server.worker.close()
    with pytest.raises(ValueError, match="needs its key"):
        channel_credentials(pki.ca, cert_file=pki.client_cert)


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
    assert line.startswith("mlx-worker serve: refusing to listen on 0.0.0.0 without TLS or a token")
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
            assert _health(channel) == SERVING
    finally:
        assert serve.stop() == 0, "".join(serve.lines)
    assert "without TLS or a token (--insecure)" in "".join(serve.lines)


def test_cli_token_from_the_environment_and_the_probe_flag(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(f"# the worker token\n{TOKEN}\n")
    env = {**_env(), TOKEN_ENV: OTHER_TOKEN}
    serve = _Serve(
        "--host", "0.0.0.0", "--token-file", str(tmp_path / "tokens"),
        "--allow-health-without-token", env=env,
    )  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{serve.port}") as channel:
            assert _health(channel) == SERVING
            get_info = WORKER_SERVICE.methods_by_name["GetInfo"]
            assert _refused(_call, channel, WORKER_SERVICE, get_info, ())
            for token in (TOKEN, OTHER_TOKEN):
                _call(channel, WORKER_SERVICE, get_info, (("authorization", f"Bearer {token}"),))
    finally:
        assert serve.stop() == 0, "".join(serve.lines)
    assert "tokens travel in clear" in "".join(serve.lines)
