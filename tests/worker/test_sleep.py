"""Sleep and WakeUp: memory is really given back, no request outlives its KV."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from driver import ServeProcess, bring_up, code_of, details_of, drive, greedy
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42]]


def _fails(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return code_of(info.value), details_of(info.value)


def test_sleep_level_1_aborts_live_requests_and_wake_up_restores_service(
    tiny_stub: Stub, tiny_dir: Path, channel: grpc.Channel
) -> None:
    stub = tiny_stub
    epoch = stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    reference = drive(stub, epoch, PROMPTS, max_tokens=6)
    stub.Execute(
        pb.ExecuteRequest(
            step_id=1,
            worker_epoch=epoch,
            new_requests=[
                pb.NewRequest(req_id="live", prompt_token_ids=[1, 2], sampling_params=greedy(50))
            ],
            num_scheduled_tokens={"live": 2},
        )
    )
    stream = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=[3, 4], sampling_params=greedy(500, ignore_eos=True))
    )
    next(stream)
    answer = stub.Sleep(pb.SleepRequest(level=1))
    assert answer.state == pb.WORKER_STATE_SLEEPING and answer.level == 1
    assert answer.num_aborted == 2 and answer.worker_epoch != epoch
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert code_of(info.value) == grpc.StatusCode.ABORTED
    health = stub.CheckHealth(pb.CheckHealthRequest())
    assert health.state == pb.WORKER_STATE_SLEEPING and health.kv.used_blocks == 0
    assert health.kv.prefix_cache_blocks == 0 and health.num_running_requests == 0
    checker = health_pb2_grpc.HealthStub(channel)
    service = health_pb2.HealthCheckRequest(service="mlx_worker.v1.WorkerService")
    assert checker.Check(service).status == health_pb2.HealthCheckResponse.NOT_SERVING
    code, message = _fails(
        lambda: stub.Execute(pb.ExecuteRequest(step_id=2, worker_epoch=answer.worker_epoch))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "WakeUp" in message
    # Level 1 keeps the weights: tokenizing still works.
    assert stub.Tokenize(pb.TokenizeRequest(text="hi")).token_ids
    woke = stub.WakeUp(pb.WakeUpRequest())
    assert woke.state == pb.WORKER_STATE_SERVING and woke.worker_epoch == answer.worker_epoch
    again = stub.WakeUp(pb.WakeUpRequest())  # awake: a no-op, as the README says
    assert (again.state, again.worker_epoch) == (woke.state, woke.worker_epoch)
    assert checker.Check(service).status == health_pb2.HealthCheckResponse.SERVING
    # A step of the old epoch cannot continue a request whose KV is gone.
    code, message = _fails(
        lambda: stub.Execute(
            pb.ExecuteRequest(
                step_id=3,
                worker_epoch=epoch,
                cached_requests=[pb.CachedRequest(req_id="live", num_computed_tokens=2)],
                num_scheduled_tokens={"live": 1},
            )
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "stale" in message
    # Its scheduler, on the new epoch, may free it: Sleep freed it lately.
    finish = pb.ExecuteRequest(step_id=4, worker_epoch=woke.worker_epoch)
    finish.finished_req_ids.append("live")
    assert not stub.Execute(finish).outputs
    assert drive(stub, woke.worker_epoch, PROMPTS, max_tokens=6) == reference


def test_sleep_level_2_gives_back_the_weights_and_wake_up_reloads_them(
    stub: Stub, smollm_f32_dir: Path
) -> None:
    stub.InitDevice(pb.InitDeviceRequest())
    loaded = stub.LoadModel(pb.LoadModelRequest(model=str(smollm_f32_dir)))
    stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=32, block_size=16))
    stub.InitCache(pb.InitCacheRequest(num_blocks=64, block_size=16))
    prompt = list(stub.Tokenize(pb.TokenizeRequest(text="The capital of France is")).token_ids)
    before_tokens = drive(stub, loaded.worker_epoch, [prompt], max_tokens=5)
    active = stub.GetInfo(pb.GetInfoRequest()).memory.active_bytes
    answer = stub.Sleep(pb.SleepRequest(level=2))
    after = stub.GetInfo(pb.GetInfoRequest())
    weights = loaded.model.weight_bytes
    assert weights > 50 << 20
    assert active - after.memory.active_bytes >= 0.9 * weights
    assert answer.freed_bytes >= 0.9 * weights
    # Model facts stay visible while asleep; what needs the weights says to wake up.
    assert after.model.weight_bytes == weights and after.state == pb.WORKER_STATE_SLEEPING
    code, message = _fails(lambda: stub.Tokenize(pb.TokenizeRequest(text="x")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "WakeUp" in message
    assert message.startswith("Tokenize: the worker is SLEEPING at level 2")
    woke = stub.WakeUp(pb.WakeUpRequest())
    assert woke.state == pb.WORKER_STATE_SERVING and woke.wake_seconds > 0
    assert stub.GetInfo(pb.GetInfoRequest()).memory.active_bytes >= 0.9 * weights
    assert drive(stub, woke.worker_epoch, [prompt], max_tokens=5) == before_tokens


def test_sleep_level_1_gives_back_the_memory_of_the_kv_it_frees(stub: Stub, tiny_dir: Path) -> None:
    bring_up(stub, tiny_dir, num_blocks=20)
    for _ in range(2):  # a first Sleep, and one after a WakeUp (a runner replaced)
        idle = stub.CheckHealth(pb.CheckHealthRequest()).memory.active_bytes
        epoch = stub.GetInfo(pb.GetInfoRequest()).worker_epoch
        new = pb.NewRequest(
            req_id="r", prompt_token_ids=list(range(5, 305)), sampling_params=greedy(20)
        )
        stub.Execute(
            pb.ExecuteRequest(
                worker_epoch=epoch, new_requests=[new], num_scheduled_tokens={"r": 300}
            )
        )
        busy = stub.CheckHealth(pb.CheckHealthRequest()).memory.active_bytes
        assert busy > idle + 300 * 512  # 300 tokens of KV: 2 layers x 2 heads x 16 x K,V x 4 B
        slept = stub.Sleep(pb.SleepRequest(level=1))
        after = stub.CheckHealth(pb.CheckHealthRequest()).memory.active_bytes
        # The runner's KV is gone, not kept alive by the model's adapter callbacks.
        assert after <= idle + 4096, (idle, busy, after)
        assert slept.freed_bytes > 300 * 512, (slept.freed_bytes, idle, busy, after)
        stub.WakeUp(pb.WakeUpRequest())


def test_init_cache_replacing_the_cache_gives_back_the_memory_of_the_one_it_replaces(
    stub: Stub, tiny_dir: Path
) -> None:
    epoch = bring_up(stub, tiny_dir, num_blocks=40)
    idle = stub.CheckHealth(pb.CheckHealthRequest()).memory.active_bytes
    for num_blocks in (41, 42, 43):  # each InitCache on an idle worker replaces the cache
        drive(stub, epoch, [list(range(5, 205)), list(range(7, 107))], max_tokens=4)
        kv = stub.CheckHealth(pb.CheckHealthRequest()).kv
        assert kv.used_blocks == 0 and kv.prefix_cache_blocks == 18  # 12 + 6 whole blocks
        stub.InitCache(pb.InitCacheRequest(num_blocks=num_blocks, block_size=16))
        health = stub.CheckHealth(pb.CheckHealthRequest())
        assert health.kv.num_blocks == num_blocks and health.kv.prefix_cache_blocks == 0
        # The old cache's blocks are freed with it, not whenever Python collects it.
        after = health.memory.active_bytes
        assert after <= idle + 4096, (num_blocks, idle, after)


def test_load_model_of_another_model_gives_back_the_one_it_replaces(
    stub: Stub, tiny_dir: Path, tiny_tools_dir: Path
) -> None:
    """A served worker swapped to another model (LoadModel, idle) holds that model's
    weights, not both: the runner's adapter hooks kept the old model alive. And the
    peak memory MemoryUsage reports is the highest since start, not since a profile."""
    epoch = bring_up(stub, tiny_dir, num_blocks=20)
    drive(stub, epoch, PROMPTS, max_tokens=4)
    loaded = stub.LoadModel(pb.LoadModelRequest(model=str(tiny_tools_dir))).model
    memory = stub.CheckHealth(pb.CheckHealthRequest()).memory
    assert memory.active_bytes < loaded.weight_bytes * 1.25, (memory, loaded.weight_bytes)
    # Both models were resident while the new one loaded: the peak holds them both.
    assert memory.peak_bytes > loaded.weight_bytes * 1.75, memory
    stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=16))  # profiles
    assert stub.CheckHealth(pb.CheckHealthRequest()).memory.peak_bytes >= memory.peak_bytes


def test_sleep_and_wake_up_rules(stub: Stub, tiny_dir: Path) -> None:
    code, message = _fails(lambda: stub.Sleep(pb.SleepRequest(level=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "InitDevice" in message
    code, message = _fails(lambda: stub.WakeUp(pb.WakeUpRequest()))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    bring_up(stub, tiny_dir)
    code, message = _fails(lambda: stub.Sleep(pb.SleepRequest(level=3)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "level" in message
    # Awake: WakeUp changes nothing.
    assert stub.WakeUp(pb.WakeUpRequest()).state == pb.WORKER_STATE_READY
    first = stub.Sleep(pb.SleepRequest())
    assert first.level == 1
    again = stub.Sleep(pb.SleepRequest(level=1))
    assert again.level == 1 and again.worker_epoch == first.worker_epoch
    deeper = stub.Sleep(pb.SleepRequest(level=2))
    assert deeper.level == 2 and deeper.freed_bytes > 0
    code, _ = _fails(
        lambda: list(
            stub.Generate(pb.GenerateRequest(prompt_token_ids=[1], sampling_params=greedy(1)))
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.WakeUp(pb.WakeUpRequest()).state == pb.WORKER_STATE_READY


def test_a_served_worker_gives_its_weights_back_on_sleep_level_2(
    start_worker: Callable[[float], ServeProcess],
) -> None:
    # Through `mlx-worker serve --auto-init`: nothing in the CLI may pin the model.
    worker = start_worker(5.0)
    stub = pb_grpc.WorkerServiceStub(worker.channel())
    info = stub.GetInfo(pb.GetInfoRequest())
    answer = stub.Sleep(pb.SleepRequest(level=2))
    assert answer.freed_bytes >= 0.9 * info.model.weight_bytes
    assert stub.CheckHealth(pb.CheckHealthRequest()).kv.num_blocks == info.kv.num_blocks
    stub.WakeUp(pb.WakeUpRequest())
    assert stub.GetInfo(pb.GetInfoRequest()).memory.active_bytes >= info.model.weight_bytes


def test_load_model_while_asleep_at_level_2_swaps_the_model(stub: Stub, tiny_dir: Path) -> None:
    epoch = bring_up(stub, tiny_dir)
    stub.Sleep(pb.SleepRequest(level=1))
    code, message = _fails(lambda: stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir))))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "WakeUp" in message
    stub.Sleep(pb.SleepRequest(level=2))
    # A load that fails leaves the worker asleep.
    code, message = _fails(lambda: stub.LoadModel(pb.LoadModelRequest(model="/no/such/model")))
    assert code == grpc.StatusCode.NOT_FOUND and "/no/such/model" in message
    assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_SLEEPING
    other = stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir), max_model_len=128))
    assert other.state == pb.WORKER_STATE_MODEL_LOADED and other.worker_epoch > epoch
    assert other.model.max_context_length == 128
    stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=32))
    stub.InitCache(pb.InitCacheRequest(num_blocks=32, block_size=16))
    assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_READY
    # Generate names the loaded model, by its path or directory name, or nothing.
    ask = pb.GenerateRequest(
        prompt_token_ids=PROMPTS[0], sampling_params=greedy(3, ignore_eos=True)
    )
    answers = []
    for name in ("", str(tiny_dir), tiny_dir.name):
        ask.model = name
        answers.append([t for m in stub.Generate(ask) for t in m.token_ids])
    assert len(answers[0]) == 3 and answers == [answers[0]] * 3
    ask.model = "another-model"
    code, message = _fails(lambda: list(stub.Generate(ask)))
    assert code == grpc.StatusCode.NOT_FOUND and "'another-model'" in message
