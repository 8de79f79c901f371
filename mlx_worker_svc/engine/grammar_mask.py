"""A step's grammar mask over the batch, and the checks of a step's structured outputs.

`StepMask` is one decode step's mask: a [rows, ceil(V / 32)] int32 bitmask
(vLLM's grammar_bitmask layout, bit i of a row = token i allowed) filled on
the host by llguidance for the constrained rows (structured.py's `Grammar`),
or copied from the scheduler's grammar_bitmask, then applied to the whole
batch's logits with one MLX `where`; rows without a constraint are all ones
and keep their logits. `plan_structured` validates a step's specs, appended
tokens and scheduler masks before anything changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import llguidance
import llguidance.numpy
import mlx.core as mx
import numpy as np

from mlx_worker_svc.core.domain import Origin, SamplingParams, StepPlan
from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.engine.structured import Grammar, GrammarCompiler, RequestKey, mask_words


class MaskedRow(Protocol):
    """What the mask reads of an engine request (sequence.Sequence, which imports us)."""

    key: RequestKey
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    grammar: Grammar | None
    stops: frozenset[int]  # the ids min_tokens masks (stop ids, EOS unless ignored)


class PlannedStep(Protocol):
    """What planning fills in of a validated step (sequence.Work)."""

    scheduled: dict[RequestKey, int]
    bitmasks: dict[RequestKey, bytes]


def check_bitmask(
    data: bytes, vocab_size: int, where: str, masked: frozenset[int] = frozenset()
) -> None:
    """Refuses a scheduler's packed mask of the wrong size or with no token allowed,
    `masked` (ids min_tokens holds back this step) left out."""
    expected = mask_words(vocab_size) * 4
    if len(data) != expected:
        raise InvalidArgument(
            f"{where} has {len(data)} bytes; a mask over {vocab_size} tokens is "
            f"ceil({vocab_size} / 32) int32 words = {expected} bytes"
        )
    words = np.frombuffer(data, dtype="<u4").copy()
    tail = vocab_size % 32
    if tail:
        words[-1] &= np.uint32((1 << tail) - 1)
    if not words.any():
        raise InvalidArgument(f"{where} allows no token")
    if not _without(words, masked, vocab_size).any():
        raise InvalidArgument(
            f"{where} allows only tokens that end the request (EOS or a stop token), which "
            "sampling_params.min_tokens holds back in this step: no token could be sampled"
        )


def _without(words: np.ndarray[Any, Any], ids: frozenset[int], vocab_size: int) -> Any:
    """A copy of the packed row `words` with the token `ids` (and the bits past
    `vocab_size`) not allowed."""
    out = words.copy()
    view = out.view(np.uint32)
    tail = vocab_size % 32
    if tail:
        view[-1] &= np.uint32((1 << tail) - 1)
    for token in ids:
        if token < vocab_size:
            view[token // 32] &= ~np.uint32(1 << (token % 32))
    return out


def _hold_stops(words: np.ndarray[Any, Any], row: MaskedRow, vocab_size: int) -> None:
    """min_tokens for a grammar row: its stop tokens left out of its mask `words`,
    unless the grammar allows nothing else; then the grammar decides (it ends)."""
    if not row.stops or len(row.tokens) - row.prompt_len >= row.params.min_tokens:
        return
    held = _without(words, row.stops, vocab_size)
    if held.any():
        words[:] = held


@dataclass
class StepMask:
    """The allowed tokens of one decode step's rows, as a packed [rows, words] bitmask."""

    words: np.ndarray[Any, np.dtype[np.int32]]
    grammar_rows: list[int] = field(default_factory=list)  # rows whose matcher advances
    fill_ns: int = 0

    def apply(self, logits: mx.array) -> mx.array:
        """`logits` [B, V] with every disallowed token at -inf: one batched `where`."""
        rows, vocab = logits.shape
        packed = mx.array(self.words.view(np.uint32))
        bits = (packed[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
        allowed = bits.reshape(rows, -1)[:, :vocab].astype(mx.bool_)
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


def step_mask(
    compiler: GrammarCompiler,
    rows: Sequence[MaskedRow],
    bitmasks: Mapping[RequestKey, bytes],
) -> StepMask | None:
    """The mask of a decode step's rows (None when no row is constrained).

    A row is constrained by its grammar, or by the scheduler's packed mask in
    `bitmasks` (never both: planning refuses that).
    """
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if not constrained and not bitmasks:
        return None
    start = time.perf_counter_ns()
    words = np.full((len(rows), mask_words(compiler.vocab_size)), -1, dtype=np.int32)
    pairs = []
    for i, row in enumerate(rows):
        data = bitmasks.get(row.key)
        if data is not None:
            words[i] = np.frombuffer(data, dtype="<i4")
        if row.grammar is not None:
            row.grammar.sync(row.tokens)
            pairs.append((row.grammar.matcher, i))
    if pairs:
        llguidance.numpy.fill_next_token_bitmask_par(compiler.executor, pairs, words)
        for i, row in enumerate(rows):  # a matcher in an error state masks all but EOS
            if row.grammar is not None:
                row.grammar.check()
                _hold_stops(words[i], row, compiler.vocab_size)
    elapsed = time.perf_counter_ns() - start
    compiler.stats.masks += 1
    compiler.stats.mask_ns += elapsed
    return StepMask(words, constrained, elapsed)


def advance(mask: StepMask | None, rows: Sequence[MaskedRow], tokens: Sequence[int]) -> set[int]:
    """Feeds each grammar row its sampled token; returns the rows whose grammar completed."""
    done: set[int] = set()
    for i in mask.grammar_rows if mask is not None else ():
        grammar = rows[i].grammar
        assert grammar is not None
        if grammar.advance(tokens[i]):
            done.add(i)
    return done


def plan_structured(
    plan: StepPlan,
    work: PlannedStep,
    seqs: Mapping[RequestKey, MaskedRow],
    samples: Callable[[RequestKey], bool],
    compiler: GrammarCompiler,
) -> None:
    """Validates a step's structured outputs; puts its bitmasks into `work`.

    Compiles (usually: finds in the cache) every new request's spec, checks
    tokens appended to a constrained request against its grammar, and checks
    each grammar_bitmask entry (see ExecuteRequest.grammar_bitmask). Raises
    InvalidArgument before anything changes.
    """
    for i, new in enumerate(plan.new_requests):
        spec = new.sampling.structured_outputs
        if spec is None:
            continue
        where = f"new_requests[{i}] (req_id {new.req_id!r})"
        matcher = compiler.compile(spec, f"{where}.sampling_params.structured_outputs")
        generated = new.prompt_token_ids[len(new.prompt_token_ids) - new.num_generated_tokens :]
        if generated and not Grammar(matcher.deep_copy(), 0).accepts(generated):
            raise InvalidArgument(
                f"{where}.num_generated_tokens: the last {len(generated)} prompt tokens are "
                "not a start its structured_outputs allows"
            )
    for i, cached in enumerate(plan.cached_requests):
        seq = seqs.get((Origin.EXECUTE, cached.req_id))
        if seq is None or seq.grammar is None or not cached.new_token_ids:
            continue
        seq.grammar.sync(seq.tokens)
        if not seq.grammar.accepts(cached.new_token_ids):
            raise InvalidArgument(
                f"cached_requests[{plan.cached_position(i)}] (req_id {clip(cached.req_id)!r})"
                ".new_token_ids: the request's structured_outputs does not allow these tokens here"
            )
    params = {new.req_id: new.sampling for new in plan.new_requests}
    appended = {c.req_id: len(c.new_token_ids) for c in plan.cached_requests}
    for req_id, data in plan.grammar_bitmask.items():
        where = f"grammar_bitmask[{req_id!r}]"
        key = (Origin.EXECUTE, req_id)
        if plan.num_decode_steps > 1:
            raise InvalidArgument(
                f"{where}: a mask covers one sampled token, so num_decode_steps must be "
                f"0 or 1 with grammar_bitmask, got {plan.num_decode_steps}"
            )
        if key not in work.scheduled:
            raise InvalidArgument(f"{where}: req_id is not scheduled in this step")
        if not samples(key):
            raise InvalidArgument(f"{where}: the request does not sample in this step")
        held = seqs.get(key)
        sampling = held.params if held is not None else params[req_id]
        if sampling.structured_outputs is not None:
            raise InvalidArgument(
                f"{where}: the request has sampling_params.structured_outputs; send one or "
                "the other"
            )
        # Before min_tokens, the request's EOS and stop tokens cannot be sampled.
        done = len(held.tokens) - held.prompt_len + appended.get(req_id, 0) if held else 0
        stops = held.stops if held is not None else sampling.stop_ids(compiler.eos_ids)
        check_bitmask(
            data, compiler.vocab_size, where, stops if done < sampling.min_tokens else frozenset()
        )
        work.bitmasks[key] = data
