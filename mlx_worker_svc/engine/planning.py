"""Validation of a scheduler step: a StepPlan in, a `Work` out, nothing changed.

Every check that could reject a step runs here, before the runner touches any
state, so an invalid step is refused as a whole with a message naming the
request and field that were wrong (DESIGN.md: never half-apply).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from mlx_worker_svc.core.domain import MAX_DECODE_STEPS, Origin, SamplingParams, StepPlan
from mlx_worker_svc.core.errors import InvalidArgument, NotFound
from mlx_worker_svc.engine.sequence import NewSequence, RequestKey, Sequence, Work

_EXEC = Origin.EXECUTE


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_context: int


def check_token_ids(ids: Seq[int], where: str, vocab_size: int) -> None:
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(
                f"{where}[{i}] = {token} is out of the vocabulary (size {vocab_size})"
            )


def check_prompt(prompt: Seq[int], where: str, limits: Limits) -> None:
    if not prompt:
        raise InvalidArgument(f"{where} is empty; a request needs at least one prompt token")
    check_token_ids(prompt, where, limits.vocab_size)
    if len(prompt) >= limits.max_context:
        raise InvalidArgument(
            f"{where} has {len(prompt)} tokens; the context length is {limits.max_context}, "
            f"so at most {limits.max_context - 1} leave room for one generated token"
        )


def check_sampling(params: SamplingParams, where: str, limits: Limits) -> None:
    params.validate(where)
    check_token_ids(params.stop_token_ids, f"{where}.stop_token_ids", limits.vocab_size)
    check_token_ids(sorted(params.logit_bias), f"{where}.logit_bias keys", limits.vocab_size)


def _no_duplicates(ids: Seq[str], field: str) -> None:
    seen: set[str] = set()
    for req_id in ids:
        if not req_id:
            raise InvalidArgument(f"{field} has an empty req_id")
        if req_id in seen:
            raise InvalidArgument(f"{field} names req_id {req_id!r} twice")
        seen.add(req_id)


def plan_step(
    plan: StepPlan,
    seqs: Mapping[RequestKey, Sequence],
    recently_finished: Collection[RequestKey],
    limits: Limits,
) -> Work:
    """Validates `plan` against the live requests; raises before any change."""
    if not 0 <= plan.num_decode_steps <= MAX_DECODE_STEPS:
        raise InvalidArgument(
            f"num_decode_steps must be in [0, {MAX_DECODE_STEPS}], got {plan.num_decode_steps}"
        )
    work = Work(decode_steps=max(plan.num_decode_steps, 1))
    gone = _removals(plan, seqs, recently_finished, work)
    counts = _new_requests(plan, seqs, limits, work)
    counts.update(_cached_requests(plan, seqs, gone, set(counts), limits=limits, work=work))
    for req_id, count in plan.num_scheduled_tokens.items():
        where = f"num_scheduled_tokens[{req_id!r}]"
        if req_id not in counts:
            raise InvalidArgument(
                f"{where}: req_id is in neither new_requests nor cached_requests of this step"
            )
        computed, total = counts[req_id]
        if count < 1:
            raise InvalidArgument(f"{where} must be >= 1, got {count}")
        if computed + count > total:
            raise InvalidArgument(
                f"{where} is {count} but only {total - computed} tokens are uncomputed "
                f"(num_computed_tokens {computed}, sequence length {total})"
            )
        work.scheduled[(_EXEC, req_id)] = count
    return work


def _removals(
    plan: StepPlan,
    seqs: Mapping[RequestKey, Sequence],
    recently_finished: Collection[RequestKey],
    work: Work,
) -> set[str]:
    """Checks finished and preempted ids; returns the ids leaving the batch."""
    _no_duplicates(plan.finished_req_ids, "finished_req_ids")
    _no_duplicates(plan.preempted_req_ids, "preempted_req_ids")
    for req_id in plan.finished_req_ids:
        key = (_EXEC, req_id)
        if key in seqs:
            work.finished.append(key)
        elif key not in recently_finished:
            raise NotFound(f"finished_req_ids: unknown req_id {req_id!r}")
    gone = set(plan.finished_req_ids)
    for req_id in plan.preempted_req_ids:
        key = (_EXEC, req_id)
        if req_id in gone:
            raise InvalidArgument(f"req_id {req_id!r} is both finished and preempted")
        if key not in seqs:
            raise NotFound(f"preempted_req_ids: unknown req_id {req_id!r}")
        work.preempted.append(key)
    return gone | set(plan.preempted_req_ids)


def _new_requests(
    plan: StepPlan, seqs: Mapping[RequestKey, Sequence], limits: Limits, work: Work
) -> dict[str, tuple[int, int]]:
    """Checks new requests; returns req_id -> (computed, total tokens)."""
    _no_duplicates([r.req_id for r in plan.new_requests], "new_requests")
    counts: dict[str, tuple[int, int]] = {}
    for i, new in enumerate(plan.new_requests):
        where = f"new_requests[{i}] (req_id {new.req_id!r})"
        key = (_EXEC, new.req_id)
        if key in seqs and new.req_id not in plan.finished_req_ids:
            raise InvalidArgument(f"{where}: req_id is already running")
        check_prompt(new.prompt_token_ids, f"{where}.prompt_token_ids", limits)
        check_sampling(new.sampling, f"{where}.sampling_params", limits)
        if new.num_generated_tokens >= len(new.prompt_token_ids):
            raise InvalidArgument(
                f"{where}.num_generated_tokens is {new.num_generated_tokens}; it must leave at "
                f"least one of the {len(new.prompt_token_ids)} prompt tokens"
            )
        work.new.append(
            NewSequence(key, new.prompt_token_ids, new.sampling, new.num_generated_tokens)
        )
        counts[new.req_id] = (0, len(new.prompt_token_ids))
    return counts


def _cached_requests(
    plan: StepPlan,
    seqs: Mapping[RequestKey, Sequence],
    gone: set[str],
    new_ids: set[str],
    *,
    limits: Limits,
    work: Work,
) -> dict[str, tuple[int, int]]:
    """Checks cached requests; returns req_id -> (computed, total tokens)."""
    _no_duplicates([r.req_id for r in plan.cached_requests], "cached_requests")
    counts: dict[str, tuple[int, int]] = {}
    for i, cached in enumerate(plan.cached_requests):
        where = f"cached_requests[{i}] (req_id {cached.req_id!r})"
        if cached.req_id in new_ids:
            raise InvalidArgument(f"{where}: req_id is also in new_requests")
        if cached.req_id in gone:
            raise InvalidArgument(f"{where}: req_id is finished or preempted in this step")
        seq = seqs.get((_EXEC, cached.req_id))
        if seq is None:
            raise NotFound(f"{where}: unknown req_id (finished, never added, or lost)")
        if seq.preempted and not cached.resumed_from_preemption:
            raise InvalidArgument(
                f"{where}: the request is preempted; set resumed_from_preemption to resume it"
            )
        if cached.resumed_from_preemption and not seq.preempted:
            raise InvalidArgument(f"{where}.resumed_from_preemption is set but it is running")
        if cached.num_computed_tokens != seq.num_computed:
            raise InvalidArgument(
                f"{where}.num_computed_tokens is {cached.num_computed_tokens} but the worker "
                f"has {seq.num_computed} computed"
            )
        check_token_ids(cached.new_token_ids, f"{where}.new_token_ids", limits.vocab_size)
        total = len(seq.tokens) + len(cached.new_token_ids)
        if total > limits.max_context:
            raise InvalidArgument(
                f"{where}.new_token_ids would make the sequence {total} tokens, over the "
                f"context length {limits.max_context}"
            )
        if cached.new_token_ids or cached.resumed_from_preemption:
            work.appends.append((seq.key, cached.new_token_ids, cached.resumed_from_preemption))
        counts[cached.req_id] = (seq.num_computed, total)
    return counts
