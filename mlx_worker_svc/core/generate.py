"""The Generate call's types: a converted request (`GenerateSpec`) and one stream chunk.

The worker schedules a `GenerateSpec` itself (unlike Execute's `StepPlan`) and
streams `GenerateChunk`s back; the servicer converts both to and from protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_worker_svc.core.domain import FinishReason, SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls_json: str = ""  # an assistant's calls: a JSON array (OpenAI's shape)
    tool_call_id: str = ""  # a tool message: the call it answers
    name: str = ""  # a tool message: the function's name


@dataclass(frozen=True)
class GenerateSpec:
    """A Generate call after conversion: exactly one prompt form is set."""

    request_id: str
    prompt: str = ""
    messages: tuple[ChatMessage, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    skip_special_tokens: bool = True
    tools_json: str = ""  # with messages: the tools given to the chat template
    model: str = ""  # empty: the loaded model; else it must name it (GenerateRequest.model)
    lora_name: str = ""  # the adapter it runs with; empty: the base model


@dataclass
class GenerateChunk:
    """One message of a Generate stream."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_cached_prompt_tokens: int = 0
