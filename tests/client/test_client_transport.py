"""The client SDK's transport against a fake worker: the token, retries, deadlines.

The fake servicer counts calls, fails GetInfo a set number of times, fails Execute
always and answers CheckHealth slowly, behind an interceptor that requires the
bearer token, so each test can say how many attempts each method made.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from client.sdk import fast_config, generate_request

from mlx_worker_svc.client.worker import (
    IDEMPOTENT_METHODS,
    AsyncWorkerClient,
    ClientError,
    WorkerClient,
)
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

TOKEN = "s3cret"
NOWHERE = "127.0.0.1:1"  # nothing listens there


class _FakeWorker(pb_grpc.WorkerServiceServicer):
    """Counts calls; GetInfo fails `flaky` times, Execute always, CheckHealth is slow."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.flaky = 0
        self.release = threading.Event()

    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.calls["GetInfo"] += 1
        if self.calls["GetInfo"] <= self.flaky:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return pb.GetInfoResponse(worker_epoch=7)

    def CheckHealth(self, request: pb.CheckHealthRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.calls["CheckHealth"] += 1
        self.release.wait(10)
        return pb.CheckHealthResponse(healthy=True)

    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.calls["Execute"] += 1
        if request.step_id == 1:
            self.release.wait(10)
        context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")

    def Generate(  # noqa: N802
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        self.calls["Generate"] += 1
        for token in range(3):
            yield pb.GenerateResponse(token_ids=[token])


class _RequireToken(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Aborts UNAUTHENTICATED unless `authorization: Bearer TOKEN` came along."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if handler is None or (("authorization", f"Bearer {TOKEN}") in details.invocation_metadata):
            return handler

        def deny(request: bytes, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "a bearer token is required")

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


@pytest.fixture
def fake() -> Iterator[tuple[str, _FakeWorker]]:
    servicer = _FakeWorker()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[_RequireToken()])
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    servicer.release.set()
    server.stop(None).wait()


def test_the_token_travels_on_every_call(fake: tuple[str, _FakeWorker]) -> None:
    target, servicer = fake

    async def calls() -> None:
        async with AsyncWorkerClient(target, fast_config(token=TOKEN)) as client:
            assert (await client.get_info()).worker_epoch == 7
            tokens = [t async for m in client.generate(generate_request()) for t in m.token_ids]
            assert tokens == [0, 1, 2]
        for config in (fast_config(), fast_config(token="wrong")):
            async with AsyncWorkerClient(target, config) as client:
                with pytest.raises(ClientError) as info:
                    await client.get_info()
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
                assert info.value.method == "GetInfo" and info.value.attempts == 1
                with pytest.raises(ClientError) as info:
                    async for _ in client.generate(generate_request()):
                        pass
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(calls())
    with WorkerClient(target, fast_config(token=TOKEN)) as client:
        assert client.get_info().worker_epoch == 7
        assert [m.token_ids[0] for m in client.generate(generate_request())] == [0, 1, 2]
    assert servicer.calls == Counter(GetInfo=2, Generate=2)


def test_idempotent_calls_are_retried_on_unavailable_and_the_rest_tried_once(
    fake: tuple[str, _FakeWorker], caplog: pytest.LogCaptureFixture
) -> None:
    expected = {
        "InitDevice",
        "LoadModel",
        "DetermineMemory",
        "InitCache",
        "WarmUp",
        "CheckHealth",
        "GetInfo",
        "Tokenize",
        "Detokenize",
        "WakeUp",
        "ResetPrefixCache",
        "PinLora",
        "ListLoras",
        "Health.Check",
    }
    assert expected == IDEMPOTENT_METHODS
    target, servicer = fake
    servicer.flaky = 2
    caplog.set_level(logging.INFO, logger="mlx_worker_svc.client.worker")

    async def calls() -> None:
        async with AsyncWorkerClient(target, fast_config(token=TOKEN, retries=3)) as client:
            assert (await client.get_info()).worker_epoch == 7  # third attempt
            with pytest.raises(ClientError) as info:
                await client.execute(pb.ExecuteRequest())
            assert info.value.code == grpc.StatusCode.UNAVAILABLE and info.value.attempts == 1

    asyncio.run(calls())
    assert servicer.calls == Counter(GetInfo=3, Execute=1)
    retries = [r.getMessage() for r in caplog.records if r.name == "mlx_worker_svc.client.worker"]
    assert len(retries) == 2 and all(m.startswith("GetInfo") for m in retries)


def test_nothing_listening_is_unavailable_after_the_configured_retries() -> None:
    config = fast_config(retries=2)

    async def calls() -> tuple[ClientError, ClientError]:
        async with AsyncWorkerClient(NOWHERE, config) as client:
            with pytest.raises(ClientError) as info:
                await client.get_info()
            with pytest.raises(ClientError) as execute:
                await client.execute(pb.ExecuteRequest())
            return info.value, execute.value

    start = time.monotonic()
    info, execute = asyncio.run(calls())
    assert time.monotonic() - start < 10
    assert info.code == execute.code == grpc.StatusCode.UNAVAILABLE
    assert info.attempts == 3 and "after 3 attempts" in str(info)
    assert execute.attempts == 1 and execute.method == "Execute"

    with WorkerClient(NOWHERE, fast_config(retries=1)) as client:
        with pytest.raises(ClientError) as sync_info:
            client.health()
        assert sync_info.value.code == grpc.StatusCode.UNAVAILABLE
        assert sync_info.value.attempts == 2 and sync_info.value.method == "Health.Check"
        with pytest.raises(ClientError) as stream:
            list(client.generate(generate_request()))
        assert stream.value.code == grpc.StatusCode.UNAVAILABLE and stream.value.attempts == 1


def test_a_slow_call_hits_its_deadline(fake: tuple[str, _FakeWorker]) -> None:
    target, servicer = fake

    async def calls() -> tuple[ClientError, ClientError]:
        config = fast_config(token=TOKEN, retries=1, execute_timeout=0.3)
        async with AsyncWorkerClient(target, config) as client:
            with pytest.raises(ClientError) as health:
                await client.check_health(timeout=0.3)  # retried once
            with pytest.raises(ClientError) as execute:
                await client.execute(pb.ExecuteRequest(step_id=1))  # execute_timeout
            return health.value, execute.value

    start = time.monotonic()
    health, execute = asyncio.run(calls())
    assert time.monotonic() - start < 5
    assert health.code == execute.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert health.method == "CheckHealth" and health.attempts == 2
    assert execute.method == "Execute" and execute.attempts == 1
    deadline = time.monotonic() + 5
    while servicer.calls != Counter(CheckHealth=2, Execute=1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servicer.calls == Counter(CheckHealth=2, Execute=1)

    with WorkerClient(target, fast_config(token=TOKEN, retries=0, timeout=0.2)) as client:
        with pytest.raises(ClientError) as info:
            client.check_health()  # the config's default deadline
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and info.value.attempts == 1


@pytest.mark.parametrize("token", [f"{TOKEN}\n", "two words", "", "t\u00f6ken"])
def test_a_token_no_header_can_carry_is_refused_when_the_config_is_made(token: str) -> None:
    """gRPC would fail every call with its own "Illegal header value" (not a ClientError);
    the config says what is wrong before any call."""
    with pytest.raises(ValueError, match="token must be non-empty printable ASCII"):
        fast_config(token=token)
