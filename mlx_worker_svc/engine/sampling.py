"""Per-request sampling: logits processors, seeded sampling and logprobs.

Each request owns a `RequestSampler` built once from its SamplingParams.
Processing follows vLLM v1's sampler: the logits in float32, then min_tokens
masking, logit_bias, penalties (repetition over prompt + output, presence and
frequency over output), then temperature, min_p, top_k and top_p on the
scaled distribution (below vLLM's 1e-5, a temperature is greedy). Logprobs are
reported from the raw model logits (vLLM's default), so they do not depend on
the sampling knobs. A request with a seed draws from its own PRNG key, split
once per sampled token, so its tokens do not depend on its batch neighbours.

A step's tokens leave here as a lazy `Choice`, so that the next forward can be
queued on them before the host reads them (batch.DecodeBatch.speculate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlx_worker_svc.core.domain import SamplingParams, TokenLogprobs

_FLOAT32_MAX = float(mx.finfo(mx.float32).max)


class RequestSampler:
    """Turns one request's logits row into its next token."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        eos_ids: frozenset[int],
        vocab_size: int,
        sampled_before: int = 0,
        hold_stops: bool = True,
    ):
        """`sampled_before`: tokens a continued request sampled elsewhere
        (NewRequest.num_generated_tokens); a seeded key goes on from there, and
        the presence and frequency penalties count them as output.
        `hold_stops=False`: min_tokens does not hold the stop tokens back here,
        the step's grammar mask does (grammar_mask.step_mask)."""
        self.params = params
        self.vocab_size = vocab_size
        self._carried = sampled_before  # output tokens at the prompt's end
        self._key = mx.random.key(params.seed) if params.seed is not None else None
        if self._key is not None and not params.greedy:
            for n in range(sampled_before):  # one split a token, as `choose` takes
                self._key = mx.random.split(self._key)[0]
                if n % 256 == 255:
                    mx.eval(self._key)
        self.stops = params.stop_ids(eos_ids)
        self._min_tokens_mask = (
            mx.array(sorted(self.stops), dtype=mx.uint32)
            if self.stops and params.min_tokens and hold_stops
            else None
        )
        self._bias_ids = self._bias_values = None
        if params.logit_bias:
            ids = sorted(params.logit_bias)
            self._bias_ids = mx.array(ids, dtype=mx.uint32)
            self._bias_values = mx.array([params.logit_bias[i] for i in ids], dtype=mx.float32)
        self.uses_history = (
            params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self.trivial = (
            params.greedy
            and not self.uses_history
            and self._bias_ids is None
            and self._min_tokens_mask is None
            and params.logprobs is None
        )

    def rng_state(self) -> mx.array | None:
        """The seeded PRNG key (None for unseeded), to restore after a failed step."""
        return self._key

    def restore_rng(self, key: mx.array | None) -> None:
        self._key = key

    def process(self, logits: mx.array, tokens: Sequence[int], prompt_len: int) -> mx.array:
        """Applies the logits processors to one row of shape [V]."""
        p = self.params
        num_output = len(tokens) - prompt_len
        # In float32, as vLLM: a small bias or penalty would round away in bfloat16.
        logits = logits.astype(mx.float32)
        if self._min_tokens_mask is not None and num_output < p.min_tokens:
            logits = logits.at[self._min_tokens_mask].add(-float("inf"))
        if self._bias_ids is not None and self._bias_values is not None:
            logits = logits.at[self._bias_ids].add(self._bias_values)
        if p.repetition_penalty != 1.0 and tokens:
            seen = mx.array(sorted(set(tokens)), dtype=mx.uint32)
            picked = logits[seen]
            penalised = mx.where(
                picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty
            )
            # A penalty below 1 may push a huge logit past float32: +inf would make every
            # later step's inf - inf NaN (token 0 sampled); the largest float keeps its rank.
            logits[seen] = mx.minimum(penalised, _FLOAT32_MAX)
        output_start = prompt_len - self._carried
        if (p.presence_penalty or p.frequency_penalty) and len(tokens) > output_start:
            output = mx.array(list(tokens[output_start:]), dtype=mx.uint32)
            counts = mx.zeros((self.vocab_size,), dtype=mx.float32).at[output].add(1.0)
            penalty = p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            logits = logits - penalty[: logits.shape[-1]]
        return logits

    def choose(self, logits: mx.array) -> mx.array:
        """Samples a token id (0-d array) from a processed row of shape [V]."""
        p = self.params
        if p.greedy:
            return greedy(logits)
        # The largest logit is taken out before scaling, so that neither a tiny
        # temperature nor a huge bias overflows float32 (inf - inf is NaN).
        logits = logits.astype(mx.float32)
        scaled = (logits - logits.max(axis=-1, keepdims=True)) * (1.0 / p.temperature)
        logprobs = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        if p.min_p > 0.0:  # vLLM v1 applies min_p before top_k and top_p
            logprobs = apply_min_p(logprobs, p.min_p)
        if 0 < p.top_k < self.vocab_size:
            logprobs = apply_top_k(logprobs, p.top_k)
        if p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if self._key is None:
            return mx.random.categorical(logprobs)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs, key=sub)


def greedy(logits: mx.array) -> mx.array:
    """The greedy token of each row, chosen exactly as mlx-lm chooses it.

    mlx-lm takes the argmax of the log-probabilities (logits - logsumexp) in
    the logits' dtype. In bf16 or fp16 that subtraction rounds near-equal
    logits to equal values, and the argmax then picks the lowest id, which an
    argmax of the raw logits does not always pick: the same rule keeps greedy
    parity in every dtype. A single row is normalised over all its axes, as
    `generate_step` does; several over the last, as `BatchGenerator` does.
    """
    if logits.ndim == 2 and logits.shape[0] == 1:
        return mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1)
    return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)


class Choice:
    """One step's tokens, lazy: `tokens` [B] is what a queued next forward runs on.

    `unsure` ([B] bool, or None) marks the rows whose `tokens` entry is a raw
    argmax that mlx-lm's greedy rule (`greedy`) might not pick; `read` then
    makes every row's choice by that rule from `logits`.
    """

    __slots__ = ("logits", "tokens", "unsure")

    def __init__(
        self, tokens: mx.array, unsure: mx.array | None = None, logits: mx.array | None = None
    ) -> None:
        self.tokens = tokens
        self.unsure = unsure
        self.logits = logits

    def arrays(self) -> list[mx.array]:
        """What to launch (`mx.async_eval`) for `read` to wait on this step only."""
        return [self.tokens] if self.unsure is None else [self.tokens, self.unsure]

    def read(self) -> tuple[list[int], list[int]]:
        """(the chosen tokens, the ones `tokens` holds); waits for them.

        The two differ only where a row was unsure and mlx-lm's rule picks
        another id: a forward queued on `tokens` is then not the one asked for
        (DecodeBatch.forward rolls it back).
        """
        held = read_tokens(self.tokens)
        if (
            self.unsure is None
            or self.logits is None
            or not any(cast(list[bool], self.unsure.tolist()))
        ):
            return held, held
        return read_tokens(greedy(self.logits)), held


def greedy_choice(logits: mx.array) -> Choice:
    """The greedy tokens of `logits` [B, V] by mlx-lm's rule (`greedy`), as a `Choice`.

    On a GPU that is `greedy` itself. On a CPU, MLX's `exp` over the vocabulary
    (the logsumexp) costs most of a small model's batched step (about 36 ms of
    a 32-row step of the tests' tiny model, against 2.5 ms for the argmax), so
    the choice is the raw argmax `a`, which is mlx-lm's pick unless an id
    below `a` has a logit within rounding of the top one: mlx-lm subtracts one
    value c (the logsumexp, |c - max| <= ln V) from every logit, a rounding
    that never reorders but can merge values, and takes the lowest id of the
    merged top. Two results near -ln V differ by at most an ulp each there, so
    a gap to the best lower id above `_tie_margin` cannot merge; rows at or
    under it (and rows whose top is not finite) are `unsure`, and their step
    is chosen by `greedy` when it is read.
    """
    if logits.ndim != 2 or mx.default_device().type != mx.cpu:
        return Choice(greedy(logits))
    ids = mx.argmax(logits, axis=-1)
    top = mx.take_along_axis(logits, ids[:, None], axis=-1).astype(mx.float32)
    lower = mx.arange(logits.shape[-1], dtype=mx.uint32) < ids[:, None]
    runner_up = mx.where(lower, logits, -mx.inf).max(axis=-1, keepdims=True)
    info = mx.finfo(logits.dtype)
    sure = ((top - runner_up.astype(mx.float32)) > _tie_margin(logits)) & (
        mx.abs(top) < info.max / 2
    )
    return Choice(ids, mx.logical_not(sure).reshape(-1), logits)


def _tie_margin(logits: mx.array) -> float:
    """A logit gap above which no rounding of `logits - logsumexp` merges two values.

    Each rounded difference is within an ulp of a value of magnitude at most
    ln V + 1 + gap, an ulp is at most eps times the magnitude, so a gap over
    4 eps (ln V + 2) stays above the two errors together.
    """
    return 4.0 * mx.finfo(logits.dtype).eps * (math.log(logits.shape[-1]) + 2.0)


def _ints(values: mx.array) -> list[int]:
    return [int(v) for v in cast(list[int], values.tolist())]


def _floats(values: mx.array) -> list[float]:
    return [float(v) for v in cast(list[float], values.tolist())]


def _top_logprobs(logprobs: mx.array, token: int, n: int) -> TokenLogprobs:
    value = logprobs[token]
    rank = _ints((logprobs > value).sum()[None])[0] + 1
    top: tuple[tuple[int, float], ...] = ()
    if n > 0:
        ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
        pairs = zip(_ints(ids), _floats(logprobs[ids]), strict=True)
        top = tuple(sorted(pairs, key=lambda kv: -kv[1]))
    return TokenLogprobs(token_id=token, logprob=_floats(value[None])[0], rank=rank, top=top)


def prompt_logprobs(logits: mx.array, targets: Sequence[int], n: int) -> list[TokenLogprobs]:
    """Logprobs of `targets[i]` under `logits[i]` ([T, V]) with the top-n of each row."""
    raw = logits.astype(mx.float32)
    logprobs = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    ids = mx.array(list(targets), dtype=mx.uint32)[:, None]
    chosen = mx.take_along_axis(logprobs, ids, axis=-1)
    ranks = (logprobs > chosen).sum(axis=-1) + 1
    top_ids = mx.argpartition(-logprobs, kth=n - 1, axis=-1)[:, :n] if n > 0 else None
    top_values = mx.take_along_axis(logprobs, top_ids, axis=-1) if top_ids is not None else None
    chosen_list = _floats(chosen.reshape(-1))
    rank_list = _ints(ranks)
    rows: list[TokenLogprobs] = []
    id_rows = cast(list[list[int]], top_ids.tolist()) if top_ids is not None else []
    value_rows = cast(list[list[float]], top_values.tolist()) if top_values is not None else []
    for i, token in enumerate(targets):
        top: tuple[tuple[int, float], ...] = ()
        if n > 0:
            pairs = zip(id_rows[i], value_rows[i], strict=True)
            top = tuple((int(t), float(v)) for t, v in sorted(pairs, key=lambda kv: -kv[1]))
        rows.append(
            TokenLogprobs(token_id=int(token), logprob=chosen_list[i], rank=rank_list[i], top=top)
        )
    return rows


def choose_tokens(
    logits: mx.array,
    samplers: Sequence[RequestSampler],
    histories: Sequence[tuple[Sequence[int], int]],
) -> Choice:
    """The next token of each row of `logits` [B, V], lazy.

    `histories[i]` is (tokens so far, prompt length) of row i. Nothing is
    read back to the host here, so the caller can queue more work (the next
    forward) before it waits for the tokens.
    """
    if all(s.trivial for s in samplers):
        return greedy_choice(logits)
    chosen = []
    for i, sampler in enumerate(samplers):
        row = logits[i]
        if not sampler.trivial:
            row = sampler.process(row, *histories[i])
        chosen.append(sampler.choose(row))
    return Choice(mx.stack(chosen))


def token_logprobs(
    logits: mx.array, samplers: Sequence[RequestSampler], tokens: Sequence[int]
) -> list[TokenLogprobs | None]:
    """Logprobs of the chosen tokens, for the rows that asked for them (else None)."""
    infos: list[TokenLogprobs | None] = []
    for i, sampler in enumerate(samplers):
        n = sampler.params.logprobs
        if n is None:
            infos.append(None)
            continue
        raw = logits[i].astype(mx.float32)
        infos.append(_top_logprobs(raw - mx.logsumexp(raw), tokens[i], n))
    return infos


def read_tokens(tokens: mx.array) -> list[int]:
    """The host's copy of a [B] token array (waits for it): Python ints already."""
    return cast(list[int], tokens.tolist())
