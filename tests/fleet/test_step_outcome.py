"""A refused step's requests, settled directly: what goes back, what is freed, who fails.

The link plans a step, and before its reply comes a caller may cancel one of
its requests, the link may preempt one, or (steps ahead) another step may be
in flight. A step the worker refused changed nothing there: a request it was
to create was never held, so nothing may free it (the worker would refuse
that free, NOT_FOUND, and with it the step of other requests carrying it),
and a cancelled one never runs again. A request is told it outgrew its
worker's KV only when the refused step was its alone.
"""

from __future__ import annotations

import grpc
import pytest

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.fleet.request import FleetRequest, Phase
from mlx_worker_svc.fleet.step_outcome import Queues, cancel, refuse_step, undo_step
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

OUT_OF_KV = grpc.StatusCode.RESOURCE_EXHAUSTED


def _queues() -> Queues:
    return Queues(waiting=[], running={}, to_free=[])


def _request(name: str) -> FleetRequest:
    return FleetRequest(request_id=name, prompt=[5, 6, 7], params=pb.SamplingParams())


def _creating(queues: Queues, *requests: FleetRequest) -> pb.ExecuteRequest:
    """A step that creates `requests` (as plan_step leaves them: running, attempt 1)."""
    step = pb.ExecuteRequest(step_id=1)
    for r in requests:
        r.attempt, r.phase = r.attempt + 1, Phase.RUNNING
        queues.running[r.worker_id] = r
        step.new_requests.append(pb.NewRequest(req_id=r.worker_id, prompt_token_ids=r.prompt))
        step.num_scheduled_tokens[r.worker_id] = len(r.prompt)
    return step


def _decoding(*requests: FleetRequest) -> pb.ExecuteRequest:
    step = pb.ExecuteRequest(step_id=2)
    for r in requests:
        step.cached_requests.append(pb.CachedRequest(req_id=r.worker_id, num_computed_tokens=3))
        step.num_scheduled_tokens[r.worker_id] = 1
    return step


def _error(code: grpc.StatusCode, details: str) -> ClientError:
    return ClientError(code, details, "Execute", 1)


def test_a_request_cancelled_while_its_refused_create_was_in_flight_is_dropped() -> None:
    queues = _queues()
    gone, kept = _request("gone"), _request("kept")
    step = _creating(queues, gone, kept)
    cancel(gone, queues)
    assert queues.to_free == ["gone#1"]
    refuse_step(_error(OUT_OF_KV, "not enough KV blocks"), step, [gone, kept], queues)
    assert queues.waiting == [kept] and kept.worker_id == "kept#0"
    assert queues.to_free == [] and queues.running == {}  # the worker never held gone#1
    assert gone.outbox.empty() and kept.outbox.empty()


def test_a_cancelled_request_of_a_step_undone_behind_a_failure_is_dropped() -> None:
    queues = _queues()
    gone, kept = _request("gone"), _request("kept")
    step = _creating(queues, gone, kept)
    cancel(gone, queues)
    undo_step(step, [gone, kept], queues)
    assert queues.waiting == [kept] and queues.to_free == [] and queues.running == {}


def test_a_cancelled_request_is_dropped_when_another_of_its_step_is_refused() -> None:
    queues = _queues()
    gone, bad = _request("gone"), _request("bad")
    step = _creating(queues, gone, bad)
    cancel(gone, queues)
    refused = "new_requests[1] (req_id 'bad#1').sampling_params.max_tokens: too many"
    refuse_step(_error(grpc.StatusCode.INVALID_ARGUMENT, refused), step, [gone, bad], queues)
    assert queues.waiting == [] and queues.to_free == [] and queues.running == {}
    error = bad.outbox.get_nowait()
    assert (
        isinstance(error, ClientError) and error.details == "sampling_params.max_tokens: too many"
    )


def test_a_request_created_by_a_step_in_flight_is_not_preempted_for_a_refused_step() -> None:
    """Step 1 decodes `old`; step 2, sent ahead, creates `new`. Step 1 is refused for want
    of KV: `new` holds nothing on the worker yet, so it is not preempted (no free is
    queued for it, which the worker would refuse). Step 2 then fails behind it and is
    undone: `new` is queued once, to start again."""
    queues = _queues()
    old, new = _request("old"), _request("new")
    _creating(queues, old)
    first = _decoding(old)
    second = _creating(queues, new)
    refuse_step(_error(OUT_OF_KV, "not enough KV blocks"), first, [], queues)
    assert queues.waiting == [] and queues.to_free == []
    undo_step(second, [new], queues)
    assert queues.waiting == [new] and queues.to_free == []
    assert list(queues.running) == ["old#1"] and new.phase is Phase.QUEUED
    assert old.outbox.empty() and new.outbox.empty()


def test_a_request_is_not_failed_for_want_of_kv_that_others_of_its_step_took() -> None:
    """The refused step decoded two requests; one was cancelled before the reply came.
    The one left is not told it outgrew its worker: it runs again, alone."""
    queues = _queues()
    left, gone = _request("left"), _request("gone")
    _creating(queues, left, gone)
    step = _decoding(left, gone)
    cancel(gone, queues)
    refuse_step(_error(OUT_OF_KV, "req_id 'left#1': not enough KV blocks"), step, [], queues)
    assert left.outbox.empty() and list(queues.running) == ["left#1"]
    assert queues.to_free == ["gone#1"]  # it was held: freed next step


def test_a_request_alone_in_a_step_refused_for_kv_is_told_it_outgrew_its_worker() -> None:
    queues = _queues()
    alone = _request("alone")
    _creating(queues, alone)
    step = _decoding(alone)
    refuse_step(_error(OUT_OF_KV, "req_id 'alone#1': not enough KV blocks"), step, [], queues)
    error = alone.outbox.get_nowait()
    assert isinstance(error, ClientError) and error.code is OUT_OF_KV
    assert error.details.startswith("the request outgrew the KV budget of its worker")
    assert "req_id 'alone': not enough KV blocks" in error.details
    assert queues.running == {} and queues.to_free == ["alone#1"]


def test_running_requests_a_step_leaves_out_with_nothing_in_flight_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With nothing in flight every running request has a token to compute: a step that
    schedules none of them means their counts went wrong. The link logs it and restarts
    them from their tokens (freed by that step) instead of waiting for good."""
    import asyncio

    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler
    from mlx_worker_svc.fleet.pipeline import views_of

    async def main() -> tuple[pb.ExecuteRequest, pb.ExecuteRequest, FleetRequest]:
        fleet = FleetScheduler(["127.0.0.1:9"], FleetConfig())  # not started
        [link] = fleet.links
        link.up, link.num_blocks, link.block_size, link.max_seqs = True, 64, 16, 8
        sound = _request("sound")
        _creating(link._queues, sound)
        sound.generated, sound.computed = [9], 3  # prompt computed, one token sampled
        healthy, _ = link._plan(views_of(None, link.running))
        stuck = _request("stuck")
        link.running.clear()
        _creating(link._queues, stuck)
        stuck.generated, stuck.computed = [9], 4  # as if its last token were computed
        stalled, _ = link._plan(views_of(None, link.running))
        return healthy, stalled, stuck

    with caplog.at_level("WARNING", logger="mlx_worker_svc.fleet.link"):
        healthy, stalled, stuck = asyncio.run(main())
    assert "a step planned nothing for its 1 running requests" in caplog.text
    assert "stuck#1 (4, 4)" in caplog.text
    assert dict(healthy.num_scheduled_tokens) == {"sound#1": 1}
    assert list(stalled.finished_req_ids) == ["stuck#1"] and not stalled.num_scheduled_tokens
    assert stuck.phase is Phase.PREEMPTED


def test_out_of_kv_preempts_the_newest_request_the_refused_step_held() -> None:
    """Steps ahead: a later step in flight has started `later` when the step before it
    is refused for KV. Preempting `later` would free nothing on the worker (it holds
    nothing yet), so the same step would be refused again and again: the newest request
    the refused step scheduled goes instead."""
    queues = _queues()
    old, new, later = _request("old"), _request("new"), _request("later")
    _creating(queues, old, new)
    refused = _decoding(old, new)
    _creating(queues, later)  # the next step, in flight
    refuse_step(_error(OUT_OF_KV, "step 2 needs 25 KV blocks"), refused, [], queues)
    assert queues.to_free == ["new#1"] and queues.waiting == [new]
    assert list(queues.running) == ["old#1", "later#1"] and new.phase is Phase.PREEMPTED
    assert old.outbox.empty() and new.outbox.empty() and later.outbox.empty()


def test_a_preempted_request_keeps_its_place_ahead_of_newer_ones_put_back() -> None:
    """Steps ahead: the step after the refused one had started `newer`; refused in turn,
    it puts `newer` back. The preempted request came first and goes first (it was
    queued behind `newer`, and newer requests started while it waited)."""
    queues = _queues()
    old, preempted, newer, newest = (_request(n) for n in ("old", "pre", "newer", "newest"))
    for i, r in enumerate((old, preempted, newer, newest)):
        r.admitted = float(i)
    _creating(queues, old, preempted)
    refused = _decoding(old, preempted)
    started = _creating(queues, newer)  # the next step, in flight
    queues.waiting.append(newest)  # came since, waits
    refuse_step(_error(OUT_OF_KV, "step 2 needs 25 KV blocks"), refused, [], queues)
    assert queues.waiting == [preempted, newest]
    undo_step(started, [newer], queues)  # the step in flight failed behind the refusal
    assert queues.waiting == [preempted, newer, newest]
    assert [r.phase for r in queues.waiting] == [Phase.PREEMPTED, Phase.QUEUED, Phase.QUEUED]
