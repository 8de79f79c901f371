"""The engine's contract: a step in, its outputs out, and the KV it runs on.

These dataclasses cross layer boundaries: the servicer converts protobuf messages
into them (rpc/convert.py), the worker and the engine work on them, and nothing here
knows about protobuf or MLX. Range checks that need no model (sampling bounds) live
here too, so every caller gets the same messages naming the offending field. The
worker's own reports are in `reports.py`, the Generate call's types in `generate.py`,
structured-output specs in `structured_outputs.py`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.structured_outputs import StructuredOutputs

MAX_LOGPROBS = 20
# Most decode steps one Execute call may run (ExecuteRequest.num_decode_steps).
MAX_DECODE_STEPS = 64
# A temperature below this samples greedily (vLLM's _SAMPLING_EPS): 1/T would overflow.
GREEDY_BELOW = 1e-5


class DeviceKind(enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    GPU = "gpu"


class FinishReason(enum.Enum):
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"
    CONTEXT_LENGTH = "context_length"
    ABORTED = "aborted"
    GRAMMAR_COMPLETE = "grammar_complete"  # the structured-output grammar allows no more

    @property
    def by_stop_token(self) -> bool:
        """Its last token is the stop token that fired (EOS or a stop_token_ids one): its
        text is left out of the output's, as vLLM and mlx-lm leave it out."""
        return self in (FinishReason.EOS, FinishReason.STOP_TOKEN)


class Origin(enum.Enum):
    """Who owns a request: a remote scheduler (Execute) or the worker (Generate).

    The two id spaces are separate: an Execute req_id "a" and a Generate
    request "a" are different requests.
    """

    EXECUTE = "execute"
    GENERATE = "generate"

    # Request keys (origin, req_id) are hashed many times per request per step;
    # Enum's own __hash__ is Python code, the identity hash is C (members are
    # singletons, and Enum equality is identity).
    __hash__ = object.__hash__


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    min_tokens: int = 0
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None

    def validate(self, where: str) -> None:
        """Raises InvalidArgument naming `where.<field>` for an out-of-range value."""

        def bad(name: str, why: str) -> InvalidArgument:
            return InvalidArgument(f"{where}.{name} {why}")

        def finite(name: str, value: float) -> None:
            if not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value}")

        finite("temperature", self.temperature)
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        finite("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise bad("top_k", f"must be -1, 0 (off) or a positive count, got {self.top_k}")
        finite("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            finite(name, value)
            if not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value}")
        for token, bias in self.logit_bias.items():
            if not math.isfinite(bias):
                raise bad(f"logit_bias[{token}]", f"must be a finite number, got {bias}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be >= 1 when set, got {self.max_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens",
                f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate(f"{where}.structured_outputs")
            if self.ignore_eos:
                raise bad(
                    "ignore_eos",
                    "cannot be combined with structured_outputs: the grammar decides "
                    "where the output ends",
                )

    def stop_ids(self, eos_ids: Iterable[int]) -> frozenset[int]:
        """The tokens that end a request of these params: its stop ids, and EOS unless
        ignored (what min_tokens holds back, and what the engine's stop check looks for)."""
        return frozenset(self.stop_token_ids) | frozenset(() if self.ignore_eos else eos_ids)

    @property
    def greedy(self) -> bool:
        """Greedy sampling: temperature 0, or below vLLM's epsilon (1e-5) as vLLM has it."""
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class NewRequest:
    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    # The last tokens of the prompt that are output generated elsewhere (a continuation).
    num_generated_tokens: int = 0
    lora_name: str = ""  # the adapter it runs with; empty: the base model
    # Its outputs carry their text (RequestOutput.text), special tokens left out or not.
    detokenize: bool = False
    skip_special_tokens: bool = True


class CachedRequest(NamedTuple):
    """A running request in a step (a tuple: one is built per request per step)."""

    req_id: str
    num_computed_tokens: int
    new_token_ids: tuple[int, ...] = ()
    resumed_from_preemption: bool = False


@dataclass(frozen=True)
class StepPlan:
    """One scheduler step, as the scheduler sent it (see DESIGN.md, Execute)."""

    step_id: int
    worker_epoch: int
    new_requests: tuple[NewRequest, ...] = ()
    cached_requests: tuple[CachedRequest, ...] = ()
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: tuple[str, ...] = ()
    preempted_req_ids: tuple[str, ...] = ()
    # Decode steps in this call (0 and 1: one); see ExecuteRequest.num_decode_steps.
    num_decode_steps: int = 1
    # req_id -> packed allowed-token mask of its next token; see ExecuteRequest.grammar_bitmask.
    grammar_bitmask: dict[str, bytes] = field(default_factory=dict)
    # Where each cached_requests entry was in the message sent, for errors, when some were
    # left out (ExecuteStream's already finished requests); empty: where it is.
    cached_positions: tuple[int, ...] = ()

    def cached_position(self, i: int) -> int:
        """The index the scheduler sent `cached_requests[i]` at."""
        return self.cached_positions[i] if self.cached_positions else i


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    req_id: str
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    text: str = ""  # what its output tokens of this step add to its text (NewRequest.detokenize)
    # Set as it finishes, for its log line: the tokens of its prompt and of its output.
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def text_token_ids(self) -> list[int]:
        """The sampled tokens whose text the output carries: all but a stop token that
        ended the request (`FinishReason.by_stop_token`)."""
        reason = self.finish_reason
        stopped = reason is not None and reason.by_stop_token
        return self.sampled_token_ids[:-1] if stopped else self.sampled_token_ids


@dataclass(frozen=True)
class StepTimings:
    total_ns: int = 0
    forward_ns: int = 0
    num_tokens: int = 0
    decode_batch_size: int = 0


@dataclass
class StepResult:
    step_id: int
    worker_epoch: int
    outputs: list[RequestOutput]
    timings: StepTimings


@dataclass(frozen=True)
class KVFormat:
    """How KV is stored: `bits` 0 is the model's float dtype, else mlx-lm's quantized KV.

    `group_size` is the quantization group along head_dim (0 while `bits` is 0).
    """

    bits: int = 0
    group_size: int = 0

    @property
    def quantized(self) -> bool:
        return self.bits != 0

    def describe(self) -> str:
        return f"{self.bits}-bit, group {self.group_size}" if self.bits else "float"


FLOAT_KV = KVFormat()  # KV in the model's own dtype (kv_bits 0)


@dataclass(frozen=True)
class MemoryProfile:
    total_memory_bytes: int
    recommended_working_set_bytes: int
    weight_bytes: int
    activation_peak_bytes: int
    available_kv_bytes: int
    bytes_per_block: int
    block_size: int
    suggested_num_blocks: int
    memory_utilization: float = 0.9
    # The activation model fitted from profiling forwards of T, T/2 and T/4
    # tokens: a forward of c tokens over a context of L tokens peaks at about
    # fixed + per_token * c + per_token_pair * c * L above what it holds.
    activation_bytes_fixed: float = 0.0
    activation_bytes_per_token: float = 0.0
    activation_bytes_per_token_pair: float = 0.0
    kv: KVFormat = FLOAT_KV  # the KV format bytes_per_block was measured in
    adapter_bytes: int = 0  # LoRA adapters resident when measured (within weight_bytes)


@dataclass(frozen=True)
class KVUsage:
    num_blocks: int = 0
    used_blocks: int = 0
    block_size: int = 0
    # Evictable blocks held by the prefix cache (not in used_blocks).
    prefix_cache_blocks: int = 0
    kv: KVFormat = FLOAT_KV  # the format InitCache set

    @property
    def free_blocks(self) -> int:
        return max(self.num_blocks - self.used_blocks, 0)


@dataclass(frozen=True)
class CacheConfig:
    """What InitCache set: the KV budget, the prefix cache, the memory limit."""

    num_blocks: int
    block_size: int
    prefix_caching: bool
    memory_limit_bytes: int
    kv: KVFormat = FLOAT_KV  # float, or quantized KV (InitCacheRequest.kv_bits)
