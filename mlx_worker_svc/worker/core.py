"""The worker's core: its state, the engine thread, and running work on it.

`WorkerCore` holds what every part of the worker shares: the lifecycle state
and epoch, the loaded model, the runner, the Generate streams and the engine
thread on which every state change and every MLX call runs, one at a time.
`worker.Worker` adds the lifecycle calls, `worker_generate.GenerateMixin`
the text calls and Generate. Engine operations go through a `Replica`, which
on rank 0 of a worker group applies them on every rank (engine/group/replica.py); a
broken group ends the engine the way a dead engine thread does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from mlx_worker_svc.core.domain import (
    CacheConfig,
    LoadSpec,
    MemoryProfile,
    ModelInfo,
    Origin,
    StructuredOutputs,
    WorkerState,
)
from mlx_worker_svc.core.errors import FailedPrecondition, Internal, ResourceExhausted, WorkerError
from mlx_worker_svc.core.lifecycle import DeviceArgs, require
from mlx_worker_svc.core.limits import AdmissionLimits
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.engine.group.channel import IDLE_POLL, GroupChannel, Watchdog
from mlx_worker_svc.engine.group.replica import Replica
from mlx_worker_svc.engine.memory import device as device_mod
from mlx_worker_svc.engine.memory import guard as memory_guard
from mlx_worker_svc.engine.model import loader
from mlx_worker_svc.engine.runner import ModelRunner, StepOutcome
from mlx_worker_svc.engine.sequence import Work
from mlx_worker_svc.worker.engine_loop import EngineLoop
from mlx_worker_svc.worker.generation import StreamTable
from mlx_worker_svc.worker.lifecycle_calls import LifecycleCalls
from mlx_worker_svc.worker.metrics import WorkerMetrics

S = WorkerState
log = logging.getLogger(__name__)


class WorkerCore:
    """State shared by the parts of the worker."""

    def __init__(
        self,
        *,
        on_state: Callable[[WorkerState], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        limits: AdmissionLimits | None = None,
        metrics: WorkerMetrics | None = None,
        group: GroupChannel | None = None,
    ) -> None:
        self._on_state = on_state or (lambda _state: None)
        self._on_death = on_death or (lambda _cause: None)
        self.limits = limits or AdmissionLimits()
        self.metrics = metrics or WorkerMetrics()
        self.steps_run = 0
        """Model steps run so far (Execute steps and Generate-only steps)."""
        self._state = S.NEW
        self._started = time.monotonic()
        self._device_args: DeviceArgs | None = None
        self._replica = Replica(group)
        self._load_spec: LoadSpec | None = None
        self._loaded: loader.LoadedModel | None = None
        self._epoch = 0
        self._epoch_change = ""
        self._memory: MemoryProfile | None = None
        self._cache_config: CacheConfig | None = None
        self._runner: ModelRunner | None = None
        self._model_info: ModelInfo | None = None
        self._chat_template = ""
        # While SLEEPING: the level, and the state WakeUp returns to.
        self._sleep_level = 0
        self._awake_state = S.READY
        self._streams = StreamTable()
        self._last_error = ""
        self._engine = EngineLoop(
            self._generate_pending,
            self._generate_step,
            on_exit=device_mod.settle_thread,
            on_death=self._engine_died,
            max_queued=self.limits.max_queued_steps,
            # An idle group's followers sleep between rank 0's pings (group.py).
            tick=IDLE_POLL if self._replica.channel.grouped else None,
            on_tick=self._replica.ping,
        )
        self._replica.channel.on_failure = self._engine.fail
        self._lifecycle = LifecycleCalls(self._engine.submit, lambda: (self._state, self._epoch))
        self._watchdog = Watchdog(self._replica.channel)

    def _engine_died(self, cause: BaseException) -> None:
        """The engine thread is gone: end every stream with the cause and stop."""
        error = cause if isinstance(cause, WorkerError) else None
        self._last_error = error.message if error else f"the engine thread died: {cause!r}"
        for request_id in self._streams.ids():
            self._streams.close(request_id, error or Internal(self._last_error))
        self._set_state(S.STOPPED)
        self._on_death(cause)

    @property
    def queued_steps(self) -> int:
        """Execute steps and Generate starts waiting for the engine thread."""
        return self._engine.queued

    @property
    def lifecycle(self) -> LifecycleCalls:
        """The lifecycle call in progress; `claim()` it to bring the worker up alone."""
        return self._lifecycle

    @property
    def engine_dead(self) -> BaseException | None:
        """Why the engine thread died, or None while it runs."""
        return self._engine.dead

    # Scheduling Generate requests (worker_generate.GenerateMixin).
    def _generate_pending(self) -> bool:
        raise NotImplementedError

    def _generate_step(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------- state
    @property
    def state(self) -> WorkerState:
        return self._state

    @property
    def epoch(self) -> int:
        return self._epoch

    def _new_epoch(self, why: str) -> None:
        """A new epoch: no step of the old one can continue (KV or model changed).

        `why` completes "since that epoch, the worker ..." in the stale-epoch error.
        """
        self._epoch = max(time.time_ns(), self._epoch + 1)
        self._epoch_change = why

    def _set_state(self, state: WorkerState) -> None:
        if state is not self._state:
            self._state = state
            self._on_state(state)

    def _require(self, call: str, minimum: WorkerState) -> None:
        require(self._state, call, minimum)

    def _admit_requests(self, call: str, new: int, leaving: int = 0) -> None:
        """Refuses `new` requests that would take the worker past its running limit."""
        live = len(self._runner.seqs) if self._runner is not None else 0
        limit = self.limits.max_running_requests
        if new and live - leaving + new > limit:
            beside = f"{live} live" + (f", {leaving} leaving" if leaving else "")
            plural = "s" if new != 1 else ""
            raise ResourceExhausted(
                f"{call} would start {new} new request{plural} beside {beside}: "
                f"{live - leaving + new} in all, over the limit of {limit} live requests "
                f"(--max-running-requests); send at most {max(limit - live + leaving, 0)} now, "
                "retry later or use another worker"
            )

    def _require_idle(self, call: str) -> None:
        if self._runner is not None and self._runner.seqs:
            raise FailedPrecondition(
                f"{call}: {len(self._runner.seqs)} requests are live; finish them first"
            )

    def _run(self, runner: ModelRunner, work: Work) -> StepOutcome:
        """Runs work on the engine thread and routes Generate outputs to streams."""
        self.steps_run += 1
        try:
            outcome = runner.run(work)
        except WorkerError:
            raise
        except Exception as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            if memory_guard.is_allocation_failure(exc):
                raise ResourceExhausted(
                    f"the step ran out of memory ({exc}); it was undone and every request "
                    "kept its state: schedule fewer tokens or preempt requests"
                ) from exc
            raise
        self.metrics.observe_step(
            outcome.timings, len(work.scheduled), sum(len(new.prompt) for new in work.new)
        )
        if log.isEnabledFor(logging.DEBUG):
            _log_requests(work, outcome)
        self._streams.dispatch(outcome.outputs)
        return outcome

    def _compile_grammars(self, specs: Iterable[tuple[StructuredOutputs | None, str]]) -> None:
        """Compiles structured-output specs into the runner's cache (raises InvalidArgument).

        Runs on the calling (gRPC) thread, so a long compile never stalls the
        engine thread; without a runner yet, the engine thread reports the state.
        """
        runner = self._runner
        if runner is None:
            return
        for spec, where in specs:
            if spec is not None:
                runner.grammars.compile(spec, where)

    def _need_model(self) -> loader.LoadedModel:
        if self._loaded is None:
            if self._state is S.SLEEPING:
                raise FailedPrecondition(
                    "the worker is SLEEPING at level 2 (weights released): call WakeUp first"
                )
            raise FailedPrecondition("no model is loaded: call LoadModel first")
        return self._loaded

    def _need_runner(self, call: str) -> ModelRunner:
        if self._runner is None:
            raise FailedPrecondition(f"{call}: the KV cache is not set up: call InitCache first")
        return self._runner

    def _end_stream(self, request_id: str, error: WorkerError | None) -> None:
        if self._runner is not None:
            self._runner.free((Origin.GENERATE, request_id))
        self._streams.close(request_id, error)


def _log_requests(work: Work, outcome: StepOutcome) -> None:
    """Debug lines for the Execute requests a step admitted, freed or finished.

    Generate requests log their own lines (generation.py); Execute requests
    belong to a scheduler, which logs them, so here they are DEBUG only.
    """
    for new in work.new:
        log.debug(
            "request admitted", extra={"req_id": clip(new.key[1]), "prompt_tokens": len(new.prompt)}
        )
    for key in work.preempted:
        log.debug("request preempted", extra={"req_id": clip(key[1])})
    for key in work.finished:
        log.debug("request freed by the scheduler", extra={"req_id": clip(key[1])})
    for (origin, req_id), output in outcome.outputs.items():
        if origin is Origin.EXECUTE and output.finish_reason is not None:
            extra = {"req_id": clip(req_id), "finish_reason": output.finish_reason.value}
            log.debug("request finished", extra=extra)
