"""The worker: one model on one device, assembled from its parts.

`Worker` is what the RPC layer calls. It builds a `WorkerCore` (the shared
state, the engine thread and Generate scheduling) and the parts that take
it: `Lifecycle` (InitDevice..WarmUp, Sleep, WakeUp, drain, close; its way-up
calls one at a time through the core's `LifecycleCalls`) and
`GenerateCalls` (Tokenize, Detokenize, Generate), `AdapterCalls` (AddLora,
RemoveLora, PinLora, ListLoras) and `Queries` (CheckHealth, KV and memory
usage); it runs Execute steps and starts and stops profiles
(engine/profiler.py, with `profile_dir`) itself. Invariants: every state change and every MLX
call runs on the engine thread, one at a time; the queries (CheckHealth,
metrics) read copies and never wait for a step, except a deep check.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from mlx_worker_svc.core.adapters import AdapterAdded, AdapterInfo
from mlx_worker_svc.core.domain import (
    CacheConfig,
    KVUsage,
    MemoryProfile,
    Origin,
    StepPlan,
    StepResult,
)
from mlx_worker_svc.core.errors import CallerGone, FailedPrecondition, InvalidArgument
from mlx_worker_svc.core.generate import ChatMessage, GenerateChunk, GenerateSpec
from mlx_worker_svc.core.lifecycle import DeviceArgs
from mlx_worker_svc.core.limits import AdmissionLimits
from mlx_worker_svc.core.profiling import (
    ProfileReport,
    ProfileSort,
    ProfileStarted,
    check_label,
    check_top,
)
from mlx_worker_svc.core.reports import (
    DeviceInfo,
    HealthReport,
    LoadSpec,
    MemoryUsage,
    ModelInfo,
    SleepReport,
    WakeReport,
    WorkerState,
)
from mlx_worker_svc.engine.group.channel import GroupChannel
from mlx_worker_svc.engine.model import loader
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.engine.profiler import EngineProfiler
from mlx_worker_svc.engine.structured import GrammarFailed
from mlx_worker_svc.worker.adapters import AdapterCalls
from mlx_worker_svc.worker.core import WorkerCore
from mlx_worker_svc.worker.generate import GenerateCalls
from mlx_worker_svc.worker.lifecycle import GaveUp, Lifecycle
from mlx_worker_svc.worker.lifecycle_calls import LifecycleCalls
from mlx_worker_svc.worker.metrics import WorkerMetrics
from mlx_worker_svc.worker.queries import Queries
from mlx_worker_svc.worker.sleep_drain import SleepAndDrain
from mlx_worker_svc.worker.step_stream import StepStream

S = WorkerState
log = logging.getLogger(__name__)


class Worker:
    """One model on one device, driven through its lifecycle."""

    def __init__(
        self,
        *,
        on_state: Callable[[WorkerState], None] | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        limits: AdmissionLimits | None = None,
        metrics: WorkerMetrics | None = None,
        group: GroupChannel | None = None,
        options: EngineOptions | None = None,
        profile_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.core = WorkerCore(
            on_state=on_state,
            on_death=on_death,
            limits=limits,
            metrics=metrics,
            group=group,
            options=options,
        )
        self.states = Lifecycle(self.core)
        self.down = SleepAndDrain(self.core)
        self.text = GenerateCalls(self.core)
        self.adapters = AdapterCalls(self.core)
        self.profiler = EngineProfiler(profile_dir) if profile_dir is not None else None
        self.queries = Queries(self.core)

    # ------------------------------------------------------------- facts
    @property
    def state(self) -> WorkerState:
        return self.core.state

    @property
    def epoch(self) -> int:
        return self.core.epoch

    @property
    def limits(self) -> AdmissionLimits:
        return self.core.limits

    @property
    def metrics(self) -> WorkerMetrics:
        return self.core.metrics

    @property
    def steps_run(self) -> int:
        """Model steps run so far (Execute steps and Generate-only steps)."""
        return self.core.steps_run

    @property
    def queued_steps(self) -> int:
        """Execute steps and Generate starts waiting for the engine thread."""
        return self.core.engine.queued

    @property
    def engine_dead(self) -> BaseException | None:
        """Why the engine thread died, or None while it runs."""
        return self.core.engine.dead

    @property
    def lifecycle(self) -> LifecycleCalls:
        """The lifecycle call in progress; `claim()` it to bring the worker up alone."""
        return self.core.lifecycle

    # --------------------------------------------------- lifecycle calls
    def init_device(self, args: DeviceArgs, *, gave_up: GaveUp = None) -> DeviceInfo:
        return self.states.init_device(args, gave_up=gave_up)

    def check_state(self, call: str) -> None:
        """FAILED_PRECONDITION (UNAVAILABLE while draining) for Generate or Tokenize in a
        state that does not take it, before their fields are read: a call in the wrong
        state is told the state, whatever it carries."""
        if call == "Generate":
            self.core.require(call, WorkerState.READY)
        else:
            self.text.require_tokenizer(call)

    def load_model(
        self, spec: LoadSpec, *, gave_up: GaveUp = None
    ) -> tuple[loader.LoadedModel, int]:
        return self.states.load_model(spec, gave_up=gave_up)

    def determine_memory(
        self,
        memory_utilization: float,
        max_num_batched_tokens: int,
        block_size: int,
        *,
        kv_bits: int = 0,
        kv_group_size: int = 0,
        gave_up: GaveUp = None,
    ) -> MemoryProfile:
        """Profiles memory; `max_num_batched_tokens` 0 takes the device's default size."""
        return self.states.determine_memory(
            memory_utilization,
            max_num_batched_tokens,
            block_size,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            gave_up=gave_up,
        )

    def init_cache(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool | None = None,
        memory_limit_bytes: int = 0,
        kv_bits: int = 0,
        kv_group_size: int = 0,
        gave_up: GaveUp = None,
    ) -> CacheConfig:
        return self.states.init_cache(
            num_blocks,
            block_size,
            prefix_caching=prefix_caching,
            memory_limit_bytes=memory_limit_bytes,
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            gave_up=gave_up,
        )

    def warm_up(
        self, batch_sizes: list[int], prefill_lengths: list[int], *, gave_up: GaveUp = None
    ) -> tuple[int, float]:
        return self.states.warm_up(batch_sizes, prefill_lengths, gave_up=gave_up)

    def sleep(self, level: int) -> SleepReport:
        return self.down.sleep(level)

    def wake_up(self) -> WakeReport:
        return self.down.wake_up()

    def reset_prefix_cache(self) -> int:
        return self.down.reset_prefix_cache()

    def begin_drain(self) -> None:
        self.down.begin_drain()

    def wait_idle(self, timeout: float) -> bool:
        return self.down.wait_idle(timeout)

    def close(self) -> None:
        self.down.close()

    # -------------------------------------------------------- text calls
    def tokenize_text(self, value: str, add_special_tokens: bool) -> list[int]:
        return self.text.tokenize_text(value, add_special_tokens)

    def tokenize_chat(
        self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool, tools_json: str = ""
    ) -> tuple[list[int], str]:
        return self.text.tokenize_chat(messages, add_generation_prompt, tools_json)

    def detokenize(
        self, ids: list[int], skip_special_tokens: bool, *, token_bytes: bool = False
    ) -> tuple[str, list[bytes]]:
        return self.text.detokenize(ids, skip_special_tokens, token_bytes=token_bytes)

    def generate(self, spec: GenerateSpec) -> tuple[Iterator[GenerateChunk], Callable[[], None]]:
        """Starts a Generate request; returns its chunk iterator and a cancel."""
        return self.text.generate(spec)

    # ---------------------------------------------------------- stepping
    def execute(
        self, plan: StepPlan, *, received_ns: int | None = None, gave_up: GaveUp = None
    ) -> StepResult:
        """Runs one scheduler step; `received_ns` (perf_counter_ns) starts total_ns.

        A step whose caller left (`gave_up`: its deadline passed, it cancelled) while it
        waited for the engine thread does not run: the scheduler saw it fail.
        """
        received = received_ns if received_ns is not None else time.perf_counter_ns()
        # At once, on the caller's thread: a step in the wrong state (the worker bringing
        # itself up, say) is not queued behind a lifecycle call that holds the engine.
        self._check_state(plan)
        self._compile_grammars(plan)

        def job() -> StepResult:
            if gave_up is not None and gave_up():
                raise CallerGone(f"Execute step {plan.step_id}: the caller left before it ran")
            return self._execute(plan, received)

        return self.core.engine.call(job, bounded=True)

    def open_step_stream(self) -> StepStream:
        """The worker side of one ExecuteStream (step_stream.py)."""
        return StepStream(
            self.core.engine.submit,
            self._execute,
            self._free_execute,
            self._live_execute,
            self._compile_grammars,
        )

    def _compile_grammars(self, plan: StepPlan) -> None:
        """Grammars compile on the caller's thread; the engine finds them cached."""
        self.core.compile_grammars(
            (
                r.sampling.structured_outputs,
                f"new_requests[{i}] (req_id {r.req_id!r}).sampling_params.structured_outputs",
            )
            for i, r in enumerate(plan.new_requests)
        )

    def _free_execute(self, req_ids: list[str]) -> None:
        runner = self.core.runner
        if runner is not None:
            for req_id in req_ids:
                runner.free((Origin.EXECUTE, req_id))

    def _live_execute(self, req_id: str) -> object | None:
        """The Execute request live under `req_id` (its Sequence), or None."""
        runner = self.core.runner
        return None if runner is None else runner.state.seqs.get((Origin.EXECUTE, req_id))

    def _check_state(self, plan: StepPlan) -> None:
        # While draining, steps for requests already running still run, so the
        # scheduler can finish them within the grace period; new ones are refused.
        if not (self.core.state is S.DRAINING and not plan.new_requests):
            self.core.require("Execute", S.READY)

    def _execute(self, plan: StepPlan, received_ns: int) -> StepResult:
        core = self.core
        self._check_state(plan)
        runner = core.need_runner("Execute")
        if plan.worker_epoch != core.epoch:
            why = f"since that epoch the worker {core.ended_by(plan.worker_epoch)}"
            if plan.worker_epoch == int(float(core.epoch)):  # exactly what a double keeps
                why = (
                    "the worker's own rounded to a double, as a JavaScript Number rounds it: "
                    "send uint64s as strings (JSON) or 64-bit integers"
                )
            elif plan.worker_epoch > core.epoch:
                why = "newer than the worker's own, so from another worker or process"
            raise FailedPrecondition(
                f"Execute.worker_epoch {plan.worker_epoch} is stale; the worker's epoch is "
                f"{core.epoch} ({why}): resubmit requests from scratch"
            )
        leaving = sum((Origin.EXECUTE, r) in runner.state.seqs for r in plan.finished_req_ids)
        core.admit_requests(f"Execute step {plan.step_id}", len(plan.new_requests), leaving)
        while True:
            work = core.scheduler.ride_along(runner, runner.plan(plan), plan.step_id)
            try:
                outcome = core.run(runner, work)
                break
            except GrammarFailed as exc:
                if exc.key[0] is not Origin.GENERATE:
                    raise
                # A Generate request riding along failed on its own grammar: the step
                # was undone; that request ends with the cause and the step runs again.
                core.end_stream(exc.key[1], InvalidArgument(exc.detail))
        outputs = [outcome.outputs[key] for key in work.touched if key[0] is Origin.EXECUTE]
        timings = replace(outcome.timings, total_ns=time.perf_counter_ns() - received_ns)
        return StepResult(plan.step_id, core.epoch, outputs, timings)

    # ----------------------------------------------------------- adapters
    def add_lora(self, name: str, path: str) -> AdapterAdded:
        return self.adapters.add(name, path)

    def remove_lora(self, name: str) -> str:
        return self.adapters.remove(name)

    def pin_lora(self, name: str, *, pinned: bool) -> AdapterInfo:
        return self.adapters.pin(name, pinned)

    def list_loras(self) -> tuple[list[AdapterInfo], int]:
        return self.adapters.list()

    # ---------------------------------------------------------- profiling
    def start_profile(self, label: str, gpu_capture: bool) -> ProfileStarted:
        """Starts profiling the engine thread (in a group: rank 0's, which drives the rest)."""
        profiler = self._need_profiler("StartProfile")
        label = check_label(label)
        started = self.core.engine.call(lambda: profiler.start(label, gpu_capture))
        log.info("profile started", extra={"label": label, "path": started.path})
        return started

    def stop_profile(self, top_entries: int, sort: ProfileSort) -> ProfileReport:
        """Stops the running profile, writes it and returns its top entries."""
        profiler = self._need_profiler("StopProfile")
        top = check_top(top_entries)
        report = self.core.engine.call(profiler.stop).report(top, sort)
        log.info("profile written", extra={"label": report.label, "path": report.path})
        return report

    def _need_profiler(self, call: str) -> EngineProfiler:
        if self.profiler is None:
            raise FailedPrecondition(
                f"{call}: profiling is off; start the worker with --profile-dir DIR "
                "(the directory the profiles are written to) to turn it on"
            )
        return self.profiler

    # ------------------------------------------------------------ queries
    def health(self, deep: bool) -> HealthReport:
        return self.queries.health(deep)

    def kv_nbytes(self, req_id: str) -> int:
        """Bytes the KV buffers of an Execute request take now (0 if unknown)."""
        return self.queries.kv_nbytes(req_id)

    def memory_usage(self) -> MemoryUsage:
        return self.queries.memory_usage()

    def kv_usage(self) -> KVUsage:
        return self.queries.kv_usage()

    @property
    def device(self) -> DeviceInfo | None:
        """The device (and, in a group, every rank with its share of the weights)."""
        return self.core.replica.device

    @property
    def model_info(self) -> tuple[ModelInfo | None, str]:
        """The loaded model's facts and chat template (kept while asleep)."""
        return self.core.model_info, self.core.chat_template
