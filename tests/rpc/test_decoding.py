"""Requests that do not decode: INVALID_ARGUMENT (gRPC) or 400 (HTTP), never a server error.

Acceptance: a corpus of at least 200 undecodable requests (bad UTF-8 in every
string field of every request type, truncated and random bytes) against a
worker, a fleet and a gateway front gives 0 INTERNAL, 0 UNKNOWN and 0 tracebacks
in the logs, and the worker's greedy output is unchanged afterwards.

The gRPC corpus is built from the descriptors. For every method of the services
a server offers (WorkerService or FleetService, grpc.health.v1 and both
reflection versions) it holds one request per string field of the method's
input type, nested messages, repeated fields and map keys included, whose bytes
are replaced by invalid UTF-8; and truncated and random bytes that do not parse.
Each is sent as raw bytes (identity serializers) to a real `serve --auto-init`
worker on the tiny model and to a real `fleet` in front of it, and must be
INVALID_ARGUMENT naming the message type (and the field, for bad UTF-8). The
gateway, in front of the same worker, gets bodies with invalid UTF-8 in each
field, truncated JSON, lone surrogates, deep nesting and random bytes on every
endpoint that reads a body, and must answer 400 in OpenAI's error shape (404 for
a model id that is not UTF-8 on /v1/models/{id}). Codes seen are printed
(pytest -s).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from certificates import Pki, make_pki, tls
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from processes import Proc

from mlx_worker_svc.fleet import FleetScheduler
from mlx_worker_svc.fleet.server import serve_fleet
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME, v1_file
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer

Code = grpc.StatusCode
TIMEOUT = 30.0
COMMON = ("grpc.health.v1.Health", V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
WORKER_SERVICES = ("mlx_worker.v1.WorkerService", *COMMON)
FLEET_SERVICES = ("mlx_worker.v1.FleetService", *COMMON)
PLACEHOLDER = "<placeholder>"  # replaced, byte for byte, by invalid UTF-8
# Invalid UTF-8: a bare continuation byte, 0xff, an overlong '/', an encoded
# surrogate, a sequence cut short, a code point past U+10FFFF.
BAD_UTF8 = (b"\x80", b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82x", b"\xf4\x90\x80\x80")
PROMPT = [11, 12, 13, 14, 15]
KEY = "sk-decoding"


# ---------------------------------------------------------------- the gRPC corpus
@dataclass(frozen=True)
class Bad:
    """One undecodable request: where it goes, its bytes, the status message it must get."""

    method: MethodDescriptor
    data: bytes
    kind: str  # "utf8", "truncated" or "random"
    expect: str  # the end of the status message, after the message type

    @property
    def path(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"


Setter = Callable[[Message], None]


def string_fields(
    descriptor: Descriptor, seen: tuple[str, ...] = ()
) -> Iterator[tuple[str, Setter]]:
    """(path as the server names it, a setter writing PLACEHOLDER there) for every string field."""
    within = (*seen, descriptor.full_name)  # a recursive message is followed once
    for field in descriptor.fields:
        message = field.message_type
        if message is not None and message.GetOptions().map_entry:
            yield from _map_fields(field, message)
        elif field.type == FieldDescriptor.TYPE_STRING:
            yield _string_field(field)
        elif message is not None and message.full_name not in within:
            for inner, setter in string_fields(message, within):
                yield _nested(field, inner, setter)


def _string_field(field: FieldDescriptor) -> tuple[str, Setter]:
    if field.is_repeated:
        return f"{field.name}[0]", lambda m: getattr(m, field.name).append(PLACEHOLDER)
    return field.name, lambda m: setattr(m, field.name, PLACEHOLDER)


def _nested(field: FieldDescriptor, inner: str, setter: Setter) -> tuple[str, Setter]:
    if field.is_repeated:
        return f"{field.name}[0].{inner}", lambda m: setter(getattr(m, field.name).add())
    return f"{field.name}.{inner}", lambda m: setter(getattr(m, field.name))


def _map_fields(field: FieldDescriptor, entry: Descriptor) -> Iterator[tuple[str, Setter]]:
    key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
    if key.type == FieldDescriptor.TYPE_STRING:
        yield (
            f"a key of {field.name}",
            lambda m: getattr(m, field.name).__setitem__(PLACEHOLDER, value.default_value),
        )
    some_key = "k" if key.type == FieldDescriptor.TYPE_STRING else 1
    if value.type == FieldDescriptor.TYPE_STRING:
        yield (
            f"a {field.name} value",
            lambda m: getattr(m, field.name).__setitem__(some_key, PLACEHOLDER),
        )
    elif value.message_type is not None:
        for _, setter in string_fields(value.message_type):
            yield f"a {field.name} value", _in_map_value(field.name, some_key, setter)


def _in_map_value(name: str, key: str | int, setter: Setter) -> Setter:
    return lambda m: setter(getattr(m, name)[key])


def _message(method: MethodDescriptor) -> Message:
    return message_factory.GetMessageClass(method.input_type)()


def _decodes(method: MethodDescriptor, data: bytes) -> bool:
    try:
        _message(method).ParseFromString(data)
    except DecodeError:
        return False
    return True


_NUMBERS = {
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64,
}


def _fill_numbers(message: Message) -> None:
    """Sets the top-level integer fields to a value of several bytes (more places to cut)."""
    for field in message.DESCRIPTOR.fields:
        if field.type in _NUMBERS and not field.is_repeated and field.containing_oneof is None:
            setattr(message, field.name, 300)


def corpus(services: tuple[str, ...], seed: int) -> list[Bad]:
    """Each kind of bad UTF-8 in each string field, truncated and random bytes, every method."""
    v1_file()
    pool = descriptor_pool.Default()
    rng = random.Random(seed)
    bad: list[Bad] = []
    for service in services:
        for method in pool.FindServiceByName(service).methods:
            full = _message(method)
            for path, setter in string_fields(method.input_type):
                request = _message(method)
                setter(request)
                setter(full)
                data = request.SerializeToString()
                assert data.count(PLACEHOLDER.encode()) == 1, (method.full_name, path)
                for junk in BAD_UTF8:
                    wrong = data.replace(PLACEHOLDER.encode(), junk.ljust(len(PLACEHOLDER), b"x"))
                    bad.append(Bad(method, wrong, "utf8", f"{path} is not valid UTF-8"))
            _fill_numbers(full)
            whole = full.SerializeToString().replace(PLACEHOLDER.encode(), b"x" * len(PLACEHOLDER))
            cuts = [n for n in range(1, len(whole)) if not _decodes(method, whole[:n])]
            for n in cuts[:: max(1, len(cuts) // 3)][:3]:
                bad.append(Bad(method, whole[:n], "truncated", ""))
            junk_found = 0
            while junk_found < 2:
                data = rng.randbytes(rng.randint(1, 48))
                if not _decodes(method, data):
                    bad.append(Bad(method, data, "random", ""))
                    junk_found += 1
    return bad


def send(channel: grpc.Channel, bad: Bad) -> tuple[Code, str]:
    """Sends the raw bytes; returns the status code and message."""
    identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    try:
        if bad.method.client_streaming:
            call = channel.stream_stream(bad.path, identity, identity)
            list(call(iter([bad.data]), timeout=TIMEOUT))
        elif bad.method.server_streaming:
            list(channel.unary_stream(bad.path, identity, identity)(bad.data, timeout=TIMEOUT))
        else:
            channel.unary_unary(bad.path, identity, identity)(bad.data, timeout=TIMEOUT)
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return exc.code(), exc.details() or ""
    return Code.OK, ""


def run_corpus(channel: grpc.Channel, bad: list[Bad], where: str) -> list[tuple[Any, ...]]:
    """Sends every request; prints the codes seen, by kind; returns the wrong answers."""
    seen: Counter[str] = Counter()
    wrong: list[tuple[Any, ...]] = []
    for b in bad:
        code, details = send(channel, b)
        seen[f"{b.kind} {code.name}"] += 1
        prefix = f"the request bytes do not decode as {b.method.input_type.full_name}: "
        right = code == Code.INVALID_ARGUMENT and details.startswith(prefix)
        if not right or not details.endswith(b.expect):
            wrong.append((b.path, b.kind, b.data, code.name, details))
    print(f"\n{where}: {len(bad)} undecodable requests: {dict(sorted(seen.items()))}")
    return wrong


# ---------------------------------------------------------------- the processes
@dataclass
class Stack:
    worker: Proc
    worker_port: int
    fleet: Proc
    fleet_port: int
    gateway: Proc
    gateway_port: int
    before: list[int]  # the worker's greedy tokens before any corpus
    sent: Counter[str]  # undecodable gRPC requests sent, by process

    def procs(self) -> dict[str, Proc]:
        return {"worker": self.worker, "fleet": self.fleet, "gateway": self.gateway}


def greedy_tokens(port: int) -> list[int]:
    request = pb.GenerateRequest(
        prompt_token_ids=PROMPT,
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        return [t for m in stub.Generate(request, timeout=TIMEOUT) for t in m.token_ids]


@pytest.fixture(scope="module")
def stack(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{KEY}\n")
    worker = Proc(["serve", "--model", str(tiny_dir), "--auto-init", "--port", "0"])
    procs = [worker]
    try:
        worker_port = int(worker.wait_for(r"listening on [\d.]+:(\d+)").group(1))
        worker.wait_for(r"^ready:")
        target = f"127.0.0.1:{worker_port}"
        fleet = Proc(["fleet", "--worker", target, "--port", "0"])
        gateway = Proc(["gateway", "--worker", target, "--port", "0", "--api-key-file", str(keys)])
        procs += [fleet, gateway]
        fleet_port = int(fleet.wait_for(r"fleet listening on [\d.]+:(\d+)").group(1))
        gateway_port = int(gateway.wait_for(r"gateway listening on [\d.]+:(\d+)").group(1))
        before = greedy_tokens(worker_port)
        yield Stack(
            worker, worker_port, fleet, fleet_port, gateway, gateway_port, before, Counter()
        )
    finally:
        for proc in procs:
            proc.reap()


# ---------------------------------------------------------------- tests
def test_undecodable_requests_to_a_worker_and_a_fleet_are_invalid_argument(stack: Stack) -> None:
    worker_corpus = corpus(WORKER_SERVICES, seed=1)
    fleet_corpus = corpus(FLEET_SERVICES, seed=2)
    utf8 = {b.method.input_type.full_name for b in worker_corpus + fleet_corpus if b.kind == "utf8"}
    # Every request type of both services with a string field (nested ones included).
    assert {"mlx_worker.v1.ExecuteRequest", "mlx_worker.v1.GenerateRequest"} <= utf8
    assert {"mlx_worker.v1.LoadModelRequest", "grpc.health.v1.HealthCheckRequest"} <= utf8
    with grpc.insecure_channel(f"127.0.0.1:{stack.worker_port}") as channel:
        wrong = run_corpus(channel, worker_corpus, "worker")
    with grpc.insecure_channel(f"127.0.0.1:{stack.fleet_port}") as channel:
        wrong += run_corpus(channel, fleet_corpus, "fleet")
    stack.sent.update(worker=len(worker_corpus), fleet=len(fleet_corpus))
    assert not wrong, f"{len(wrong)} wrong answers, first ones: {wrong[:5]}"
    assert len(worker_corpus) + len(fleet_corpus) >= 200


def gateway_bodies() -> list[tuple[str, bytes]]:
    """(what, body) pairs, none of which is a valid request of either POST endpoint."""
    chat = {
        "model": "model",
        "messages": [{"role": "user", "content": "hi", "name": "me"}],
        "stop": ["x"],
        "user": "u",
    }
    completion = {"model": "model", "prompt": "hi", "stop": "x", "user": "u", "suffix": "s"}
    bodies: list[tuple[str, bytes]] = []
    for name, body in (("chat", chat), ("completion", completion)):
        text = json.dumps(body)
        # Invalid UTF-8 in each string value (and key) of the body.
        for value in re.findall(r'"([^"]*)"', text):
            for i, junk in enumerate(BAD_UTF8[:2]):
                raw = text.replace(f'"{value}"', f'"{value}\x00"', 1).encode()
                bodies.append((f"{name}: {value!r} + {junk!r}", raw.replace(b"\x00", junk)))
                if i == 0:
                    lone = text.replace(f'"{value}"', f'"{value}\\ud800"', 1).encode()
                    bodies.append((f"{name}: {value!r} + a lone surrogate", lone))
        encoded = text.encode()
        for n in (1, len(encoded) // 2, len(encoded) - 1):
            bodies.append((f"{name} truncated at {n}", encoded[:n]))
    rng = random.Random(3)
    bodies += [(f"random {i}", rng.randbytes(rng.randint(1, 64))) for i in range(6)]
    bodies += [
        ("empty", b""),
        ("deep nesting", b"[" * 100_000 + b"]" * 100_000),
        ("utf-16", json.dumps(completion).encode("utf-16")),
        ("a JSON string", b'"\\udfff"'),
        ("NUL bytes", b"\x00" * 16),
    ]
    return bodies


def test_undecodable_bodies_to_the_gateway_are_400_in_openais_shape(stack: Stack) -> None:
    seen: Counter[str] = Counter()
    wrong: list[tuple[Any, ...]] = []
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def check(method: str, path: str, what: str, body: bytes | None, status: int) -> None:
        try:
            answer = http.request(method, path, content=body, headers=headers)
        except httpx.TransportError as exc:  # the server dropped the connection
            seen["no answer"] += 1
            wrong.append((path, what, type(exc).__name__, str(exc)))
            return
        seen[str(answer.status_code)] += 1
        try:
            error = answer.json()["error"]
            shaped = {"message", "type", "param", "code"} <= set(error)
        except (ValueError, KeyError, TypeError):
            shaped = False
        if answer.status_code != status or not shaped:
            wrong.append((path, what, answer.status_code, answer.text[:200]))

    with httpx.Client(base_url=f"http://127.0.0.1:{stack.gateway_port}", timeout=60) as http:
        for path in ("/v1/chat/completions", "/v1/completions"):
            for what, body in gateway_bodies():
                check("POST", path, what, body, 400)
        # The GET endpoints read no body; a model id that is not UTF-8 is not a model.
        for escaped in ("%FF%FE", "%ED%A0%80", "%C0%AF", "%E2%82"):
            check("GET", f"/v1/models/{escaped}", escaped, None, 404)
    print(f"\ngateway: {sum(seen.values())} undecodable requests: {dict(seen)}")
    assert not wrong, f"{len(wrong)} wrong answers, first ones: {wrong[:5]}"
    assert sum(seen.values()) >= 60


def test_no_traceback_and_the_greedy_output_is_unchanged(stack: Stack) -> None:
    assert greedy_tokens(stack.worker_port) == stack.before
    refusals = {"worker": stack.sent["worker"], "fleet": stack.sent["fleet"], "gateway": 0}
    deadline = time.monotonic() + 10  # the log lines arrive through a pipe
    for name, proc in stack.procs().items():
        while True:
            logged = proc.output.count("the request bytes do not decode as ")
            if logged >= refusals[name] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert proc.alive(), f"{name} exited:\n{proc.output}"
        assert "Traceback" not in proc.output, f"{name}:\n{proc.output}"
        assert "Exception deserializing" not in proc.output, f"{name}:\n{proc.output}"
        # One log line a refusal.
        assert logged == refusals[name], (name, logged, refusals[name])


# ---------------------------------------------------------------- composition
def _execute(channel: grpc.Channel, data: bytes, token: str | None) -> Code:
    metadata = () if token is None else (("authorization", f"Bearer {token}"),)
    call = channel.unary_unary("/mlx_worker.v1.WorkerService/Execute", lambda b: b, lambda b: b)
    try:
        call(data, timeout=TIMEOUT, metadata=metadata)
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return exc.code()
    return Code.OK


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_the_token_check_comes_first_over_tls_and_metrics_count_the_real_code(pki: Pki) -> None:
    bad_utf8 = pb.ExecuteRequest(finished_req_ids=["\u00e9"]).SerializeToString()
    bad_utf8 = bad_utf8.replace("\u00e9".encode(), b"\xc3(")
    security = tls(pki, tokens=(KEY,))
    server = WorkerServer(ServerConfig(port=0, security=security))
    server.start()
    try:
        credentials = grpc.ssl_channel_credentials(pki.read("ca"))
        with grpc.secure_channel(f"127.0.0.1:{server.port}", credentials) as channel:
            assert _execute(channel, bad_utf8, None) == Code.UNAUTHENTICATED
            assert _execute(channel, bad_utf8, KEY) == Code.INVALID_ARGUMENT
            assert _execute(channel, b"\x0a", KEY) == Code.INVALID_ARGUMENT
        registry = server.metrics.registry
        labels = {"service": "mlx_worker.v1.WorkerService", "method": "Execute"}
        count = registry.get_sample_value
        assert count("mlx_worker_rpcs_total", {**labels, "code": "UNAUTHENTICATED"}) == 1
        assert count("mlx_worker_rpcs_total", {**labels, "code": "INVALID_ARGUMENT"}) == 2
    finally:
        server.shutdown(grace_seconds=1.0, abort=True)
        assert server.wait(timeout=30)


def test_the_fleet_counts_an_undecodable_call_with_its_code(pki: Pki) -> None:
    asyncio.run(_fleet_counts(pki))


async def _fleet_counts(pki: Pki) -> None:
    fleet = FleetScheduler(["127.0.0.1:1"])
    security = tls(pki, tokens=(KEY,))
    server, port = await serve_fleet(fleet, "127.0.0.1", 0, security)
    bad = b"\x0a\x05"  # field 1, five bytes long, and nothing after
    generate = (
        pb.GenerateRequest(prompt="\u00e9").SerializeToString().replace(b"\xc3\xa9", b"\xc3(")
    )
    try:
        credentials = grpc.ssl_channel_credentials(pki.read("ca"))
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            metadata = (("authorization", f"Bearer {KEY}"),)
            identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
            status = channel.unary_unary("/mlx_worker.v1.FleetService/Status", identity, identity)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await status(bad, timeout=TIMEOUT, metadata=metadata)
            assert error.value.code() == Code.INVALID_ARGUMENT
            assert error.value.details() == (
                "the request bytes do not decode as mlx_worker.v1.StatusRequest: "
                "Wire format was corrupt"
            )
            stream = channel.unary_stream(
                "/mlx_worker.v1.FleetService/Generate", identity, identity
            )
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in stream(generate, timeout=TIMEOUT, metadata=metadata):
                    pass
            assert error.value.code() == Code.INVALID_ARGUMENT
            assert (error.value.details() or "").endswith("Request: prompt is not valid UTF-8")
        count = fleet.metrics.registry.get_sample_value
        for method in ("Status", "Generate"):
            labels = {"service": "mlx_worker.v1.FleetService", "method": method}
            assert count("mlx_fleet_rpcs_total", {**labels, "code": "INVALID_ARGUMENT"}) == 1
    finally:
        await server.stop(0)
        await fleet.stop()
