"""Requests that do not decode: INVALID_ARGUMENT (gRPC) or 400 (HTTP), never a server error.

Acceptance: a corpus of at least 200 undecodable requests (bad UTF-8 in every
string field of every request type, truncated and random bytes) against a
worker, a fleet and a gateway front gives 0 INTERNAL, 0 UNKNOWN and 0 tracebacks
in the logs, and the worker's greedy output is unchanged afterwards.

The gRPC corpus (tests/undecodable.py) is built from the descriptors. For every
method of the services a server offers (WorkerService or FleetService,
grpc.health.v1 and both reflection versions) it holds one request per string
field of the method's input type and kind of invalid UTF-8, nested messages,
repeated fields and map keys included; and truncated and random bytes that do
not parse. Each is sent as raw bytes (identity serializers) to a real
`serve --auto-init` worker on the tiny model and to a real `fleet` in front of
it, and must be INVALID_ARGUMENT naming the message type (and the field, for
bad UTF-8). The
gateway, in front of the same worker, gets bodies with invalid UTF-8 in each
field, truncated JSON, lone surrogates, deep nesting and random bytes on every
endpoint that reads a body, and must answer 400 in OpenAI's error shape (404 for
a model id that is not UTF-8 on /v1/models/{id}). Codes seen are printed
(pytest -s).
"""

from __future__ import annotations

import asyncio
import json
import logging
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
from certificates import Pki, tls
from processes import Proc
from undecodable import BAD_UTF8, TIMEOUT, corpus, run_corpus

from mlx_worker_svc.fleet import FleetScheduler
from mlx_worker_svc.fleet.server import serve_fleet
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc import decoding
from mlx_worker_svc.rpc.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer

Code = grpc.StatusCode
COMMON = ("grpc.health.v1.Health", V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
WORKER_SERVICES = ("mlx_worker.v1.WorkerService", *COMMON)
FLEET_SERVICES = ("mlx_worker.v1.FleetService", *COMMON)
PROMPT = [11, 12, 13, 14, 15]
KEY = "sk-decoding"


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


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _unary(port: int, method: str, data: bytes) -> tuple[Code, str]:
    identity: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(method, identity, identity)
        try:
            list(call(data, timeout=TIMEOUT))
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            return exc.code(), exc.details() or ""
    return Code.OK, ""


def test_a_field_unknown_here_is_unimplemented_naming_it(stack: Stack) -> None:
    """A client built from a newer proto sets a field this server lacks: protobuf would
    drop its value unseen, so the call is refused naming it (nested ones too), while an
    unusual but valid encoding of known fields (unpacked token ids) is taken."""
    generate = pb.GenerateRequest(
        prompt_token_ids=PROMPT, sampling_params=pb.SamplingParams(max_tokens=2)
    )
    newer = generate.SerializeToString() + _varint(8 << 3) + _varint(1)  # field 8: a gap
    params = pb.SamplingParams(max_tokens=2).SerializeToString()
    nested = pb.GenerateRequest(prompt_token_ids=PROMPT)
    nested.sampling_params.ParseFromString(params + _varint(999 << 3) + _varint(7))
    unpacked = b"".join(_varint(3 << 3) + _varint(t) for t in PROMPT)
    unpacked += _varint(4 << 3 | 2) + _varint(len(params)) + params
    # A group (wire types 3 and 4; these protocols have none), and a known field in
    # another wire type than its own (protobuf keeps both aside, unread).
    grouped = generate.SerializeToString() + _varint(30 << 3 | 3) + _varint(30 << 3 | 4)
    wrong_type = pb.GenerateRequest(prompt_token_ids=PROMPT).SerializeToString()
    wrong_type += _varint(4 << 3 | 0) + _varint(2)  # sampling_params as a number
    for name, port, service in (
        ("worker", stack.worker_port, "mlx_worker.v1.WorkerService"),
        ("fleet", stack.fleet_port, "mlx_worker.v1.FleetService"),
    ):
        code, details = _unary(port, f"/{service}/Generate", newer)
        assert code == Code.UNIMPLEMENTED, (service, code, details)
        assert details.startswith(
            "mlx_worker.v1.GenerateRequest: field 8 is not a field this server knows"
        )
        code, details = _unary(port, f"/{service}/Generate", nested.SerializeToString())
        assert code == Code.UNIMPLEMENTED, (service, code, details)
        assert "sampling_params.field 999 is not a field this server knows" in details
        code, details = _unary(port, f"/{service}/Generate", grouped)
        assert code == Code.UNIMPLEMENTED, (service, code, details)
        assert details.startswith("mlx_worker.v1.GenerateRequest: field 30 is not a field")
        code, details = _unary(port, f"/{service}/Generate", wrong_type)
        stack.sent[name] += 1  # a refusal that does not decode: its log line is counted
        assert code == Code.INVALID_ARGUMENT, (service, code, details)
        assert details == (
            "the request bytes do not decode as mlx_worker.v1.GenerateRequest: "
            "sampling_params (wire type 0, not its type's)"
        )
        assert _unary(port, f"/{service}/Generate", unpacked) == (Code.OK, "")


def _chunk(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def test_a_map_entry_that_does_not_fit_its_map_is_named(stack: Stack) -> None:
    """A map entry's key or value in another wire type is INVALID_ARGUMENT naming the map
    (nested too); a field an entry does not have is UNIMPLEMENTED naming its number."""
    execute = "/mlx_worker.v1.WorkerService/Execute"
    prefix = "the request bytes do not decode as mlx_worker.v1.ExecuteRequest: "
    value_as_bytes = _chunk(5, _chunk(1, b"r") + _chunk(2, b"ab"))  # num_scheduled_tokens
    key_as_number = _chunk(5, _varint(1 << 3) + _varint(3) + _varint(2 << 3) + _varint(5))
    params = pb.SamplingParams(max_tokens=2).SerializeToString()
    params += _chunk(8, _varint(1 << 3) + _varint(5) + _chunk(2, b"xx"))  # logit_bias
    new = pb.NewRequest(req_id="r", prompt_token_ids=PROMPT).SerializeToString()
    nested = _chunk(3, new + _chunk(3, params))
    for data, what in (
        (value_as_bytes, "num_scheduled_tokens (a value, wire type 2, not its type's)"),
        (key_as_number, "num_scheduled_tokens (a key, wire type 0, not its type's)"),
        (
            nested,
            "new_requests[0].sampling_params.logit_bias (a value, wire type 2, not its type's)",
        ),
    ):
        stack.sent["worker"] += 1
        assert _unary(stack.worker_port, execute, data) == (Code.INVALID_ARGUMENT, prefix + what)
    extra = _chunk(5, _chunk(1, b"r") + _varint(2 << 3) + _varint(1) + _varint(3 << 3) + _varint(1))
    code, details = _unary(stack.worker_port, execute, extra)
    assert code == Code.UNIMPLEMENTED, details
    assert details.startswith(
        "mlx_worker.v1.ExecuteRequest: num_scheduled_tokens (an entry's field 3) is not a "
        "field this server knows"
    )


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
            labels["code"] = "INVALID_ARGUMENT"
            # The server counts a call as its handler unwinds, which can be just after
            # the client has its status: wait for the count, a bounded while.
            for _ in range(100):
                if count("mlx_fleet_rpcs_total", labels) is not None:
                    break
                await asyncio.sleep(0.05)
            assert count("mlx_fleet_rpcs_total", labels) == 1
    finally:
        await server.stop(0)
        await fleet.stop()


def test_a_refusal_is_logged_under_the_methods_name(caplog: pytest.LogCaptureFixture) -> None:
    # As the servicer's own `rpc failed` lines name it: the method, not its path.
    with caplog.at_level(logging.INFO, logger="mlx_worker_svc.rpc.decoding"):
        decoding._log("/mlx_worker.v1.WorkerService/GetInfo", decoding.Undecodable("bad bytes"))
    [record] = [r for r in caplog.records if r.getMessage() == "rpc failed"]
    fields = tuple(getattr(record, name) for name in ("rpc", "code", "error"))
    assert fields == ("GetInfo", "INVALID_ARGUMENT", "bad bytes")
