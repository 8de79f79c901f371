"""An OpenAI request's sampling fields into the workers' SamplingParams, each checked.

Ranges are OpenAI's where it has them (temperature 0 to 2, penalties -2 to 2,
logit_bias -100 to 100, 16 stop strings where OpenAI takes 4), vLLM's for its
extras (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids); a value outside is a 400 naming the field. `apply_top_p`
is shared with Anthropic's route.
"""

from __future__ import annotations

from typing import Any

from mlx_worker_svc.gateway.body import Fields, json_type
from mlx_worker_svc.gateway.errors import invalid
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

MAX_STOP = 16  # OpenAI allows 4; vLLM any: Continue sends its ~12 stop words
UINT32 = 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite value of a proto float


def openai_sampling(kind: str, fields: Fields) -> pb.SamplingParams:
    """The SamplingParams of an OpenAI request (`kind` "chat" or "completion")."""
    params = pb.SamplingParams()
    max_tokens = fields.integer("max_tokens", 1, UINT32)
    if kind == "chat":
        # The newer name wins; chat has no default (up to the context length).
        max_tokens = fields.integer("max_completion_tokens", 1, UINT32) or max_tokens
    elif max_tokens is None:
        max_tokens = 16  # OpenAI's default for legacy completions
    if max_tokens is not None:
        params.max_tokens = max_tokens
    # OpenAI's default temperature is 1, which is also the workers'.
    temperature = fields.number("temperature", 0.0, 2.0)
    if temperature is not None:
        params.temperature = temperature
    top_p = fields.number("top_p", 0.0, 1.0)
    params.presence_penalty = fields.number("presence_penalty", -2.0, 2.0) or 0.0
    params.frequency_penalty = fields.number("frequency_penalty", -2.0, 2.0) or 0.0
    seed = fields.integer("seed", -(2**63), 2**64 - 1)
    if seed is not None:
        params.seed = seed % 2**64  # OpenAI seeds are signed; the workers' unsigned
    params.stop.extend(_stop(fields.get("stop")))
    params.logit_bias.update(_logit_bias(fields.get("logit_bias")))
    # vLLM's extras.
    params.top_k = fields.integer("top_k", -1, UINT32 >> 1) or 0
    apply_top_p(params, top_p)
    params.min_p = fields.number("min_p", 0.0, 1.0) or 0.0
    penalty = fields.number("repetition_penalty", 0.0, FLOAT32_MAX)
    if penalty is not None:
        if penalty == 0:
            raise invalid("repetition_penalty", "must be greater than 0")
        params.repetition_penalty = penalty
    params.min_tokens = fields.integer("min_tokens", 0, UINT32) or 0
    if params.HasField("max_tokens") and params.min_tokens > params.max_tokens:
        raise invalid(
            "min_tokens",
            f"{params.min_tokens} must not exceed max_tokens ({params.max_tokens})",
        )
    params.ignore_eos = fields.boolean("ignore_eos")
    stop_ids = fields.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= UINT32 for t in stop_ids
    ):
        raise invalid("stop_token_ids", "expected an array of token ids")
    params.stop_token_ids.extend(stop_ids)
    return params


def apply_top_p(params: pb.SamplingParams, top_p: float | None) -> None:
    """Sets `top_p`, after `params.top_k`: 0, which OpenAI and Anthropic take, keeps only
    the most likely token (the smallest nucleus), which is top_k 1 to the workers (whose
    top_p must be above 0)."""
    if top_p == 0:
        params.top_k = 1
    elif top_p is not None:
        params.top_p = top_p


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("stop", "expected a non-empty string or an array of them")
    if len(stops) > MAX_STOP:
        raise invalid("stop", f"at most {MAX_STOP} stop sequences, got {len(stops)}")
    return stops


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("logit_bias", f"expected an object, got {json_type(value)}")
    bias: dict[int, float] = {}
    keys: dict[int, str] = {}
    for key in value:
        # ASCII digits only: str.isdigit() also takes '²' (no int) and '٣' (int 3).
        if not (key.isascii() and key.isdigit() and int(key) <= UINT32):
            raise invalid("logit_bias", f"{key!r} is not a token id")
        number = Fields(value, "logit_bias").number(key, -100.0, 100.0)
        if number is None:
            raise invalid("logit_bias", f"no bias given for token {key}")
        token = int(key)
        if token in keys:  # '045' and '45': one bias would silently win
            raise invalid("logit_bias", f"{keys[token]!r} and {key!r} name one token, {token}")
        keys[token], bias[token] = key, number
    return bias
