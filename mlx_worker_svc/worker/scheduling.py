"""Generate scheduling: the worker's own steps for its Generate streams.

Generate requests live in the runner beside Execute's, in their own id
space. `GenerateScheduler` decides what runs for them: between scheduler
steps the engine loop runs `step` while `pending` says a stream is open,
and inside an Execute step `ride_along` adds them when the step still fits.
Invariants: it runs only on the engine thread; a Generate step that cannot
fit sheds the youngest stream (with the cause) and never fails the engine
thread; a scheduler's step is never refused because of Generate requests.
It holds no state of its own: the streams and the runner are the core's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from mlx_worker_svc.core.errors import Internal, InvalidArgument, ResourceExhausted, WorkerError
from mlx_worker_svc.engine.runner import ModelRunner, StepOutcome
from mlx_worker_svc.engine.sequence import Work
from mlx_worker_svc.engine.structured import GrammarFailed
from mlx_worker_svc.worker.generation import StreamTable

# Generate prompts are prefilled in chunks of this many tokens per step, so a
# long prompt does not stall the requests decoding beside it.
GENERATE_PREFILL_CHUNK = 512


class GenerateScheduler:
    """Schedules Generate requests on the runner the core holds now."""

    def __init__(
        self,
        streams: StreamTable,
        runner: Callable[[], ModelRunner | None],
        run: Callable[[ModelRunner, Work], StepOutcome],
        end_stream: Callable[[str, WorkerError | None], None],
    ) -> None:
        self._streams = streams
        self._runner = runner  # the core's runner (None before InitCache and while asleep)
        self._run = run
        self._end_stream = end_stream

    def pending(self) -> bool:
        """Whether a Generate step has work (the engine loop then runs `step`)."""
        return bool(self._streams) and self._runner() is not None

    def step(self) -> None:
        """One step of every Generate request that fits, between scheduler steps."""
        runner = self._runner()
        if runner is None or not self._streams:
            return
        work, starved = runner.internal_work(GENERATE_PREFILL_CHUNK)
        if starved:
            youngest = self._streams.ids()[-1]
            self._end_stream(
                youngest,
                ResourceExhausted("the KV budget is full; the request could not continue"),
            )
            return
        if not work.scheduled:
            return
        try:
            runner.check_memory(work, "the Generate step")
            self._run(runner, work)
        except ResourceExhausted as exc:
            # Shed the youngest stream; the others keep their state and retry.
            self._end_stream(self._streams.ids()[-1], exc)
        except GrammarFailed as exc:
            # One request's spec reached a limit of the grammar engine: it ends with
            # the cause; the step was undone, and the others run again next step.
            self._end_stream(exc.key[1], InvalidArgument(exc.detail))
        except Exception as exc:
            # No caller waits on this step: end the streams it carried with the
            # cause instead of letting the engine thread die for all requests.
            for _, request_id in work.scheduled:
                self._end_stream(request_id, Internal(f"Generate step failed: {exc!r}"))

    def ride_along(self, runner: ModelRunner, work: Work, step_id: int) -> Work:
        """A scheduler's validated step with the Generate requests that still fit beside it."""
        if not self._streams:
            return work
        internal, _ = runner.internal_work(GENERATE_PREFILL_CHUNK, base=work)
        if internal.scheduled:
            merged = work.merge(internal)
            # Generate requests ride along only if the step still fits.
            with contextlib.suppress(ResourceExhausted):
                runner.check_memory(merged, f"step {step_id} with Generate requests")
                return merged
        return work
