"""The gRPC servicer: one thin method per RPC.

Each method converts the request (convert.py), calls the worker and converts
the answer. Errors are mapped in one place, `status.abort_for`: a WorkerError
keeps its own status code; anything else is a bug and becomes INTERNAL with
its text.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from typing import Any, TypeVar

import grpc

from mlx_worker_svc.core.errors import InvalidArgument, WorkerError
from mlx_worker_svc.core.lifecycle import DeviceArgs
from mlx_worker_svc.core.profiling import ProfileSort
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc import convert, text_convert
from mlx_worker_svc.rpc.status import abort_for, gave_up, settle_stream_end, short_message
from mlx_worker_svc.rpc.step_reader import StepReader
from mlx_worker_svc.worker.worker import Worker

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
_Answer = TypeVar("_Answer", pb.TokenizeResponse, pb.DetokenizeResponse)
_PROFILE_SORT = {
    pb.PROFILE_SORT_UNSPECIFIED: ProfileSort.CUMULATIVE,
    pb.PROFILE_SORT_CUMULATIVE: ProfileSort.CUMULATIVE,
    pb.PROFILE_SORT_OWN: ProfileSort.OWN,
}


def _unary(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(self: WorkerServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except Exception as exc:
            abort_for(context, exc, fn.__name__)

    return wrapper  # type: ignore[return-value]


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """Maps WorkerService RPCs onto a `Worker`."""

    def __init__(
        self,
        worker: Worker,
        on_shutdown: Callable[[float, bool], None],
        *,
        max_message_bytes: int = 0,
    ) -> None:
        self._worker = worker
        self._on_shutdown = on_shutdown
        self._max_message_bytes = max_message_bytes

    @_unary
    def InitDevice(
        self, request: pb.InitDeviceRequest, context: grpc.ServicerContext
    ) -> pb.InitDeviceResponse:
        args = DeviceArgs(
            kind=convert.device_kind(request.device),
            rank=request.rank,
            local_rank=request.local_rank,
            world_size=request.world_size,
            distributed_init_method=request.distributed_init_method,
        )
        info = self._worker.init_device(args, gave_up=gave_up(context))
        return pb.InitDeviceResponse(
            device=convert.device_info(info), state=convert.state(self._worker.state)
        )

    @_unary
    def LoadModel(
        self, request: pb.LoadModelRequest, context: grpc.ServicerContext
    ) -> pb.LoadModelResponse:
        loaded, epoch = self._worker.load_model(
            convert.load_spec(request), gave_up=gave_up(context)
        )
        return pb.LoadModelResponse(
            model=convert.model_info(loaded.info),
            worker_epoch=epoch,
            load_seconds=loaded.load_seconds,
            state=convert.state(self._worker.state),
        )

    @_unary
    def DetermineMemory(
        self, request: pb.DetermineMemoryRequest, context: grpc.ServicerContext
    ) -> pb.DetermineMemoryResponse:
        profile = self._worker.determine_memory(
            request.memory_utilization,
            request.max_num_batched_tokens,
            request.block_size,
            kv_bits=request.kv_bits,
            kv_group_size=request.kv_group_size,
            gave_up=gave_up(context),
        )
        return convert.memory_profile(profile, self._worker.state)

    @_unary
    def InitCache(
        self, request: pb.InitCacheRequest, context: grpc.ServicerContext
    ) -> pb.InitCacheResponse:
        config = self._worker.init_cache(
            request.num_blocks,
            request.block_size,
            prefix_caching=(
                request.enable_prefix_caching if request.HasField("enable_prefix_caching") else None
            ),
            memory_limit_bytes=request.memory_limit_bytes,
            kv_bits=request.kv_bits,
            kv_group_size=request.kv_group_size,
            gave_up=gave_up(context),
        )
        return convert.cache_config(config, self._worker.state)

    @_unary
    def WarmUp(self, request: pb.WarmUpRequest, context: grpc.ServicerContext) -> pb.WarmUpResponse:
        shapes, seconds = self._worker.warm_up(
            list(request.batch_sizes), list(request.prefill_lengths), gave_up=gave_up(context)
        )
        return pb.WarmUpResponse(
            shapes_run=shapes, seconds=seconds, state=convert.state(self._worker.state)
        )

    @_unary
    def Execute(
        self, request: pb.ExecuteRequest, context: grpc.ServicerContext
    ) -> pb.ExecuteResponse:
        received = time.perf_counter_ns()
        plan = convert.step_plan(request)
        result = self._worker.execute(plan, received_ns=received, gave_up=gave_up(context))
        return convert.step_result(result)

    def ExecuteStream(
        self, request_iterator: Iterator[pb.ExecuteStreamRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ExecuteStreamResponse]:
        stream = self._worker.open_step_stream()
        context.add_callback(stream.close)  # cancelled, dropped or done: free what it made
        reader = StepReader(request_iterator, stream, self._worker.limits.max_steps_in_flight)
        try:
            for step in reader:
                if step.error is not None:
                    self._step_failed(step.step_id, step.error)
                yield convert.streamed_step(step)
            settle_stream_end(context)
        except Exception as exc:
            abort_for(context, exc, "ExecuteStream")
        finally:
            reader.stop()
            stream.close()

    def _step_failed(self, step_id: int, error: WorkerError) -> None:
        """A stream's step answered with its error: counted, and logged at DEBUG, as the
        scheduler handles it (the stream's own RPC ends OK). Under KV pressure a refusal
        and the steps sent behind it fail many times a second."""
        code = error.code.name
        self._worker.metrics.stream_step_errors.labels(code).inc()
        extra = {"rpc": "ExecuteStream", "step_id": step_id, "code": code}
        log.debug("stream step failed", extra={**extra, "error": short_message(error.message)})

    @_unary
    def CheckHealth(
        self, request: pb.CheckHealthRequest, context: grpc.ServicerContext
    ) -> pb.CheckHealthResponse:
        return convert.health(self._worker.health(request.deep))

    @_unary
    def Shutdown(
        self, request: pb.ShutdownRequest, context: grpc.ServicerContext
    ) -> pb.ShutdownResponse:
        grace = request.grace_seconds
        if not (math.isfinite(grace) and grace >= 0):
            raise InvalidArgument(
                f"ShutdownRequest.grace_seconds must be a finite number of seconds >= 0 "
                f"(0: the server's default), got {grace}"
            )
        report = self._worker.health(deep=False)
        self._on_shutdown(grace, request.abort)
        return pb.ShutdownResponse(
            state=convert.state(self._worker.state),
            num_in_flight=report.num_running_requests,
        )

    @_unary
    def GetInfo(
        self, request: pb.GetInfoRequest, context: grpc.ServicerContext
    ) -> pb.GetInfoResponse:
        worker = self._worker
        response = pb.GetInfoResponse(
            state=convert.state(worker.state),
            worker_epoch=worker.epoch,
            kv=convert.kv_usage(worker.kv_usage()),
            worker_version=version("mlx-worker-svc"),
            limits=pb.WorkerLimits(
                max_running_requests=worker.limits.max_running_requests,
                max_queued_steps=worker.limits.max_queued_steps,
                max_message_bytes=self._max_message_bytes,
                max_steps_in_flight=worker.limits.max_steps_in_flight,
            ),
        )
        if worker.device is not None:
            response.device.CopyFrom(convert.device_info(worker.device))
        info, chat_template = worker.model_info
        if info is not None:
            response.model.CopyFrom(convert.model_info(info))
            response.chat_template = chat_template
        response.memory.CopyFrom(convert.memory_usage(worker.memory_usage()))
        return response

    @_unary
    def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.ServicerContext
    ) -> pb.TokenizeResponse:
        self._worker.check_state("Tokenize")  # the wrong state first, whatever the fields
        if request.text and request.messages:
            raise InvalidArgument("Tokenize takes text or messages, not both")
        if request.tools_json and not request.messages:
            raise InvalidArgument("tools_json needs messages (a chat to render the tools into)")
        if request.HasField("add_generation_prompt") and not request.messages:
            raise InvalidArgument("add_generation_prompt needs messages (it ends a rendered chat)")
        if request.add_special_tokens and request.messages:
            raise InvalidArgument(
                "add_special_tokens is for text: a chat template writes the special tokens "
                "a chat needs (Generate adds none to a rendered chat either)"
            )
        if request.messages:
            add_prompt = (
                request.add_generation_prompt if request.HasField("add_generation_prompt") else True
            )
            ids, text = self._worker.tokenize_chat(
                text_convert.chat_messages(list(request.messages)), add_prompt, request.tools_json
            )
            answer = pb.TokenizeResponse(token_ids=ids, text=text)
            return self._sendable(answer, "messages", "the prompt's tokens and rendered text")
        ids = self._worker.tokenize_text(request.text, request.add_special_tokens)
        # text is the rendered chat's only
        return self._sendable(pb.TokenizeResponse(token_ids=ids), "text", "the text's tokens")

    @_unary
    def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.ServicerContext
    ) -> pb.DetokenizeResponse:
        text, pieces = self._worker.detokenize(
            list(request.token_ids),
            request.skip_special_tokens,
            token_bytes=request.return_token_bytes,
        )
        answer = pb.DetokenizeResponse(text=text, token_bytes=pieces)
        return self._sendable(answer, "token_ids", "the tokens' text")

    def _sendable(self, answer: _Answer, field: str, what: str) -> _Answer:
        """`answer`, unless it is larger than the worker sends in one message: then
        INVALID_ARGUMENT naming the request's `field` and `what` the answer holds, not
        gRPC's RESOURCE_EXHAUSTED."""
        size, limit = answer.ByteSize(), self._max_message_bytes
        if limit and size > limit:
            raise InvalidArgument(
                f"{field}: {what} take {size} bytes, more than the worker sends in one "
                f"message (GetInfo.limits.max_message_bytes: {limit}): send less"
            )
        return answer

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        try:
            self._worker.check_state("Generate")  # the wrong state first, whatever the fields
            chunks, cancel = self._worker.generate(text_convert.generate_spec(request))
        except Exception as exc:
            abort_for(context, exc, "Generate", request.request_id)
        context.add_callback(cancel)
        try:
            for chunk in chunks:
                yield text_convert.generate_chunk(chunk)
        except Exception as exc:
            abort_for(context, exc, "Generate", request.request_id)

    @_unary
    def Sleep(self, request: pb.SleepRequest, context: grpc.ServicerContext) -> pb.SleepResponse:
        return convert.sleep_report(self._worker.sleep(request.level))

    @_unary
    def WakeUp(self, request: pb.WakeUpRequest, context: grpc.ServicerContext) -> pb.WakeUpResponse:
        woken = self._worker.wake_up()
        return pb.WakeUpResponse(
            state=convert.state(woken.state),
            worker_epoch=woken.worker_epoch,
            wake_seconds=woken.seconds,
            dropped_loras=woken.dropped_loras,
        )

    @_unary
    def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        return pb.ResetPrefixCacheResponse(freed_blocks=self._worker.reset_prefix_cache())

    @_unary
    def AddLora(
        self, request: pb.AddLoraRequest, context: grpc.ServicerContext
    ) -> pb.AddLoraResponse:
        added = self._worker.add_lora(request.name, request.path)
        return pb.AddLoraResponse(
            adapter=text_convert.lora_adapter(added.info),
            already_loaded=added.already_loaded,
            evicted=added.evicted,
            kv=convert.kv_usage(self._worker.kv_usage()),
        )

    @_unary
    def RemoveLora(
        self, request: pb.RemoveLoraRequest, context: grpc.ServicerContext
    ) -> pb.RemoveLoraResponse:
        path = self._worker.remove_lora(request.name)
        return pb.RemoveLoraResponse(path=path, kv=convert.kv_usage(self._worker.kv_usage()))

    @_unary
    def PinLora(
        self, request: pb.PinLoraRequest, context: grpc.ServicerContext
    ) -> pb.PinLoraResponse:
        info = self._worker.pin_lora(request.name, pinned=not request.unpin)
        return pb.PinLoraResponse(adapter=text_convert.lora_adapter(info))

    @_unary
    def ListLoras(
        self, request: pb.ListLorasRequest, context: grpc.ServicerContext
    ) -> pb.ListLorasResponse:
        infos, cap = self._worker.list_loras()
        return pb.ListLorasResponse(
            names=[i.name for i in infos],
            adapters=[text_convert.lora_adapter(i) for i in infos],
            max_loras=cap,
        )

    @_unary
    def StartProfile(
        self, request: pb.StartProfileRequest, context: grpc.ServicerContext
    ) -> pb.StartProfileResponse:
        started = self._worker.start_profile(request.label, request.gpu_capture)
        return pb.StartProfileResponse(
            label=started.label, path=started.path, gpu_capture_path=started.gpu_capture_path
        )

    @_unary
    def StopProfile(
        self, request: pb.StopProfileRequest, context: grpc.ServicerContext
    ) -> pb.StopProfileResponse:
        if request.sort not in _PROFILE_SORT:
            raise InvalidArgument(
                f"StopProfileRequest.sort {request.sort} is not a known ProfileSort "
                "(PROFILE_SORT_CUMULATIVE or PROFILE_SORT_OWN)"
            )
        report = self._worker.stop_profile(request.top_entries, _PROFILE_SORT[request.sort])
        return pb.StopProfileResponse(
            label=report.label,
            path=report.path,
            gpu_capture_path=report.gpu_capture_path,
            seconds=report.seconds,
            entries=[
                pb.ProfileEntry(
                    function=e.function,
                    file=e.file,
                    line=e.line,
                    calls=e.calls,
                    primitive_calls=e.primitive_calls,
                    cumulative_seconds=e.cumulative_seconds,
                    own_seconds=e.own_seconds,
                )
                for e in report.entries
            ],
            num_functions=report.num_functions,
        )
