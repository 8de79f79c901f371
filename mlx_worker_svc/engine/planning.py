"""Validation of a scheduler step: a StepPlan in, a `Work` out, nothing changed.

Every check that could reject a step runs here, before the runner touches any
state, so an invalid step is refused as a whole with a message naming the
request and field that were wrong (DESIGN.md: never half-apply).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NoReturn

from mlx_worker_svc.core.domain import (
    MAX_DECODE_STEPS,
    CachedRequest,
    Origin,
    SamplingParams,
    StepPlan,
)
from mlx_worker_svc.core.errors import InvalidArgument, NotFound
from mlx_worker_svc.core.log_format import clip
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
            raise InvalidArgument(f"{field} names req_id {clip(req_id)!r} twice")
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
        if req_id not in counts:
            raise InvalidArgument(
                f"{_scheduled(req_id)}: req_id is in neither new_requests nor cached_requests "
                "of this step"
            )
        computed, total = counts[req_id]
        if count < 1:
            raise InvalidArgument(f"{_scheduled(req_id)} must be >= 1, got {count}")
        if computed + count > total:
            raise InvalidArgument(
                f"{_scheduled(req_id)} is {count} but only {total - computed} tokens are "
                f"uncomputed (num_computed_tokens {computed}, sequence length {total})"
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
            raise NotFound(f"finished_req_ids: unknown req_id {clip(req_id)!r}")
    gone = set(plan.finished_req_ids)
    for req_id in plan.preempted_req_ids:
        key = (_EXEC, req_id)
        if req_id in gone:
            raise InvalidArgument(f"req_id {clip(req_id)!r} is both finished and preempted")
        if key not in seqs:
            raise NotFound(f"preempted_req_ids: unknown req_id {clip(req_id)!r}")
        work.preempted.append(key)
    return gone | set(plan.preempted_req_ids)


def _new_requests(
    plan: StepPlan, seqs: Mapping[RequestKey, Sequence], limits: Limits, work: Work
) -> dict[str, tuple[int, int]]:
    """Checks new requests; returns req_id -> (computed, total tokens)."""
    _no_duplicates([r.req_id for r in plan.new_requests], "new_requests")
    counts: dict[str, tuple[int, int]] = {}
    for i, new in enumerate(plan.new_requests):
        where = f"new_requests[{i}] (req_id {clip(new.req_id)!r})"
        key = (_EXEC, new.req_id)
        if key in seqs and new.req_id not in plan.finished_req_ids:
            if seqs[key].preempted:
                raise InvalidArgument(
                    f"{where}: req_id is a preempted request the worker still holds: resume it "
                    "in cached_requests with resumed_from_preemption, or name it in "
                    "finished_req_ids to start it again as new"
                )
            raise InvalidArgument(
                f"{where}: req_id is already running; name it in finished_req_ids to start "
                "it again as new"
            )
        check_prompt(new.prompt_token_ids, f"{where}.prompt_token_ids", limits)
        check_sampling(new.sampling, f"{where}.sampling_params", limits)
        if new.num_generated_tokens >= len(new.prompt_token_ids):
            raise InvalidArgument(
                f"{where}.num_generated_tokens is {new.num_generated_tokens}; it must leave at "
                f"least one of the {len(new.prompt_token_ids)} prompt tokens"
            )
        work.new.append(
            NewSequence(
                key,
                new.prompt_token_ids,
                new.sampling,
                new.num_generated_tokens,
                new.lora_name,
                new.skip_special_tokens if new.detokenize else None,
            )
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
        # This runs per request per step: the field's name is only built for an error.
        seq = seqs.get((_EXEC, cached.req_id))
        if (
            seq is None
            or cached.req_id in new_ids
            or cached.req_id in gone
            or seq.preempted != cached.resumed_from_preemption
            or cached.num_computed_tokens != seq.num_computed
        ):
            where = _cached(plan.cached_position(i), cached.req_id)
            _refuse_cached(where, cached, seq, new_ids, gone)
        if cached.new_token_ids:
            where = _cached(plan.cached_position(i), cached.req_id)
            check_token_ids(cached.new_token_ids, f"{where}.new_token_ids", limits.vocab_size)
            scheduled = plan.num_scheduled_tokens.get(cached.req_id, 0)
            check_new_tokens(seq, cached.new_token_ids, scheduled, f"{where}.new_token_ids")
        total = len(seq.tokens) + len(cached.new_token_ids)
        if cached.new_token_ids or cached.resumed_from_preemption:
            work.appends.append((seq.key, cached.new_token_ids, cached.resumed_from_preemption))
        counts[cached.req_id] = (seq.num_computed, total)
    return counts


def _scheduled(req_id: str) -> str:
    return f"num_scheduled_tokens[{clip(req_id)!r}]"


def _cached(i: int, req_id: str) -> str:
    return f"cached_requests[{i}] (req_id {clip(req_id)!r})"


def _refuse_cached(
    where: str, cached: CachedRequest, seq: Sequence | None, new_ids: set[str], gone: set[str]
) -> NoReturn:
    """Raises the error of a cached request that does not match the worker's state."""
    if cached.req_id in new_ids:
        raise InvalidArgument(f"{where}: req_id is also in new_requests")
    if cached.req_id in gone:
        raise InvalidArgument(f"{where}: req_id is finished or preempted in this step")
    if seq is None:
        raise NotFound(f"{where}: unknown req_id (finished, never added, or lost)")
    if seq.preempted and not cached.resumed_from_preemption:
        raise InvalidArgument(
            f"{where}: the request is preempted; set resumed_from_preemption to resume it"
        )
    if cached.resumed_from_preemption and not seq.preempted:
        raise InvalidArgument(f"{where}.resumed_from_preemption is set but it is running")
    raise InvalidArgument(_count_mismatch(where, cached, seq))


def _count_mismatch(where: str, cached: CachedRequest, seq: Sequence) -> str:
    if seq.preempted:
        return (
            f"{where}.num_computed_tokens is {cached.num_computed_tokens}, but a request resumed "
            f"from preemption restarts from 0: its KV was freed and the worker recomputes its "
            f"{len(seq.tokens)} tokens (prompt and output, which it kept)"
        )
    return (
        f"{where}.num_computed_tokens is {cached.num_computed_tokens} but the worker has "
        f"{seq.num_computed} computed (the previous step's RequestOutput.num_computed_tokens)"
    )


def check_new_tokens(seq: Sequence, new: Seq[int], scheduled: int, where: str) -> None:
    """Refuses `new_token_ids` that cannot be what the scheduler means (worker.proto).

    The worker holds the prompt and every token it sampled; `new` goes after
    its last token. A scheduler that counts positions from
    num_computed_tokens (vLLM's pipeline-parallel path echoes the sampled
    token; a resume may send the whole sequence) sends tokens the worker holds
    already: when `new` repeats the held tokens from num_computed_tokens, from
    the end of the prompt, from the start, or its last tokens (a sampled token
    echoed on a resume), and the step would not compute
    past them, appending would duplicate them, so the step is refused. So are
    appends that leave no room for the token the request samples next.
    """
    if not new:
        return
    held = seq.tokens
    end = seq.num_computed + scheduled
    # Also its last tokens: an echoed sampled token on a resume (from 0).
    suffix = len(held) - len(new)
    for start in dict.fromkeys((seq.num_computed, seq.prompt_len, 0, max(suffix, 0))):
        count = min(len(new), len(held) - start)
        if count < 1 or end > start + len(new) or list(new[:count]) != held[start : start + count]:
            continue
        repeated = held[start : start + count]
        shown = f"{repeated}" if count <= 8 else f"{count} tokens ({repeated[:4]}...)"
        what = f"{shown}, which the worker holds from position {start}"
        advice = (
            "A preempted request keeps its tokens: resume it with num_computed_tokens 0 and "
            "no new_token_ids"
            if seq.preempted
            else "A decode step sends no new_token_ids and schedules 1 token"
        )
        raise InvalidArgument(
            f"{where} repeats {what}: the worker appends every token it samples, and "
            f"new_token_ids go after its last token (position {len(held) - 1}), so they are "
            f"only tokens it does not hold. {advice}, unless tokens are new"
        )
    total = len(held) + len(new)
    if total >= seq.length_limit:
        max_tokens = seq.params.max_tokens
        if max_tokens is not None and seq.prompt_len + max_tokens == seq.length_limit:
            why = f"its prompt of {seq.prompt_len} plus max_tokens {max_tokens}"
        else:
            why = "the context length"
        raise InvalidArgument(
            f"{where} would make the sequence {total} tokens, and this request ends at "
            f"{seq.length_limit} tokens ({why}; appended tokens count as output), which "
            "leaves no room for the token it samples next"
        )
