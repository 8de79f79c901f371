"""The lifecycle over gRPC: order, idempotency, health, bad models."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from driver import bring_up, code_of, details_of, greedy
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import SERVICE_NAME

Stub = pb_grpc.WorkerServiceStub


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    err = info.value
    return code_of(err), details_of(err)


def _calls(stub: Stub, model: Path) -> dict[str, Callable[[], Any]]:
    return {
        "LoadModel": lambda: stub.LoadModel(pb.LoadModelRequest(model=str(model))),
        "DetermineMemory": lambda: stub.DetermineMemory(
            pb.DetermineMemoryRequest(max_num_batched_tokens=32)
        ),
        "InitCache": lambda: stub.InitCache(pb.InitCacheRequest(num_blocks=64, block_size=16)),
        "WarmUp": lambda: stub.WarmUp(pb.WarmUpRequest()),
        "Sleep": lambda: stub.Sleep(pb.SleepRequest(level=1)),
        "Execute": lambda: stub.Execute(pb.ExecuteRequest(step_id=1)),
        "Generate": lambda: list(stub.Generate(pb.GenerateRequest(prompt="hi"))),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="hi")),
        "Detokenize": lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1])),
    }


def _bad_calls(stub: Stub) -> dict[str, Callable[[], Any]]:
    """Each call with fields left at their defaults or out of range: out of order, the
    state is the answer all the same (the README: FAILED_PRECONDITION naming the call
    that must come first)."""
    return {
        "LoadModel": lambda: stub.LoadModel(pb.LoadModelRequest(max_model_len=1)),
        "DetermineMemory": lambda: stub.DetermineMemory(
            pb.DetermineMemoryRequest(memory_utilization=2.0, block_size=4096)
        ),
        "InitCache": lambda: stub.InitCache(pb.InitCacheRequest()),
        "WarmUp": lambda: stub.WarmUp(pb.WarmUpRequest(batch_sizes=[0])),
        "Sleep": lambda: stub.Sleep(pb.SleepRequest(level=9)),
        "Execute": lambda: stub.Execute(pb.ExecuteRequest(finished_req_ids=[""])),
        "Generate": lambda: list(
            stub.Generate(
                pb.GenerateRequest(prompt="x", sampling_params=pb.SamplingParams(temperature=-5))
            )
        ),
        "Tokenize": lambda: stub.Tokenize(pb.TokenizeRequest(text="x", tools_json="[]")),
        "Detokenize": lambda: stub.Detokenize(pb.DetokenizeRequest()),
    }


# For each state reached by the calls before it: the calls that must still fail,
# and the call the error message must name.
_OUT_OF_ORDER = [
    ("NEW", [], "InitDevice"),
    ("DEVICE_READY", ["InitDevice"], "LoadModel"),
    ("MODEL_LOADED", ["InitDevice", "LoadModel"], "DetermineMemory"),
    ("MEMORY_PROFILED", ["InitDevice", "LoadModel", "DetermineMemory"], "InitCache"),
]
_NEEDS = {
    "LoadModel": "DEVICE_READY",
    "DetermineMemory": "MODEL_LOADED",
    "InitCache": "MEMORY_PROFILED",
    "WarmUp": "READY",
    "Sleep": "READY",
    "Execute": "READY",
    "Generate": "READY",
    "Tokenize": "MODEL_LOADED",
    "Detokenize": "MODEL_LOADED",
}
_ORDER = ["NEW", "DEVICE_READY", "MODEL_LOADED", "MEMORY_PROFILED", "READY"]


@pytest.mark.parametrize(("state", "done", "next_call"), _OUT_OF_ORDER)
def test_out_of_order_calls_fail_with_failed_precondition(
    stub: Stub, tiny_dir: Path, state: str, done: list[str], next_call: str
) -> None:
    calls = _calls(stub, tiny_dir)
    calls["InitDevice"] = lambda: stub.InitDevice(pb.InitDeviceRequest())
    for name in done:
        calls[name]()
    assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WorkerState.Value(
        f"WORKER_STATE_{state}"
    )
    too_early = [n for n, need in _NEEDS.items() if _ORDER.index(need) > _ORDER.index(state)]
    assert too_early
    bad = _bad_calls(stub)
    for name in too_early:
        for call in (calls[name], bad[name]):
            code, message = _code(call)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (name, message)
            assert state in message and f"call {next_call} first" in message, message


def test_a_sleeping_worker_says_so_whatever_a_call_carries(stub: Stub, tiny_dir: Path) -> None:
    """Asleep (level 1), the calls it does not take get FAILED_PRECONDITION "call WakeUp
    first", with fields left at their defaults or out of range as well."""
    bring_up(stub, tiny_dir)
    stub.Sleep(pb.SleepRequest(level=1))
    bad = _bad_calls(stub)
    for name in ("DetermineMemory", "InitCache", "WarmUp", "Execute", "Generate"):
        for call in (_calls(stub, tiny_dir)[name], bad[name]):
            code, message = _code(call)
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (name, message)
            assert "SLEEPING: call WakeUp first" in message, message
    code, message = _code(bad["Sleep"])  # asleep, Sleep deepens it: its level is checked
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "Sleep.level" in message, message


def test_full_lifecycle_and_idempotent_repeats(stub: Stub, tiny_dir: Path) -> None:
    device = stub.InitDevice(pb.InitDeviceRequest())
    assert device.device.kind in (pb.DEVICE_KIND_CPU, pb.DEVICE_KIND_GPU)
    assert device.device.mlx_version and device.device.mlx_lm_version
    assert device.device.total_memory_bytes > 0 and device.device.world_size == 1
    assert stub.InitDevice(pb.InitDeviceRequest()).device == device.device

    loaded = stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir)))
    info = loaded.model
    assert (info.vocab_size, info.num_layers, info.num_kv_heads, info.head_dim) == (
        49152,
        2,
        2,
        16,
    )
    assert info.hidden_size == 64 and info.max_context_length == 512
    assert list(info.eos_token_ids) == [2] and info.weight_bytes > 0
    assert info.quantization.bits == 0 and info.dtype == "float32"
    again = stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir)))
    assert again.worker_epoch == loaded.worker_epoch  # same args: no reload
    # The same directory written another way is the same model: no reload either.
    for spelled in (f"{tiny_dir}/", os.path.relpath(tiny_dir)):
        same = stub.LoadModel(pb.LoadModelRequest(model=spelled))
        assert same.worker_epoch == loaded.worker_epoch, spelled
    # A context of one token takes no prompt: refused, and the model stays.
    request = pb.LoadModelRequest(model=str(tiny_dir), max_model_len=1)
    code, message = _code(lambda: stub.LoadModel(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("LoadModelRequest.max_model_len is 1")
    assert stub.GetInfo(pb.GetInfoRequest()).worker_epoch == loaded.worker_epoch

    memory = stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=32))
    assert memory.bytes_per_block > 0 and memory.block_size == 16
    assert memory.weight_bytes == info.weight_bytes
    assert memory.state == pb.WORKER_STATE_MEMORY_PROFILED

    cache = stub.InitCache(pb.InitCacheRequest(num_blocks=100))
    assert (cache.num_blocks, cache.block_size, cache.max_kv_tokens) == (100, 16, 1600)
    assert cache.state == pb.WORKER_STATE_READY
    assert stub.InitCache(pb.InitCacheRequest(num_blocks=100)).num_blocks == 100

    warm = stub.WarmUp(pb.WarmUpRequest(batch_sizes=[1, 2], prefill_lengths=[8]))
    assert warm.shapes_run == 3 and warm.state == pb.WORKER_STATE_SERVING

    health = stub.CheckHealth(pb.CheckHealthRequest(deep=True))
    assert health.healthy and health.deep_check_ns > 0
    assert health.kv.num_blocks == 100 and health.kv.free_blocks == 100
    info_response = stub.GetInfo(pb.GetInfoRequest())
    assert info_response.model.vocab_size == 49152 and info_response.chat_template

    step = stub.Execute(
        pb.ExecuteRequest(
            step_id=7,
            worker_epoch=loaded.worker_epoch,
            new_requests=[
                pb.NewRequest(req_id="a", prompt_token_ids=[1, 2, 3], sampling_params=greedy(2))
            ],
            num_scheduled_tokens={"a": 3},
        )
    )
    assert step.step_id == 7 and len(step.outputs[0].sampled_token_ids) == 1
    timings = step.timings
    assert timings.total_ns >= timings.forward_ns > 0
    assert (timings.num_tokens, timings.decode_batch_size) == (3, 1)
    # A step that computes nothing (it only finishes a request) runs no forward.
    done = stub.Execute(pb.ExecuteRequest(worker_epoch=loaded.worker_epoch, finished_req_ids=["a"]))
    assert done.timings.num_tokens == 0 and done.timings.forward_ns == 0
    assert done.timings.total_ns > 0


def test_health_service_follows_the_lifecycle(
    stub: Stub, channel: grpc.Channel, tiny_dir: Path
) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == serving
    service = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    assert health.Check(service).status == not_serving
    watch = health.Watch(service)
    seen: list[int] = []

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # CANCELLED, below
            seen.extend(r.status for r in watch)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    bring_up(stub, tiny_dir)
    assert health.Check(service).status == serving
    time.sleep(0.3)
    watch.cancel()
    reader.join(timeout=10)
    # Watch sends on change: four lifecycle calls to READY, one change.
    assert seen == [not_serving, serving]


def test_bad_model_paths_leave_the_worker_usable(
    stub: Stub, tiny_dir: Path, tmp_path: Path
) -> None:
    stub.InitDevice(pb.InitDeviceRequest())
    code, message = _code(lambda: stub.LoadModel(pb.LoadModelRequest(model="/no/such/model")))
    assert code == grpc.StatusCode.NOT_FOUND and "/no/such/model" in message
    code, message = _code(lambda: stub.LoadModel(pb.LoadModelRequest(model=str(tmp_path))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "config.json" in message
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, message = _code(lambda: stub.LoadModel(pb.LoadModelRequest(model=str(broken))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "could not be loaded" in message
    code, _ = _code(lambda: stub.LoadModel(pb.LoadModelRequest(model="")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_DEVICE_READY
    loaded = stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir)))
    assert loaded.state == pb.WORKER_STATE_MODEL_LOADED
    # With a model held too (its path is compared first): a name no file system takes.
    code, message = _code(lambda: stub.LoadModel(pb.LoadModelRequest(model="a" * 5000)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "is not a usable path" in message


def test_reloading_a_model_starts_a_new_epoch(stub: Stub, tiny_dir: Path) -> None:
    epoch = bring_up(stub, tiny_dir)
    relative = os.path.relpath(tiny_dir)
    reloaded = stub.LoadModel(pb.LoadModelRequest(model=relative, max_model_len=256))
    assert reloaded.worker_epoch > epoch and reloaded.model.max_context_length == 256
    # ModelInfo.model is the request's, model_path the directory made absolute.
    assert (reloaded.model.model, reloaded.model.model_path) == (relative, str(tiny_dir))
    assert reloaded.state == pb.WORKER_STATE_MODEL_LOADED
    code, message = _code(lambda: stub.Execute(pb.ExecuteRequest(worker_epoch=epoch)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "DetermineMemory" in message


def test_init_device_changes_and_world_size(stub: Stub) -> None:
    # A single process is no group: world_size 2, a backend or a rank past 0 is refused.
    code, message = _code(lambda: stub.InitDevice(pb.InitDeviceRequest(world_size=2)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--world-size 2" in message
    request = pb.InitDeviceRequest(distributed_init_method="ring")
    code, message = _code(lambda: stub.InitDevice(request))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "single process" in message
    code, message = _code(lambda: stub.InitDevice(pb.InitDeviceRequest(rank=1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "only rank 0" in message
    device = stub.InitDevice(pb.InitDeviceRequest(world_size=1)).device
    assert (device.world_size, device.backend, list(device.ranks)) == (1, "", [])
    stub.InitDevice(pb.InitDeviceRequest())  # 0 and 1 both mean "one process"
    code, message = _code(lambda: stub.InitDevice(pb.InitDeviceRequest(world_size=2)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "asks for world_size 2 (initialised with 1)" in message
    # A rank past 0 is the caller's mistake in any state (worker.proto's InitDeviceRequest),
    # and so is a backend mx.distributed does not have.
    code, message = _code(lambda: stub.InitDevice(pb.InitDeviceRequest(rank=3)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "only rank 0" in message
    request = pb.InitDeviceRequest(distributed_init_method="bogus")
    code, message = _code(lambda: stub.InitDevice(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert message.startswith("InitDevice.distributed_init_method 'bogus' is no mx.distributed")


@pytest.mark.parametrize(
    ("rpc", "request_message"),
    [
        ("AddLora", pb.AddLoraRequest(name="x", path="/tmp")),
        ("RemoveLora", pb.RemoveLoraRequest(name="x")),
        ("PinLora", pb.PinLoraRequest(name="x")),
    ],
)
def test_adapter_calls_need_a_model(stub: Stub, rpc: str, request_message: Any) -> None:
    code, message = _code(lambda: getattr(stub, rpc)(request_message))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"{rpc} needs state MODEL_LOADED or later" in message
    assert list(stub.ListLoras(pb.ListLorasRequest()).names) == []


def test_quantization_is_reported_from_the_weights_not_config_json(
    stub: Stub, tiny_dir: Path, tmp_path: Path
) -> None:
    from driver import mlx_lm_tokens
    from tiny_model import quantized_copy

    honest = quantized_copy(tiny_dir, tmp_path / "honest", bits=4, group_size=32)
    mislabelled = quantized_copy(tiny_dir, tmp_path / "mislabelled", bits=4, group_size=32)
    config = json.loads((mislabelled / "config.json").read_text())
    config["quantization"] = config["quantization_config"] = {"bits": 8, "group_size": 64}
    (mislabelled / "config.json").write_text(json.dumps(config))
    # mlx-lm reads each layer's bits and group size from its packed weights: the same model.
    prompt = [[1, 2, 3, 4]]
    assert mlx_lm_tokens(mislabelled, prompt, 6) == mlx_lm_tokens(honest, prompt, 6)
    stub.InitDevice(pb.InitDeviceRequest())
    loaded = stub.LoadModel(pb.LoadModelRequest(model=str(mislabelled)))
    expected = pb.Quantization(bits=4, group_size=32, mode="affine")
    assert loaded.model.quantization == expected
    assert stub.GetInfo(pb.GetInfoRequest()).model.quantization == expected
