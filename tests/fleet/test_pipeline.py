"""The pipeline's resync rules, driven directly: which failed replies are undone quietly.

With steps in flight behind a step the worker refused, those later steps fail
too (they counted on the refused step's tokens): the link must plan them again
without failing their requests, and only the first failure is handled as a
failed Execute. The last of them ends the resync.
"""

from __future__ import annotations

from mlx_worker_svc.fleet.pipeline import Pipeline, Sent
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


def _in_flight(pipe: Pipeline, count: int) -> None:
    for step_id in range(count):
        pipe.in_flight.append(Sent(pb.ExecuteRequest(step_id=step_id), []))


def _reply(pipe: Pipeline, failed: bool) -> bool:
    """Takes the oldest step off, as `reply` does, and settles its outcome."""
    pipe.in_flight.popleft()
    return pipe.settled(failed=failed)


def test_the_step_behind_a_failure_is_undone_even_when_it_is_the_last() -> None:
    pipe = Pipeline(ahead=1)
    _in_flight(pipe, 2)
    assert _reply(pipe, failed=True) is False  # the first failure: handled as Execute's
    assert pipe.resyncing and not pipe.room
    assert _reply(pipe, failed=True) is True  # counted on it: planned again, no error
    assert not pipe.resyncing and pipe.room


def test_a_resync_lasts_until_the_last_step_in_flight_is_answered() -> None:
    pipe = Pipeline(ahead=3)
    _in_flight(pipe, 4)
    assert _reply(pipe, failed=True) is False
    assert _reply(pipe, failed=False) is False  # a step that did not depend on it ran
    assert pipe.resyncing
    assert _reply(pipe, failed=True) is True
    assert _reply(pipe, failed=True) is True
    assert not pipe.resyncing


def test_a_failure_with_nothing_behind_it_starts_no_resync() -> None:
    pipe = Pipeline(ahead=1)
    _in_flight(pipe, 1)
    assert _reply(pipe, failed=True) is False
    assert not pipe.resyncing
    _in_flight(pipe, 1)
    assert _reply(pipe, failed=True) is False  # a new first failure, not one behind
