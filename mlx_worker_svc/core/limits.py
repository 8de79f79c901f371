"""Admission limits: how much work a worker takes on before it says no.

Past a limit the worker answers RESOURCE_EXHAUSTED at once instead of
queueing, so a scheduler (or the fleet) can retry elsewhere and no queue grows
without bound. The gRPC thread pool and the message-size limits are derived
from the same numbers: a saturated worker still has threads for health checks,
and a message can carry every prompt the worker may hold, no more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlx_worker_svc.core.errors import InvalidArgument

DEFAULT_MAX_RUNNING_REQUESTS = 256
DEFAULT_MAX_QUEUED_STEPS = 64
DEFAULT_MAX_STEPS_IN_FLIGHT = 4
# The most any of the three limits below may be set to.
MAX_LIMIT = 1 << 20
# The most KV blocks InitCache takes (past it a call would only exhaust memory).
MAX_NUM_BLOCKS = 1 << 32
# The largest value of a uint64 field (InitCacheRequest.memory_limit_bytes).
UINT64_MAX = (1 << 64) - 1
# Threads beyond the admitted work: health checks, GetInfo, Tokenize, lifecycle.
RESERVED_THREADS = 16
# Used when the model's context length is not known before it loads (hub ids).
FALLBACK_CONTEXT_TOKENS = 32768
# A token id is a varint of at most 5 bytes; 8 covers it and the framing around it.
BYTES_PER_TOKEN = 8
MIN_MESSAGE_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 1 << 30


@dataclass(frozen=True)
class AdmissionLimits:
    """What a worker admits; past either limit a call gets RESOURCE_EXHAUSTED at once."""

    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    """Live requests, Execute's and Generate's together, running or preempted."""
    max_queued_steps: int = DEFAULT_MAX_QUEUED_STEPS
    """Engine jobs waiting for the engine thread: Execute steps, Generate starts, deep checks."""
    max_steps_in_flight: int = DEFAULT_MAX_STEPS_IN_FLIGHT
    """Steps of one ExecuteStream read ahead of their responses (flow control holds more)."""

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_queued_steps", "max_steps_in_flight"):
            value = getattr(self, name)
            if not 1 <= value <= MAX_LIMIT:
                raise InvalidArgument(f"{name} must be in [1, {MAX_LIMIT}], got {value}")

    @property
    def threads(self) -> int:
        """gRPC threads: one per admitted stream or queued step, plus a reserve.

        An ExecuteStream holds one of them (its reader runs on a thread of its own).
        """
        return self.max_running_requests + self.max_queued_steps + RESERVED_THREADS


def message_limit(max_context_tokens: int, limits: AdmissionLimits) -> int:
    """The largest gRPC message, in bytes, for a worker with this context length.

    An Execute step may introduce every request the worker admits, each with a
    full-context prompt; responses are smaller (prompt logprobs come a step's
    tokens at a time). Clamped to [4 MiB, 1 GiB].
    """
    wanted = max_context_tokens * limits.max_running_requests * BYTES_PER_TOKEN
    return min(max(wanted, MIN_MESSAGE_BYTES), MAX_MESSAGE_BYTES)


def context_hint(model: str | None, max_model_len: int = 0) -> int:
    """The context length a model will have, known before loading it.

    `max_model_len` caps it; a local model directory's config.json gives it;
    otherwise (a hub id, an unreadable config) FALLBACK_CONTEXT_TOKENS.
    """
    context = declared_context(model) or FALLBACK_CONTEXT_TOKENS
    return min(context, max_model_len) if max_model_len > 0 else context


def declared_context(model: str | None) -> int:
    """The context length a local model directory's config.json declares (0: none)."""
    if not model:
        return 0
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    for key in ("max_position_embeddings", "max_seq_len"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return 0
