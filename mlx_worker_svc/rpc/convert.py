"""Conversion between protobuf messages and domain types.

With servicer.py, the only module that touches generated protobuf code. Each
function maps one message; proto3 `optional` fields become None when unset so
that the domain defaults (vLLM's) apply.
"""

from __future__ import annotations

from typing import cast

from mlx_worker_svc.client.sampling import sampling_params
from mlx_worker_svc.core.domain import (
    CacheConfig,
    CachedRequest,
    DeviceKind,
    FinishReason,
    KVUsage,
    MemoryProfile,
    NewRequest,
    RequestOutput,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.core.reports import (
    DeviceInfo,
    HealthReport,
    LoadSpec,
    MemoryUsage,
    ModelInfo,
    Parallelism,
    SleepReport,
    WorkerState,
)
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.worker.step_stream import StreamedStep

_STATES = {
    state: cast(pb.WorkerState, pb.WorkerState.Value(f"WORKER_STATE_{state.value}"))
    for state in WorkerState
}
_DEVICES_IN = {
    pb.DEVICE_KIND_UNSPECIFIED: DeviceKind.AUTO,
    pb.DEVICE_KIND_CPU: DeviceKind.CPU,
    pb.DEVICE_KIND_GPU: DeviceKind.GPU,
}
_DEVICES_OUT = {DeviceKind.CPU: pb.DEVICE_KIND_CPU, DeviceKind.GPU: pb.DEVICE_KIND_GPU}
_PARALLELISM = {
    mode: cast(pb.Parallelism, pb.Parallelism.Value(f"PARALLELISM_{mode.name}"))
    for mode in Parallelism
}
_FINISH = {
    reason: cast(pb.FinishReason, pb.FinishReason.Value(f"FINISH_REASON_{reason.name}"))
    for reason in FinishReason
}


def state(value: WorkerState) -> pb.WorkerState:
    return _STATES[value]


def device_kind(value: pb.DeviceKind) -> DeviceKind:
    if value not in _DEVICES_IN:
        raise InvalidArgument(f"device {value} is not a known DeviceKind")
    return _DEVICES_IN[value]


def device_info(info: DeviceInfo) -> pb.DeviceInfo:
    return pb.DeviceInfo(
        kind=_DEVICES_OUT.get(info.kind, pb.DEVICE_KIND_UNSPECIFIED),
        name=info.name,
        total_memory_bytes=info.total_memory_bytes,
        recommended_working_set_bytes=info.recommended_working_set_bytes,
        mlx_version=info.mlx_version,
        mlx_lm_version=info.mlx_lm_version,
        platform=info.platform,
        rank=info.rank,
        local_rank=info.local_rank,
        world_size=info.world_size,
        backend=info.backend,
        ranks=[
            pb.GroupRank(
                rank=r.rank,
                host=r.host,
                local_rank=r.local_rank,
                pid=r.pid,
                device_name=r.device_name,
                total_memory_bytes=r.total_memory_bytes,
                recommended_working_set_bytes=r.recommended_working_set_bytes,
                weight_bytes=r.weight_bytes,
            )
            for r in info.ranks
        ],
    )


def load_spec(request: pb.LoadModelRequest) -> LoadSpec:
    return LoadSpec(
        model=request.model,
        adapter_path=request.adapter_path,
        max_model_len=request.max_model_len,
        revision=request.revision,
        trust_remote_code=request.trust_remote_code,
    )


def model_info(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info.model,
        model_path=info.model_path,
        model_type=info.model_type,
        vocab_size=info.vocab_size,
        num_layers=info.num_layers,
        num_attention_heads=info.num_attention_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        hidden_size=info.hidden_size,
        max_context_length=info.max_context_length,
        eos_token_ids=list(info.eos_token_ids),
        bos_token_id=info.bos_token_id,
        quantization=pb.Quantization(
            bits=info.quantization.bits,
            group_size=info.quantization.group_size,
            mode=info.quantization.mode,
        ),
        weight_bytes=info.weight_bytes,
        dtype=info.dtype,
        has_chat_template=info.has_chat_template,
        adapter_path=info.adapter_path,
        parallelism=_PARALLELISM[info.parallelism],
    )


def memory_profile(profile: MemoryProfile, worker_state: WorkerState) -> pb.DetermineMemoryResponse:
    return pb.DetermineMemoryResponse(
        total_memory_bytes=profile.total_memory_bytes,
        recommended_working_set_bytes=profile.recommended_working_set_bytes,
        weight_bytes=profile.weight_bytes,
        activation_peak_bytes=profile.activation_peak_bytes,
        available_kv_bytes=profile.available_kv_bytes,
        bytes_per_block=profile.bytes_per_block,
        block_size=profile.block_size,
        suggested_num_blocks=profile.suggested_num_blocks,
        state=state(worker_state),
        kv_bits=profile.kv.bits,
        adapter_bytes=profile.adapter_bytes,
        kv_group_size=profile.kv.group_size,
    )


def kv_usage(usage: KVUsage) -> pb.KVUsage:
    return pb.KVUsage(
        num_blocks=usage.num_blocks,
        used_blocks=usage.used_blocks,
        free_blocks=usage.free_blocks,
        block_size=usage.block_size,
        prefix_cache_blocks=usage.prefix_cache_blocks,
        kv_bits=usage.kv.bits,
        kv_group_size=usage.kv.group_size,
    )


def memory_usage(usage: MemoryUsage) -> pb.MemoryUsage:
    return pb.MemoryUsage(
        active_bytes=usage.active_bytes,
        peak_bytes=usage.peak_bytes,
        cache_bytes=usage.cache_bytes,
        limit_bytes=usage.limit_bytes,
    )


def cache_config(config: CacheConfig, worker_state: WorkerState) -> pb.InitCacheResponse:
    return pb.InitCacheResponse(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        max_kv_tokens=config.num_blocks * config.block_size,
        state=state(worker_state),
        prefix_caching=config.prefix_caching,
        memory_limit_bytes=config.memory_limit_bytes,
        kv_bits=config.kv.bits,
        kv_group_size=config.kv.group_size,
    )


def sleep_report(report: SleepReport) -> pb.SleepResponse:
    return pb.SleepResponse(
        state=state(report.state),
        level=report.level,
        num_aborted=report.num_aborted,
        freed_bytes=report.freed_bytes,
        worker_epoch=report.worker_epoch,
    )


def step_plan(request: pb.ExecuteRequest) -> StepPlan:
    new = tuple(
        NewRequest(
            req_id=r.req_id,
            prompt_token_ids=tuple(r.prompt_token_ids),
            sampling=sampling_params(
                r.sampling_params, f"new_requests[{i}] (req_id {clip(r.req_id)!r}).sampling_params"
            ),
            num_generated_tokens=r.num_generated_tokens,
            lora_name=r.lora_name,
            detokenize=r.detokenize,
            skip_special_tokens=not r.HasField("skip_special_tokens") or r.skip_special_tokens,
        )
        for i, r in enumerate(request.new_requests)
    )
    # Per request per step: positional, and no tuple built for an empty list.
    cached = tuple(
        [
            CachedRequest(
                r.req_id,
                r.num_computed_tokens,
                tuple(r.new_token_ids) if r.new_token_ids else (),
                r.resumed_from_preemption,
            )
            for r in request.cached_requests
        ]
    )
    return StepPlan(
        step_id=request.step_id,
        worker_epoch=request.worker_epoch,
        new_requests=new,
        cached_requests=cached,
        num_scheduled_tokens=dict(request.num_scheduled_tokens),
        finished_req_ids=tuple(request.finished_req_ids),
        preempted_req_ids=tuple(request.preempted_req_ids),
        num_decode_steps=request.num_decode_steps,
        grammar_bitmask=dict(request.grammar_bitmask),
    )


def token_logprobs(info: TokenLogprobs) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(
        token_id=info.token_id,
        logprob=info.logprob,
        rank=info.rank,
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in info.top],
    )


def finish_reason(reason: FinishReason | None) -> pb.FinishReason:
    return _FINISH[reason] if reason is not None else pb.FINISH_REASON_UNSPECIFIED


def fill_request_output(message: pb.RequestOutput, output: RequestOutput) -> None:
    """Writes `output` into `message` (a repeated field's new entry)."""
    # One message per request per step: fields are set one by one, in place,
    # and those left at their defaults not at all (the wire bytes are the same).
    message.req_id = output.req_id
    message.sampled_token_ids.extend(output.sampled_token_ids)
    message.num_computed_tokens = output.num_computed_tokens
    if output.logprobs:
        message.logprobs.extend(token_logprobs(i) for i in output.logprobs)
    if output.prompt_logprobs:
        message.prompt_logprobs.extend(token_logprobs(i) for i in output.prompt_logprobs)
    if output.num_cached_prompt_tokens:
        message.num_cached_prompt_tokens = output.num_cached_prompt_tokens
    if output.finish_reason is not None:
        message.finish_reason = _FINISH[output.finish_reason]
    if output.text:
        message.text = output.text


def step_result(
    result: StepResult, message: pb.ExecuteResponse | None = None
) -> pb.ExecuteResponse:
    """`result` as a message, or written into `message` (ExecuteStreamResponse.result)."""
    if message is None:
        message = pb.ExecuteResponse()
    message.step_id = result.step_id
    message.worker_epoch = result.worker_epoch
    outputs = message.outputs
    for output in result.outputs:  # built in place: no message copied
        fill_request_output(outputs.add(), output)
    t, timings = result.timings, message.timings
    timings.SetInParent()  # present even when every figure is 0, as before
    timings.total_ns = t.total_ns
    timings.forward_ns = t.forward_ns
    timings.num_tokens = t.num_tokens
    timings.decode_batch_size = t.decode_batch_size
    return message


def streamed_step(step: StreamedStep) -> pb.ExecuteStreamResponse:
    response = pb.ExecuteStreamResponse(
        step_id=step.step_id, already_finished_req_ids=step.already_finished
    )
    if step.result is not None:
        step_result(step.result, response.result)
    elif step.error is not None:
        response.error.code = step.error.code.value
        response.error.message = step.error.message
    return response


def health(report: HealthReport) -> pb.CheckHealthResponse:
    return pb.CheckHealthResponse(
        state=state(report.state),
        healthy=report.healthy,
        num_running_requests=report.num_running_requests,
        num_preempted_requests=report.num_preempted_requests,
        kv=kv_usage(report.kv),
        last_error=report.last_error,
        worker_epoch=report.worker_epoch,
        deep_check_ns=report.deep_check_ns,
        uptime_seconds=report.uptime_seconds,
        memory=memory_usage(report.memory),
        bringing_up=report.bringing_up,
    )
