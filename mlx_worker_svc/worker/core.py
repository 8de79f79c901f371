"""The worker's core: its state, the engine thread, and running work on it.

`WorkerCore` holds what every part of the worker shares: the lifecycle state
and epoch, the loaded model, the runner, the Generate streams and the engine
thread on which every state change and every MLX call runs, one at a time
(its idle work is the `GenerateScheduler`'s). The parts take the core:
`lifecycle.Lifecycle` (InitDevice..WarmUp), `sleep_drain.SleepAndDrain` (Sleep, WakeUp,
drain, close), `generate.GenerateCalls`
(the text calls and Generate); `worker.Worker` assembles them with Execute and
the queries. Invariants: the shared state changes only on the engine thread;
engine operations go through a `Replica`, which on rank 0 of a worker group
applies them on every rank (engine/group/replica.py); a broken group ends the
engine the way a dead engine thread does.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from mlx_worker_svc.core.domain import CacheConfig, MemoryProfile, Origin
from mlx_worker_svc.core.errors import FailedPrecondition, Internal, ResourceExhausted, WorkerError
from mlx_worker_svc.core.lifecycle import DeviceArgs, require
from mlx_worker_svc.core.limits import AdmissionLimits
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.core.reports import LoadSpec, ModelInfo, WorkerState
from mlx_worker_svc.core.structured_outputs import StructuredOutputs
from mlx_worker_svc.engine.group.channel import IDLE_POLL, GroupChannel, Watchdog
from mlx_worker_svc.engine.group.replica import Replica
from mlx_worker_svc.engine.memory import device as device_mod
from mlx_worker_svc.engine.memory import guard as memory_guard
from mlx_worker_svc.engine.model import loader
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.engine.runner import ModelRunner, StepOutcome
from mlx_worker_svc.engine.sequence import RequestKey, Work
from mlx_worker_svc.worker.engine_loop import EngineLoop
from mlx_worker_svc.worker.generation import StreamTable
from mlx_worker_svc.worker.lifecycle_calls import LifecycleCalls
from mlx_worker_svc.worker.metrics import WorkerMetrics
from mlx_worker_svc.worker.scheduling import GenerateScheduler

S = WorkerState
# Epochs whose end `WorkerCore.ended_by` remembers.
_REMEMBERED_EPOCHS = 64
log = logging.getLogger(__name__)


class WorkerCore:
    """State shared by the parts of the worker, and the engine thread they run on."""

    def __init__(
        self,
        *,
        on_state: Callable[[WorkerState], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        limits: AdmissionLimits | None = None,
        metrics: WorkerMetrics | None = None,
        group: GroupChannel | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        self._on_state = on_state or (lambda _state: None)
        self._on_death = on_death or (lambda _cause: None)
        self.limits = limits or AdmissionLimits()
        self.metrics = metrics or WorkerMetrics()
        self.steps_run = 0
        """Model steps run so far (Execute steps and Generate-only steps)."""
        self._state = S.NEW
        self.started = time.monotonic()
        self.device_args: DeviceArgs | None = None
        self.replica = Replica(group, options or EngineOptions())
        self.load_spec: LoadSpec | None = None
        self.loaded: loader.LoadedModel | None = None
        self._epoch = 0
        # epoch -> what ended it, for the last _REMEMBERED_EPOCHS epochs (`ended_by`).
        self._ended: OrderedDict[int, str] = OrderedDict()
        self.memory: MemoryProfile | None = None
        self.cache_config: CacheConfig | None = None
        self.runner: ModelRunner | None = None
        # While no runner holds them (asleep): the ids freed lately (set_runner).
        self._freed_lately: list[RequestKey] = []
        self.model_info: ModelInfo | None = None
        # Asleep at level 2: the adapters (name, path, pinned) WakeUp loads again.
        self.asleep_adapters: list[tuple[str, str, bool]] = []
        self.asleep_blocks = 0  # asleep at level 2: the KV budget WakeUp restores
        self.chat_template = ""
        # While SLEEPING: the level, and the state WakeUp returns to.
        self.sleep_level = 0
        self.awake_state = S.READY
        self.streams = StreamTable()
        self.last_error = ""
        self.scheduler = GenerateScheduler(
            self.streams, lambda: self.runner, self.run, self.end_stream
        )
        self.engine = EngineLoop(
            self.scheduler.pending,
            self.scheduler.step,
            on_exit=device_mod.settle_thread,
            on_death=self._engine_died,
            max_queued=self.limits.max_queued_steps,
            # An idle group's followers sleep between rank 0's pings (group.py).
            tick=IDLE_POLL if self.replica.channel.grouped else None,
            on_tick=self.replica.ping,
        )
        self.replica.channel.on_failure = self.engine.fail
        self._lifecycle = LifecycleCalls(self.engine.submit, lambda: (self._state, self._epoch))
        self.watchdog = Watchdog(self.replica.channel)

    def _engine_died(self, cause: BaseException) -> None:
        """The engine thread is gone: end every stream with the cause and stop."""
        error = cause if isinstance(cause, WorkerError) else None
        self.last_error = error.message if error else f"the engine thread died: {cause!r}"
        for request_id in self.streams.ids():
            self.streams.close(request_id, error or Internal(self.last_error))
        self.set_state(S.STOPPED)
        self._on_death(cause)

    @property
    def lifecycle(self) -> LifecycleCalls:
        """The lifecycle call in progress; `claim()` it to bring the worker up alone."""
        return self._lifecycle

    # ------------------------------------------------------------- state
    @property
    def state(self) -> WorkerState:
        return self._state

    @property
    def epoch(self) -> int:
        return self._epoch

    def new_epoch(self, why: str) -> None:
        """A new epoch: no step of the old one can continue (KV or model changed).

        `why` completes "since that epoch, the worker ..." in the stale-epoch error.
        """
        self._ended[self._epoch] = why
        while len(self._ended) > _REMEMBERED_EPOCHS:
            self._ended.popitem(last=False)
        self._epoch = max(time.time_ns(), self._epoch + 1)

    def ended_by(self, epoch: int) -> str:
        """What the worker did that ended `epoch` (the latest change, for one not known)."""
        latest = next(reversed(self._ended.values()), "")
        return self._ended.get(epoch, latest)

    def set_state(self, state: WorkerState) -> None:
        if state is not self._state:
            self._state = state
            self._on_state(state)

    def require(self, call: str, minimum: WorkerState) -> None:
        try:
            require(self._state, call, minimum)
        except FailedPrecondition:
            if not self.lifecycle.bringing_up:
                raise
            raise FailedPrecondition(  # not "call LoadModel first": it takes none meanwhile
                f"{call} needs state {minimum.value} or later; the worker is "
                f"{self._state.value}, bringing itself up (serve --auto-init): wait until "
                "CheckHealth.bringing_up is false"
            ) from None

    def admit_requests(self, call: str, new: int, leaving: int = 0) -> None:
        """Refuses `new` requests that would take the worker past its running limit."""
        live = len(self.runner.state.seqs) if self.runner is not None else 0
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

    def require_idle(self, call: str) -> None:
        if self.runner is not None and self.runner.state.seqs:
            live = len(self.runner.state.seqs)
            what = "1 request is" if live == 1 else f"{live} requests are"
            raise FailedPrecondition(f"{call}: {what} live; finish them first")

    def run(self, runner: ModelRunner, work: Work) -> StepOutcome:
        """Runs work on the engine thread and routes Generate outputs to streams."""
        self.steps_run += 1
        try:
            outcome = runner.run(work)
        except WorkerError:
            raise
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            if memory_guard.is_allocation_failure(exc):
                raise ResourceExhausted(
                    f"the step ran out of memory ({exc}); it was undone and every request "
                    "kept its state: schedule fewer tokens or preempt requests"
                ) from exc
            raise
        self.metrics.observe_step(
            outcome.timings,
            len(work.scheduled),
            sum(len(new.prompt) for new in work.new),
            sum(len(output.sampled_token_ids) for output in outcome.outputs.values()),
        )
        if log.isEnabledFor(logging.DEBUG):
            _log_requests(work, outcome)
        self.streams.dispatch(outcome.outputs)
        if self.state is S.READY:  # a first step, Execute's or Generate's
            self.set_state(S.SERVING)
        return outcome

    def compile_grammars(self, specs: Iterable[tuple[StructuredOutputs | None, str]]) -> None:
        """Compiles structured-output specs into the runner's cache (raises InvalidArgument).

        Runs on the calling (gRPC) thread, so a long compile never stalls the
        engine thread; without a runner yet, the engine thread reports the state.
        """
        runner = self.runner
        if runner is None:
            return
        for spec, where in specs:
            if spec is not None:
                runner.grammars.compile(spec, where)

    def need_model(self, call: str = "") -> loader.LoadedModel:
        """The loaded model; FAILED_PRECONDITION (naming `call`) without one."""
        if self.loaded is None:
            named = f"{call}: " if call else ""
            if self._state is S.SLEEPING:
                raise FailedPrecondition(
                    f"{named}the worker is SLEEPING at level 2 (weights released): "
                    "call WakeUp first"
                )
            raise FailedPrecondition(f"{named}no model is loaded: call LoadModel first")
        return self.loaded

    def set_runner(self, runner: ModelRunner | None) -> None:
        """Replaces the runner (None: none, as asleep). The ids the old one freed
        lately, and those of the requests it held (freed with it), stay remembered
        by the next one: naming them in finished_req_ids stays no error."""
        old = self.runner
        if old is not None:
            self._freed_lately += [*old.state.recently_finished, *old.state.seqs]
        self.runner = runner
        if runner is not None:
            runner.remember_finished(self._freed_lately)
            self._freed_lately = []

    def need_runner(self, call: str) -> ModelRunner:
        if self.runner is None:
            raise FailedPrecondition(f"{call}: the KV cache is not set up: call InitCache first")
        return self.runner

    def end_stream(self, request_id: str, error: WorkerError | None) -> None:
        """Ends a Generate stream (ABORTED when `error` is None) and frees its request."""
        if self.runner is not None:
            self.runner.free((Origin.GENERATE, request_id))
        self.streams.close(request_id, error)


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
            extra = {
                "req_id": clip(req_id),
                "finish_reason": output.finish_reason.value,
                "prompt_tokens": output.prompt_tokens,
                "completion_tokens": output.completion_tokens,
            }
            log.debug("request finished", extra=extra)
