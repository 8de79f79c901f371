"""Conversion of the text calls' messages: chat messages, Generate's request and chunks.

The counterpart of convert.py for Tokenize's and Generate's messages, and for
the adapter calls (AddLora, PinLora, ListLoras): one function a message.
"""

from __future__ import annotations

from mlx_worker_svc.client.sampling import sampling_params
from mlx_worker_svc.core.adapters import AdapterInfo
from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.generate import ChatMessage, GenerateChunk, GenerateSpec
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc.convert import finish_reason, token_logprobs


def chat_messages(messages: list[pb.ChatMessage]) -> tuple[ChatMessage, ...]:
    return tuple(
        ChatMessage(
            role=m.role,
            content=m.content,
            tool_calls_json=m.tool_calls_json,
            tool_call_id=m.tool_call_id,
            name=m.name,
        )
        for m in messages
    )


def generate_spec(request: pb.GenerateRequest) -> GenerateSpec:
    if request.sampling_params.HasField("prompt_logprobs"):
        raise InvalidArgument(
            "sampling_params.prompt_logprobs: GenerateResponse has no field for them; use Execute"
        )
    return GenerateSpec(
        request_id=request.request_id,
        prompt=request.prompt,
        messages=chat_messages(list(request.messages)),
        prompt_token_ids=tuple(request.prompt_token_ids),
        sampling=sampling_params(request.sampling_params, "sampling_params"),
        skip_special_tokens=(
            request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        ),
        tools_json=request.tools_json,
        model=request.model,
        lora_name=request.lora_name,
    )


def generate_chunk(chunk: GenerateChunk) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=[token_logprobs(i) for i in chunk.logprobs],
        finish_reason=finish_reason(chunk.finish_reason),
        prompt_tokens=chunk.prompt_tokens,
        completion_tokens=chunk.completion_tokens,
        request_id=chunk.request_id,
        num_cached_prompt_tokens=chunk.num_cached_prompt_tokens,
    )


def lora_adapter(info: AdapterInfo) -> pb.LoraAdapter:
    return pb.LoraAdapter(
        name=info.name,
        path=info.path,
        rank=info.rank,
        scale=info.scale,
        bytes=info.nbytes,
        pinned=info.pinned,
        num_requests=info.num_requests,
        num_modules=info.num_modules,
        load_seconds=info.load_seconds,
    )
