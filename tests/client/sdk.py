"""What both client test modules send: the prompt, a greedy Generate request, fast retries."""

from __future__ import annotations

from typing import Any

from driver import greedy

from mlx_worker_svc.client.worker import ClientConfig
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

PROMPT = [1, 2, 3, 4, 5]
MAX_TOKENS = 8


def fast_config(**fields: Any) -> ClientConfig:
    """A config whose retries wait milliseconds, not seconds."""
    return ClientConfig(backoff=0.01, max_backoff=0.02, **fields)


def generate_request(max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=PROMPT, sampling_params=greedy(max_tokens, ignore_eos=True)
    )
