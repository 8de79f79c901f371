"""Error messages say what was wrong, with the caller's values, and quote client strings short."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from driver import code_of, details_of, greedy
from lora_adapters import make_adapter

from mlx_worker_svc.core.log_format import JsonFormatter, TextFormatter
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _refused(call: Callable[[], Any], code: grpc.StatusCode = INVALID) -> str:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not isinstance(result, pb.InitDeviceResponse | pb.LoadModelResponse):
            list(result)  # a stream: the error comes with its first message
    assert code_of(info.value) == code, details_of(info.value)
    return details_of(info.value)


def _step(stub: Stub, epoch: int, **fields: Any) -> pb.ExecuteResponse:
    response: pb.ExecuteResponse = stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, **fields))
    return response


def _new(req_id: str, prompt: list[int] | None = None) -> pb.NewRequest:
    return pb.NewRequest(
        req_id=req_id, prompt_token_ids=prompt or [1, 2, 3], sampling_params=greedy(8)
    )


def test_init_device_names_the_arguments_that_differ(stub: Stub) -> None:
    # The default device (UNSPECIFIED) is the one it picked: the same call, filled in.
    kind = stub.InitDevice(pb.InitDeviceRequest()).device.kind
    assert kind in (pb.DEVICE_KIND_CPU, pb.DEVICE_KIND_GPU)
    assert stub.InitDevice(pb.InitDeviceRequest(device=kind)).device.kind == kind
    assert stub.InitDevice(pb.InitDeviceRequest()).device.kind == kind
    other = pb.DEVICE_KIND_GPU if kind == pb.DEVICE_KIND_CPU else pb.DEVICE_KIND_CPU
    message = _refused(
        lambda: stub.InitDevice(pb.InitDeviceRequest(device=other, distributed_init_method="ring")),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    names = (pb.DeviceKind.Name(other), pb.DeviceKind.Name(kind))
    assert "device {} (initialised with {})".format(*names) in message
    assert "distributed_init_method 'ring' (initialised with '')" in message
    message = _refused(
        lambda: stub.InitDevice(pb.InitDeviceRequest(distributed_init_method="ring")),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert "device" not in message.split("asks for", 1)[1].split(";")[0]


def test_load_model_messages_name_the_field(stub: Stub, tmp_path: Path) -> None:
    stub.InitDevice(pb.InitDeviceRequest())
    message = _refused(lambda: stub.LoadModel(pb.LoadModelRequest()))
    assert message == "LoadModel.model is required: a local model directory or a hub id"


def test_adapter_paths_that_are_no_adapter_directory(
    stub: Stub, tiny_dir: Path, tmp_path: Path
) -> None:
    stub.InitDevice(pb.InitDeviceRequest())
    model = str(tiny_dir)
    file = tmp_path / "adapters.safetensors"
    file.write_bytes(b"")
    message = _refused(
        lambda: stub.LoadModel(pb.LoadModelRequest(model=model, adapter_path=str(file)))
    )
    assert f"LoadModel.adapter_path '{file}' is a file; give the adapter directory" in message
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "adapters.safetensors").write_bytes(b"")
    message = _refused(
        lambda: stub.LoadModel(pb.LoadModelRequest(model=model, adapter_path=str(bare)))
    )
    assert f"LoadModel.adapter_path '{bare}' has no adapter_config.json" in message
    assert "not an mlx-lm adapter directory" in message
    missing = tmp_path / "nowhere"
    message = _refused(
        lambda: stub.LoadModel(pb.LoadModelRequest(model=model, adapter_path=str(missing))),
        grpc.StatusCode.NOT_FOUND,
    )
    assert message == f"LoadModel.adapter_path '{missing}' does not exist"
    # An adapter for layers the model does not have (phi3's fused qkv_proj, say): mlx-lm
    # loads it and changes nothing; AddLora refuses it, and so does LoadModel.
    elsewhere = make_adapter(tmp_path / "elsewhere", tiny_dir, seed=1, keys=("self_attn.qkv_proj",))
    message = _refused(
        lambda: stub.LoadModel(pb.LoadModelRequest(model=model, adapter_path=str(elsewhere)))
    )
    assert message.startswith(f"LoadModel.adapter_path '{elsewhere}' targets no layer of the")
    assert stub.CheckHealth(pb.CheckHealthRequest()).state == pb.WORKER_STATE_DEVICE_READY


def test_a_preempted_request_is_not_called_running(tiny_stub: Stub) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    _step(tiny_stub, epoch, new_requests=[_new("p")], num_scheduled_tokens={"p": 3})
    _step(tiny_stub, epoch, preempted_req_ids=["p"])
    again = {"new_requests": [_new("p")], "num_scheduled_tokens": {"p": 3}}
    message = _refused(lambda: _step(tiny_stub, epoch, **again))
    assert "req_id is a preempted request the worker still holds" in message
    assert "resumed_from_preemption" in message and "already running" not in message


def test_the_running_limit_message_gives_the_real_numbers(tiny_stub: Stub) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    two = [_new("a"), _new("b")]
    _step(tiny_stub, epoch, new_requests=two, num_scheduled_tokens={"a": 3, "b": 3})
    many = [_new(f"n{i}") for i in range(300)]
    message = _refused(
        lambda: _step(tiny_stub, epoch, step_id=7, new_requests=many, finished_req_ids=["a"]),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    assert message.startswith(
        "Execute step 7 would start 300 new requests beside 2 live, 1 leaving: 301 in all, "
        "over the limit of 256 live requests (--max-running-requests); send at most 255 now"
    )


def test_the_stale_epoch_message_after_a_sleep_says_it_slept(tiny_stub: Stub) -> None:
    old = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    tiny_stub.Sleep(pb.SleepRequest(level=1))
    epoch = tiny_stub.WakeUp(pb.WakeUpRequest()).worker_epoch
    message = _refused(lambda: _step(tiny_stub, old), grpc.StatusCode.FAILED_PRECONDITION)
    assert f"worker_epoch {old} is stale; the worker's epoch is {epoch}" in message
    assert "since that epoch the worker slept (Sleep level 1" in message
    assert "restarted" not in message
    # Later changes do not hide what ended that epoch: the first one since is named.
    tiny_stub.Sleep(pb.SleepRequest(level=2))
    tiny_stub.WakeUp(pb.WakeUpRequest())
    message = _refused(lambda: _step(tiny_stub, old), grpc.StatusCode.FAILED_PRECONDITION)
    assert "since that epoch the worker slept (Sleep level 1" in message, message


def test_an_epoch_a_javascript_number_rounded_is_named_as_such(tiny_stub: Stub) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    assert epoch > 2**53  # time.time_ns(): doubles step by 256 here
    rounded = int(float(epoch))  # what JSON.parse gives a JavaScript client
    if rounded != epoch:  # (1 in 256 epochs is a double already)
        message = _refused(lambda: _step(tiny_stub, rounded), grpc.StatusCode.FAILED_PRECONDITION)
        assert f"worker_epoch {rounded} is stale; the worker's epoch is {epoch}" in message
        assert "rounded to a double, as a JavaScript Number rounds it: send uint64s as" in message
    # One off, which no double rounding gives, is only stale: no JavaScript story.
    off = next(n for n in (epoch + 1, epoch - 1) if n != rounded)
    message = _refused(lambda: _step(tiny_stub, off), grpc.StatusCode.FAILED_PRECONDITION)
    assert f"worker_epoch {off} is stale" in message and "JavaScript" not in message


def test_a_megabyte_request_id_is_quoted_short(
    tiny_stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    huge = "r" * (1 << 20)
    caplog.set_level(logging.DEBUG)
    chunks = list(
        tiny_stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=[1, 2, 3], request_id=huge, sampling_params=greedy(2)
            )
        )
    )
    assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    bad = pb.NewRequest(req_id=huge, prompt_token_ids=[])
    message = _refused(lambda: _step(tiny_stub, epoch, new_requests=[bad]))
    assert message.startswith(f"new_requests[0] (req_id '{'r' * 200}...[1048576 chars]')")
    assert len(message) < 500
    lines = [f.format(r) for r in caplog.records for f in (TextFormatter(), JsonFormatter())]
    assert sum("...[1048576 chars]" in line for line in lines) >= 4  # admitted, finished, refused
    assert max(len(line) for line in lines) < 3000


def test_log_lines_leave_out_uvicorns_coloured_copy_of_the_message() -> None:
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, "", 0, "Started server process [%d]", (7,), None
    )
    record.color_message = "Started server process [\x1b[36m%d\x1b[0m]"  # as uvicorn adds it
    record.req_id = "r1"
    for formatter in (TextFormatter(), JsonFormatter()):
        line = formatter.format(record)
        assert "\x1b" not in line and "\\u001b" not in line and "color_message" not in line
        assert "Started server process [7]" in line and "r1" in line
