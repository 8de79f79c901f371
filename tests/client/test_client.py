"""The client SDK on a real worker: the tiny model through both clients, errors, cancelling.

The transport (the token, retries, deadlines) against a fake worker is
test_client_transport.py.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from client.sdk import MAX_TOKENS, PROMPT, generate_request
from driver import greedy
from grpc_health.v1 import health_pb2

from mlx_worker_svc.client.worker import AsyncWorkerClient, ClientError, WorkerClient
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.server import SERVICE_NAME, WorkerServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _target(server: WorkerServer) -> str:
    return f"127.0.0.1:{server.port}"


class _OneRequestScheduler:
    """Drives PROMPT through Execute, one step at a time, the way driver.drive does."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.step = 0
        self.computed = 0
        self.tokens: list[int] = []
        self.done = False

    def next_request(self) -> pb.ExecuteRequest:
        new, cached = [], []
        if self.step == 0:
            sampling = greedy(MAX_TOKENS, ignore_eos=True)
            new = [pb.NewRequest(req_id="r", prompt_token_ids=PROMPT, sampling_params=sampling)]
        else:
            cached = [pb.CachedRequest(req_id="r", num_computed_tokens=self.computed)]
        return pb.ExecuteRequest(
            step_id=self.step,
            worker_epoch=self.epoch,
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens={"r": len(PROMPT) + len(self.tokens) - self.computed},
        )

    def record(self, response: pb.ExecuteResponse) -> None:
        assert response.step_id == self.step
        (out,) = response.outputs
        self.tokens += out.sampled_token_ids
        self.computed = out.num_computed_tokens
        self.done = out.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        self.step += 1


# ------------------------------------------------------------ the real worker


async def _async_session(target: str, model: Path) -> tuple[list[int], list[int]]:
    """The lifecycle, Execute steps and a Generate stream; returns both token lists."""
    async with AsyncWorkerClient(target) as client:
        assert client.target == target
        assert await client.health(SERVICE_NAME) == NOT_SERVING
        device = await client.init_device()
        assert device.state == pb.WORKER_STATE_DEVICE_READY
        loaded = await client.load_model(pb.LoadModelRequest(model=str(model)))
        assert loaded.state == pb.WORKER_STATE_MODEL_LOADED and loaded.model.vocab_size > 0
        profile = await client.determine_memory(
            pb.DetermineMemoryRequest(max_num_batched_tokens=64, block_size=16)
        )
        assert profile.bytes_per_block > 0
        cache = await client.init_cache(pb.InitCacheRequest(num_blocks=256, block_size=16))
        assert cache.max_kv_tokens == 256 * 16
        assert await client.health() == SERVING
        assert await client.health(SERVICE_NAME) == SERVING
        warm = await client.warm_up()
        assert warm.shapes_run >= 1 and warm.state == pb.WORKER_STATE_SERVING
        info = await client.get_info()
        assert info.worker_epoch == loaded.worker_epoch
        ids = (await client.tokenize(pb.TokenizeRequest(text="hello world"))).token_ids
        assert ids
        text = await client.detokenize(pb.DetokenizeRequest(token_ids=ids))
        assert text.text == "hello world"

        scheduler = _OneRequestScheduler(loaded.worker_epoch)
        while not scheduler.done:
            scheduler.record(await client.execute(scheduler.next_request()))
        generated: list[int] = []
        last = pb.GenerateResponse()
        async for message in client.generate(generate_request()):
            generated += message.token_ids
            last = message
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.completion_tokens == MAX_TOKENS and last.prompt_tokens == len(PROMPT)
        health = await client.check_health()
        assert health.healthy and health.num_running_requests == 0
        return scheduler.tokens, generated


def _sync_session(target: str, model: Path) -> tuple[list[int], list[int]]:
    """The same through WorkerClient, on a worker that is already up (a no-op lifecycle)."""
    with WorkerClient(target) as client:
        assert client.target == target
        client.init_device()
        loaded = client.load_model(pb.LoadModelRequest(model=str(model)))
        client.determine_memory(pb.DetermineMemoryRequest(max_num_batched_tokens=64, block_size=16))
        client.init_cache(pb.InitCacheRequest(num_blocks=256, block_size=16))
        client.warm_up(pb.WarmUpRequest(batch_sizes=[1, 2]))
        assert client.get_info().worker_epoch == loaded.worker_epoch
        assert client.health(SERVICE_NAME) == SERVING

        scheduler = _OneRequestScheduler(loaded.worker_epoch)
        while not scheduler.done:
            scheduler.record(client.execute(scheduler.next_request()))
        generated = [
            t for message in client.generate(generate_request()) for t in message.token_ids
        ]

        for call, code in (
            (lambda: client.add_lora(pb.AddLoraRequest(name="a", path="/nowhere")), "NOT_FOUND"),
            (lambda: client.remove_lora(pb.RemoveLoraRequest(name="a")), "NOT_FOUND"),
            (lambda: client.pin_lora(pb.PinLoraRequest(name="a")), "NOT_FOUND"),
        ):
            with pytest.raises(ClientError) as info:
                call()
            assert info.value.code == grpc.StatusCode[code] and info.value.attempts == 1
        assert list(client.list_loras().names) == []

        assert client.reset_prefix_cache().freed_blocks >= 0
        asleep = client.sleep(pb.SleepRequest(level=1))
        assert asleep.state == pb.WORKER_STATE_SLEEPING and asleep.level == 1
        assert client.health(SERVICE_NAME) == NOT_SERVING
        awake = client.wake_up()
        assert awake.state == pb.WORKER_STATE_SERVING
        assert client.check_health().num_running_requests == 0
        stopped = client.shutdown(pb.ShutdownRequest(grace_seconds=1.0))
        assert stopped.state == pb.WORKER_STATE_DRAINING
        return scheduler.tokens, generated


def test_both_clients_run_the_lifecycle_and_agree_on_greedy_tokens(
    server: WorkerServer, tiny_dir: Path
) -> None:
    executed, generated = asyncio.run(_async_session(_target(server), tiny_dir))
    assert len(executed) == MAX_TOKENS
    assert generated == executed
    sync_executed, sync_generated = _sync_session(_target(server), tiny_dir)
    assert sync_executed == executed and sync_generated == executed


def test_a_failing_call_raises_client_error_with_its_code_and_method(
    server: WorkerServer, tiny_dir: Path
) -> None:
    target = _target(server)

    async def before_init_cache() -> ClientError:
        async with AsyncWorkerClient(target) as client:
            with pytest.raises(TypeError, match="InitDeviceRequest"):
                await client.init_device(pb.GetInfoRequest())  # type: ignore[arg-type]
            await client.init_device()
            epoch = (await client.load_model(pb.LoadModelRequest(model=str(tiny_dir)))).worker_epoch
            await client.determine_memory(pb.DetermineMemoryRequest(max_num_batched_tokens=64))
            scheduler = _OneRequestScheduler(epoch)
            with pytest.raises(ClientError) as info:
                await client.execute(scheduler.next_request())
            return info.value

    error = asyncio.run(before_init_cache())
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.method == "Execute" and error.attempts == 1
    assert "InitCache" in error.details
    assert str(error).startswith("Execute failed with FAILED_PRECONDITION: ")
    assert error.__cause__ is not None  # the grpc error, for debugging
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.code, copy.method, copy.details, str(copy)) == (
        error.code,
        error.method,
        error.details,
        str(error),
    )

    with WorkerClient(target) as client:
        with pytest.raises(ClientError) as info:
            client.warm_up()  # idempotent, but FAILED_PRECONDITION is not retried
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.method == "WarmUp" and info.value.attempts == 1
        with pytest.raises(ClientError) as info:
            client.health("no.such.Service")
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ClientError) as info:
            next(client.generate(generate_request()))
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.method == "Generate"
    with pytest.raises(RuntimeError, match="closed"):
        client.get_info()


def _wait_idle(check: Callable[[], int]) -> bool:
    """Whether CheckHealth's num_running_requests reaches 0 within 5 seconds."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if check() == 0:
            return True
        time.sleep(0.05)
    return False


def test_leaving_a_generate_stream_cancels_it_and_the_worker_frees_the_request(
    server: WorkerServer, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_worker_svc.engine.runner import ModelRunner, StepOutcome
    from mlx_worker_svc.engine.sequence import Work

    real_run = ModelRunner.run

    def slow_run(self: ModelRunner, work: Work) -> StepOutcome:
        time.sleep(0.02)  # 500 tokens take 10 s or more unless the stream is cancelled
        return real_run(self, work)

    monkeypatch.setattr(ModelRunner, "run", slow_run)
    target = _target(server)
    long_request = generate_request(max_tokens=500)

    async def leave_early() -> bool:
        async with AsyncWorkerClient(target) as client:
            async for message in client.generate(long_request):
                assert message.token_ids
                break  # the dropped iterator is closed, which cancels the call
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if (await client.check_health()).num_running_requests == 0:
                    return True
                await asyncio.sleep(0.05)
            return False

    with WorkerClient(target) as client:
        client.init_device()
        client.load_model(pb.LoadModelRequest(model=str(tiny_dir)))
        client.determine_memory(pb.DetermineMemoryRequest(max_num_batched_tokens=64))
        client.init_cache(pb.InitCacheRequest(num_blocks=256))
        assert asyncio.run(leave_early())

        stream = client.generate(long_request)
        assert next(stream).token_ids
        assert client.check_health().num_running_requests == 1
        stream.close()
        assert _wait_idle(lambda: client.check_health().num_running_requests)

        for message in client.generate(long_request):
            assert message.token_ids
            break
        assert _wait_idle(lambda: client.check_health().num_running_requests)
