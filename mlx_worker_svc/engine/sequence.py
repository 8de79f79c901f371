"""Per-request engine state and the validated form of one step.

A `Sequence` is everything the worker remembers about a request between
steps: its tokens (prompt, then sampled or appended ones), how many of them
have KV computed, its sampler, and where its KV lives (a private cache while
its prompt is being prefilled, a row of the decode batch afterwards, nothing
while preempted). A `Work` is a step after validation: applying it cannot fail
for a reason the caller could have avoided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_worker_svc.core.domain import FinishReason, Origin, SamplingParams
from mlx_worker_svc.engine.sampling import RequestSampler
from mlx_worker_svc.engine.structured import Grammar
from mlx_worker_svc.engine.text import TextStream

RequestKey = tuple[Origin, str]


@dataclass
class Sequence:
    key: RequestKey
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    sampler: RequestSampler
    # The tokens that may end it (its sampler's `stops`: stop ids, and EOS unless ignored) and the
    # length (prompt and output) at which max_tokens or the context ends it: a
    # decode step checks each row with one lookup and one comparison, and only
    # asks `finish_reason` when one of them fires.
    stops: frozenset[int]
    length_limit: int
    num_computed: int = 0
    cache: list[Any] | None = None
    preempted: bool = False
    # Prompt tokens whose logprob has been reported (prompt_logprobs).
    prompt_scored: int = 0
    # Not computed yet (new, or resumed from preemption): its first step
    # starts from the longest prefix-cache hit.
    fresh: bool = True
    # Its KV was dropped by a failed step: rebuilt from its tokens (and the
    # prefix cache) before it next computes; num_computed is unchanged.
    kv_lost: bool = False
    # Its structured-outputs grammar (SamplingParams.structured_outputs), if any.
    grammar: Grammar | None = None
    # The LoRA adapter it runs with (engine/lora); empty: the base model.
    adapter: str = ""
    # Its output's detokenizer (NewRequest.detokenize); None: its outputs carry no text.
    text: TextStream | None = None

    @classmethod
    def start(
        cls,
        key: RequestKey,
        prompt: tuple[int, ...],
        params: SamplingParams,
        sampler: RequestSampler,
        *,
        max_context: int,
        adapter: str = "",
    ) -> Sequence:
        """A new request's state (nothing computed yet)."""
        limit = max_context
        if params.max_tokens is not None:
            limit = min(limit, len(prompt) + params.max_tokens)
        seq = cls(key, list(prompt), len(prompt), params, sampler, sampler.stops, limit)
        seq.adapter = adapter
        return seq

    def may_finish(self) -> bool:
        """Whether the last token could end it (False: `finish_reason` is surely None)."""
        return self.tokens[-1] in self.stops or len(self.tokens) >= self.length_limit

    def at_last_token(self) -> bool:
        """Whether the next token sampled is surely its last (a length limit)."""
        return len(self.tokens) + 1 >= self.length_limit

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    def finish_reason(
        self, eos_ids: frozenset[int], max_context: int, *, grammar_complete: bool = False
    ) -> FinishReason | None:
        """The stopping rule the last sampled token fired, if any; a completed grammar
        lets its EOS or stop token end the request even before min_tokens."""
        if self.num_output <= 0:
            return None
        last = self.tokens[-1]
        p = self.params
        if grammar_complete or self.num_output >= p.min_tokens:
            if not p.ignore_eos and last in eos_ids:
                return FinishReason.EOS
            if last in p.stop_token_ids:
                return FinishReason.STOP_TOKEN
        if p.max_tokens is not None and self.num_output >= p.max_tokens:
            return FinishReason.LENGTH
        if len(self.tokens) >= max_context:
            return FinishReason.CONTEXT_LENGTH
        return None


@dataclass(frozen=True)
class NewSequence:
    key: RequestKey
    prompt: tuple[int, ...]
    params: SamplingParams
    # Trailing prompt tokens its grammar consumes first (NewRequest.num_generated_tokens).
    generated: int = 0
    adapter: str = ""  # NewRequest.lora_name
    # NewRequest.detokenize: None, or whether its text leaves special tokens out.
    skip_special_tokens: bool | None = None


@dataclass
class Work:
    """A validated step: removals first, then additions, then computation."""

    finished: list[RequestKey] = field(default_factory=list)
    preempted: list[RequestKey] = field(default_factory=list)
    new: list[NewSequence] = field(default_factory=list)
    appends: list[tuple[RequestKey, tuple[int, ...], bool]] = field(default_factory=list)
    scheduled: dict[RequestKey, int] = field(default_factory=dict)
    # Tokens each sampling request decodes in this step (ExecuteRequest.num_decode_steps).
    decode_steps: int = 1
    # The scheduler's packed allowed-token masks (ExecuteRequest.grammar_bitmask).
    bitmasks: dict[RequestKey, bytes] = field(default_factory=dict)

    def merge(self, other: Work) -> Work:
        """`other`'s requests beside this step's, at this step's decode steps."""
        return Work(
            finished=self.finished + other.finished,
            preempted=self.preempted + other.preempted,
            new=self.new + other.new,
            appends=self.appends + other.appends,
            scheduled={**self.scheduled, **other.scheduled},
            decode_steps=self.decode_steps,
            bitmasks={**self.bitmasks, **other.bitmasks},
        )

    @property
    def touched(self) -> list[RequestKey]:
        """Keys that get an output: new, appended-to or scheduled requests."""
        keys = [n.key for n in self.new] + [a[0] for a in self.appends]
        keys += [k for k in self.scheduled if k not in keys]
        return list(dict.fromkeys(keys))
