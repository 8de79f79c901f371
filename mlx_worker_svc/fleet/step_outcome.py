"""What a step's reply does to the requests of one worker (the link's lists).

`apply_outputs` takes a step's outputs into the requests (tokens, cache hits,
finishes); `cancel` takes off a request its caller gave up. `refuse_step`
settles a step the worker refused without being lost: the step changed
nothing there, so its new requests go back to the queue (a cancelled one
does not, and nothing frees it on the worker, which never held it), a
request out of KV is put back or preempted, and a request the worker
refused fails in its own terms. `undo_step` puts back a step that failed
behind an earlier failure. `worker_lost` says when an error means the worker
(not the request) is gone or restarted, which the link handles by failing
everything over. These only move requests between `waiting`, `running` and
`to_free`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.fleet.request import FleetRequest, Phase
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

# How the worker names a field of one new request of a step.
_NEW_REQUEST = re.compile(r"new_requests\[(\d+)\](?: \(req_id '[^']*'\))?\.")
INVALID = grpc.StatusCode.INVALID_ARGUMENT
# Codes that mean the worker (not the request) is gone or restarted.
WORKER_DOWN = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


@dataclass(frozen=True)
class Queues:
    """One link's request lists (the link's own objects, changed in place)."""

    waiting: list[FleetRequest]  # routed here, not started on the worker
    running: dict[str, FleetRequest]  # worker id -> a request the worker holds
    to_free: list[str]  # worker ids to free at the next step


def cancel(r: FleetRequest, queues: Queues) -> None:
    """Takes a cancelled request off the lists; one the worker holds is freed next step."""
    r.cancelled = True
    if r in queues.waiting:
        queues.waiting.remove(r)
    if queues.running.pop(r.worker_id, None) is not None:
        queues.to_free.append(r.worker_id)


def worker_lost(exc: ClientError) -> bool:
    """The worker is down, answers for another epoch (it restarted), or is in a state
    that takes no requests (put to sleep by another client: "the worker is SLEEPING")."""
    refused = exc.code == grpc.StatusCode.FAILED_PRECONDITION
    stale = refused and ("epoch" in exc.details or "the worker is " in exc.details)
    return exc.code in WORKER_DOWN or stale


def refuse_step(
    exc: ClientError,
    request: pb.ExecuteRequest,
    started: list[FleetRequest],
    queues: Queues,
) -> None:
    """Settles a step the worker refused (not `worker_lost`)."""
    # The step changed nothing on the worker: undo it here too (an id the
    # worker does not know is already free there).
    if exc.code != grpc.StatusCode.NOT_FOUND:
        queues.to_free.extend(request.finished_req_ids)
    # Read before the attempts go back: the worker named the step's ids.
    named = _named_request(exc, started, queues) if exc.code == INVALID else None
    back = _unstart(started, queues)
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # Out of KV or memory: put back the newest request (preempt it if running).
        if started:
            _requeue(back, queues)
            return
        # The newest the step scheduled, so held by the worker: a request started by a
        # later step in flight holds nothing there yet, so preempting it frees nothing
        # (and the same step would be refused again and again).
        held = [r for r in queues.running.values() if r.worker_id in request.num_scheduled_tokens]
        if len(held) > 1:
            _preempt(held[-1], queues)
            return
        if set(request.num_scheduled_tokens) != set(queues.running):
            return  # the step's others have left since (cancelled, stopped): try again
    if named is not None:
        # One request's own field (a grammar that does not compile, or that reached
        # a limit of the worker's engine while it ran): fail only it, in its own
        # terms; the step's others start or run again next time.
        bad, detail = named
        _requeue([r for r in back if r is not bad], queues)
        exc = ClientError(exc.code, detail, exc.method, exc.attempts)
        victims = [bad]
    else:
        # The worker refused the request itself (or the only one left): fail it.
        victims = started or list(queues.running.values())
        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and len(victims) == 1:
            # Alone and out of KV: its own tokens fill the worker's whole budget.
            [r] = victims
            said = exc.details.replace(repr(clip(r.worker_id)), repr(clip(r.request_id)))
            exc = ClientError(
                exc.code,
                f"the request outgrew the KV budget of its worker, which it had to itself "
                f"({said}); ask for fewer tokens (max_tokens), or give the worker more KV",
                exc.method,
                exc.attempts,
            )
    # A refused step started nothing: only requests running before it are on the
    # worker, to be freed there.
    for r in victims:
        queues.running.pop(r.worker_id, None)
        if r not in started:
            queues.to_free.append(r.worker_id)
        r.phase = Phase.DONE
        r.outbox.put_nowait(exc)


def lost_adapter(exc: ClientError, started: list[FleetRequest]) -> str | None:
    """The adapter a refused step's new request named and the worker no longer holds
    (NOT_FOUND `new_requests[i].lora_name`: evicted, or removed from outside), if that
    is why it refused the step; the step changed nothing there."""
    at = _NEW_REQUEST.match(exc.details)
    if exc.code != grpc.StatusCode.NOT_FOUND or at is None or not started:
        return None
    if not exc.details[at.end() :].startswith("lora_name:"):
        return None
    return started[min(int(at.group(1)), len(started) - 1)].lora_name or None


def without_adapter(waiting: list[FleetRequest], held: set[str]) -> list[FleetRequest]:
    """Takes out of `waiting` the requests whose adapter the worker no longer holds."""
    gone = [r for r in waiting if r.lora_name and r.lora_name not in held]
    for r in gone:
        waiting.remove(r)
    return gone


def _named_request(
    exc: ClientError, started: list[FleetRequest], queues: Queues
) -> tuple[FleetRequest, str] | None:
    """The one request an error is about, and the message in its own terms: a new one
    the worker names by its place (`new_requests[i] (req_id ...).field: ...`), or one
    named by its worker id (`req_id '<id>': ...`, a request that failed while it ran)."""
    at = _NEW_REQUEST.match(exc.details)
    if at is not None and started:
        return started[min(int(at.group(1)), len(started) - 1)], exc.details[at.end() :]
    if not exc.details.startswith("req_id "):
        return None
    for r in [*started, *queues.running.values()]:
        prefix = f"req_id {clip(r.worker_id)!r}: "
        if exc.details.startswith(prefix):
            return r, exc.details[len(prefix) :]
    return None


def undo_step(
    request: pb.ExecuteRequest,
    started: list[FleetRequest],
    queues: Queues,
) -> None:
    """A step that failed behind an earlier failure changed nothing: plan it again."""
    queues.to_free.extend(request.finished_req_ids)
    _requeue(_unstart(started, queues), queues)


def _unstart(started: list[FleetRequest], queues: Queues) -> list[FleetRequest]:
    """Takes back the requests a refused step was to create; returns those to queue again.

    The worker never held them: a free queued for one since (its caller cancelled it,
    or the link preempted it while the step was in flight) is dropped, as the worker
    would refuse it (NOT_FOUND) and with it the step of other requests that carries
    it. A cancelled one does not go back, nor one that is queued already (preempted).
    """
    back = []
    for r in started:
        queues.running.pop(r.worker_id, None)
        while r.worker_id in queues.to_free:
            queues.to_free.remove(r.worker_id)
        r.attempt -= 1
        if not r.cancelled and r not in queues.waiting:
            back.append(r)
    return back


def _requeue(requests: list[FleetRequest], queues: Queues) -> None:
    """Puts requests back in the queue, each in its place (`_queue_again`)."""
    for r in requests:
        r.phase = Phase.QUEUED
        _queue_again(r, queues.waiting)


def _queue_again(r: FleetRequest, waiting: list[FleetRequest]) -> None:
    """Queues `r` ahead of every waiting request that came after it (by `admitted`), first
    come first served: a request preempted, or taken back from a refused step, keeps its
    place. (At the head, a newer request taken back from a step in flight after the
    refused one went ahead of the request that step preempted, so under KV pressure a
    preempted request waited while newer ones started, for tens of seconds.)"""
    at = next((i for i, w in enumerate(waiting) if w.admitted > r.admitted), len(waiting))
    waiting.insert(at, r)


def restart_stalled(request: pb.ExecuteRequest, queues: Queues, *, idle: bool) -> list[str]:
    """Preempts the running requests when a step planned with nothing in flight (`idle`)
    schedules none of them: each always has a token to compute then, so their counts
    went wrong; left so, they would wait for good with the worker idle. Each restarts
    from prompt + tokens (nothing streamed is lost), freed by this step. Returns their
    worker ids, for the caller to log."""
    if not idle or not queues.running or request.num_scheduled_tokens:
        return []
    stalled = list(queues.running)
    for r in list(queues.running.values()):
        _preempt(r, queues)
    request.finished_req_ids.extend(queues.to_free)  # freed as this step starts
    queues.to_free.clear()
    return stalled


def _preempt(r: FleetRequest, queues: Queues) -> None:
    """Frees a running request's KV; it restarts later from prompt + tokens."""
    queues.running.pop(r.worker_id, None)
    queues.to_free.append(r.worker_id)
    r.phase = Phase.PREEMPTED
    _queue_again(r, queues.waiting)


def apply_outputs(
    response: pb.ExecuteResponse,
    running: dict[str, FleetRequest],
    stats: fleet_pb2.WorkerStatus,
) -> list[FleetRequest]:
    """Takes a step's outputs; returns the requests with something to stream."""
    touched: list[FleetRequest] = []
    for out in response.outputs:
        r = running.get(out.req_id)
        if r is None:
            continue
        r.computed = out.num_computed_tokens
        if not r.reported_cached:
            r.reported_cached = True
            if out.num_cached_prompt_tokens:
                stats.prefix_hits += 1
                stats.cached_prompt_tokens += out.num_cached_prompt_tokens
                if r.attempt == 1:
                    r.cached_tokens = out.num_cached_prompt_tokens
        r.generated.extend(out.sampled_token_ids)
        r.text += out.text
        r.logprobs.extend(out.logprobs)
        if out.finish_reason:
            # The worker has freed it already.
            del running[out.req_id]
            stats.num_finished += 1
            r.phase = Phase.DONE
            r.finish_reason = out.finish_reason
        if out.sampled_token_ids or out.finish_reason:
            touched.append(r)
    return touched
