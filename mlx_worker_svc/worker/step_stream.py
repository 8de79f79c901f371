"""One ExecuteStream on the worker: steps in the order sent, run ahead of their replies.

A `StepStream` submits each step to the engine thread as soon as it arrives,
so while one step's reply is converted and sent, the next step is already
running (and its decode forward, queued by the runner's look-ahead, is on the
device). Every step runs as an Execute call would; the stream adds two rules
(the proto's ExecuteStream comment is the contract):

- A request an earlier step of this stream finished (a `finish_reason`) is
  left out of later steps and reported in `already_finished`: the scheduler
  sent those steps before it saw the finish. A later step's new request under
  the same id is a new request, and runs.
- A failing step changes nothing and is reported in its own reply; later
  steps are checked against the state as it is, so one that counted on the
  failed step's tokens is refused by the usual num_computed_tokens check.

`close()` frees every request the stream created that is still live: the
same request, not another one created since under its id (by unary Execute,
or another stream, after this one's was finished). All state lives on the
engine thread; only `submit` and `close` are called from
elsewhere, and both just queue jobs.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_worker_svc.core.domain import StepPlan, StepResult
from mlx_worker_svc.core.errors import Aborted, Internal, NotFound, WorkerError
from mlx_worker_svc.core.log_format import clip

log = logging.getLogger(__name__)
Submit = Callable[[Callable[[], Any]], "Future[Any]"]

# Ids finished by this stream's steps that are remembered for later steps.
_REMEMBER_FINISHED = 65536


@dataclass
class StreamedStep:
    """What one step of a stream came to: a result or an error, never both."""

    step_id: int
    result: StepResult | None = None
    error: WorkerError | None = None
    already_finished: list[str] = field(default_factory=list)


class StepStream:
    """The state of one ExecuteStream: the requests it created and finished."""

    def __init__(
        self,
        submit: Submit,
        execute: Callable[[StepPlan, int], StepResult],
        free: Callable[[list[str]], None],
        identify: Callable[[str], object | None],
        prepare: Callable[[StepPlan], None] = lambda _plan: None,
    ) -> None:
        """`identify(req_id)`: the live request under that id (any object that is the
        same for as long as the request lives), or None."""
        self._submit = submit
        self._prepare = prepare
        self._execute = execute
        self._free = free
        self._identify = identify
        self._created: dict[str, object] = {}  # req_id -> the request this stream made
        self._finished: OrderedDict[str, None] = OrderedDict()
        # req_id -> the step that was to create it and failed: a live request under
        # the id is not this stream's (another scheduler's), and never runs for it.
        self._uncreated: OrderedDict[str, int] = OrderedDict()
        self._closed = False
        self._close_queued = False

    def submit(self, plan: StepPlan, received_ns: int) -> Future[StreamedStep]:
        """Queues a step behind the stream's earlier ones (and any other engine work).

        `prepare` runs first, on the caller's thread (grammars compile there); an
        error it raises is the step's own.
        """
        try:
            self._prepare(plan)
        except WorkerError as exc:
            return self.refuse(plan.step_id, [new.req_id for new in plan.new_requests], exc)
        future: Future[StreamedStep] = self._submit(lambda: self._run(plan, received_ns))
        return future

    def refuse(
        self, step_id: int, new_ids: Sequence[str], error: WorkerError
    ) -> Future[StreamedStep]:
        """A step refused before it could run (its message did not convert, a grammar
        did not compile): its error comes in order with the others', and the requests
        it was to create count as not created, as for a step that failed running."""

        def refused() -> StreamedStep:
            self._not_created(step_id, new_ids)
            return StreamedStep(step_id, error=error)

        future: Future[StreamedStep] = self._submit(refused)
        return future

    def close(self) -> None:
        """Frees the requests the stream created, after the steps already queued."""
        if not self._close_queued:
            self._close_queued = True
            self._submit(self._end)

    # ----------------------------------------------------- engine thread
    def _run(self, plan: StepPlan, received_ns: int) -> StreamedStep:
        if self._closed:
            return StreamedStep(plan.step_id, error=Aborted("the stream was closed"))
        plan, skipped = self._without_finished(plan)
        step = StreamedStep(plan.step_id, already_finished=skipped)
        try:
            plan, meant = self._without_uncreated(plan)
            step.result = self._execute(plan, received_ns)
        except WorkerError as exc:
            step.error = exc  # the step changed nothing: none was created
            self._not_created(plan.step_id, [new.req_id for new in plan.new_requests])
            return step
        except Exception as exc:  # a bug: reported on this step, the stream goes on
            log.exception("an ExecuteStream step failed with an unexpected error")
            step.error = Internal(f"ExecuteStream: {type(exc).__name__}: {exc}")
            return step
        # Finishes of ids a failed step was to create are done with once a step runs
        # (a step that fails changes nothing: the next try's finish is dropped too).
        for req_id in meant:
            self._uncreated.pop(req_id, None)
        self._record(plan, step.result)
        return step

    def _not_created(self, step_id: int, new_ids: Sequence[str]) -> None:
        # Also under an id this stream's own live request holds: the scheduler counted
        # on an earlier finish of it (one that failed), and means another request.
        for req_id in new_ids:
            self._uncreated[req_id] = step_id
        while len(self._uncreated) > _REMEMBER_FINISHED:
            self._uncreated.popitem(last=False)

    def _without_finished(self, plan: StepPlan) -> tuple[StepPlan, list[str]]:
        """Leaves out the requests an earlier step of the stream finished."""
        done = self._finished
        if not done:
            return plan, []
        # A new request under a finished one's id is another request: it is scheduled,
        # and never reported (the scheduler would drop it); only the finished one's
        # finished or preempted entries go.
        new = {r.req_id for r in plan.new_requests}
        leaving = {r for r in (*plan.finished_req_ids, *plan.preempted_req_ids) if r in done}
        named = [*(c.req_id for c in plan.cached_requests), *plan.num_scheduled_tokens]
        # A live request under the id was made since, by Execute or another stream: it runs.
        gone = {r for r in named if r in done and r not in new and self._identify(r) is None}
        if not gone and not leaving:
            return plan, []
        kept = [(i, c) for i, c in enumerate(plan.cached_requests) if c.req_id not in gone]
        plan = replace(
            plan,
            cached_requests=tuple(c for _, c in kept),
            cached_positions=tuple(plan.cached_position(i) for i, _ in kept),
            num_scheduled_tokens={
                r: n for r, n in plan.num_scheduled_tokens.items() if r not in gone
            },
            grammar_bitmask={r: m for r, m in plan.grammar_bitmask.items() if r not in gone},
            finished_req_ids=tuple(r for r in plan.finished_req_ids if r not in leaving),
            preempted_req_ids=tuple(r for r in plan.preempted_req_ids if r not in leaving),
        )
        return plan, sorted(gone | (leaving - new))

    def _without_uncreated(self, plan: StepPlan) -> tuple[StepPlan, set[str]]:
        """Refuses (NOT_FOUND) a step that schedules a request an earlier failed step of
        this stream was to create; drops such ids from finished_req_ids (the request
        they meant does not exist, and the live one under the id is another's). Also
        returns those ids: the stream forgets them once the step has run (a step that
        fails leaves them remembered, so the scheduler's next try at the finish is
        dropped too)."""
        if not self._uncreated:
            return plan, set()
        new = {r.req_id for r in plan.new_requests}
        for i, cached in enumerate(plan.cached_requests):
            failed = self._uncreated.get(cached.req_id)
            if failed is not None and cached.req_id not in new:
                where = f"cached_requests[{plan.cached_position(i)}]"
                raise NotFound(
                    f"{where} (req_id {clip(cached.req_id)!r}): step {failed} of "
                    "this stream was to create it and failed, so this stream has no such "
                    "request (a live one under the id is not the one the step means)"
                )
        meant = {r for r in plan.finished_req_ids if r in self._uncreated and r not in new}
        # This stream's own request under the id goes: the scheduler finished it once
        # already (the step that failed) and means to be rid of it either way.
        gone = {r for r in meant if not self._is_own(r)}
        if not gone:
            return plan, meant
        kept = tuple(r for r in plan.finished_req_ids if r not in gone)
        return replace(plan, finished_req_ids=kept), meant

    def _is_own(self, req_id: str) -> bool:
        """Whether the live request under `req_id` is one this stream created."""
        made = self._created.get(req_id)
        return made is not None and self._identify(req_id) is made

    def _record(self, plan: StepPlan, result: StepResult) -> None:
        for req_id in plan.finished_req_ids:  # first: a new request may reuse the id
            self._created.pop(req_id, None)
        for new in plan.new_requests:
            made = self._identify(new.req_id)
            if made is not None:
                self._created[new.req_id] = made
            self._finished.pop(new.req_id, None)
            self._uncreated.pop(new.req_id, None)
        for output in result.outputs:
            if output.finish_reason is not None:
                self._created.pop(output.req_id, None)
                self._finished[output.req_id] = None
        while len(self._finished) > _REMEMBER_FINISHED:
            self._finished.popitem(last=False)

    def _end(self) -> None:
        self._closed = True
        mine = sorted(r for r in self._created if self._is_own(r))
        self._created.clear()
        if mine:
            self._free(mine)
