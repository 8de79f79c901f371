"""The worker: the lifecycle state machine in front of the engine.

Owns the state (NEW → DEVICE_READY → MODEL_LOADED → MEMORY_PROFILED → READY →
SERVING, then DRAINING → STOPPED), the worker epoch, and the engine thread on
which every state change and every MLX call runs, one at a time. A call in the
wrong state fails with FAILED_PRECONDITION naming the call that must come
first. Generate requests are scheduled here, between and inside Execute steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, replace

from mlx_worker_svc.core.domain import (
    CacheConfig,
    DeviceInfo,
    HealthReport,
    KVUsage,
    LoadSpec,
    MemoryProfile,
    MemoryUsage,
    ModelInfo,
    Origin,
    SleepReport,
    StepPlan,
    StepResult,
    WorkerState,
)
from mlx_worker_svc.core.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from mlx_worker_svc.core.lifecycle import DeviceArgs, default_profile_tokens
from mlx_worker_svc.engine.cache import prefix_cache
from mlx_worker_svc.engine.memory import guard as memory_guard
from mlx_worker_svc.engine.model import loader
from mlx_worker_svc.worker.generate import GENERATE_PREFILL_CHUNK, GenerateMixin

S = WorkerState
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MEMORY_UTILIZATION = 0.9
GaveUp = Callable[[], bool] | None
"""Tells a lifecycle call whether its caller left (lifecycle_calls.py)."""


# Upper bounds on lifecycle arguments: past them a call would only exhaust memory.
MAX_BLOCK_SIZE = 1024
MAX_NUM_BLOCKS = 1 << 32
MAX_WARM_UP_SHAPES = 64
MAX_WARM_UP_BATCH = 1024
# MLX takes the memory limit as a size_t; keep clear of its edge.
MAX_MEMORY_LIMIT = 1 << 62


def _check_block_size(block: int, where: str) -> None:
    if not 1 <= block <= MAX_BLOCK_SIZE:
        raise InvalidArgument(f"{where} must be in [1, {MAX_BLOCK_SIZE}], got {block}")


class Worker(GenerateMixin):
    """One model on one device, driven through its lifecycle.

    The five lifecycle calls run one at a time through `LifecycleCalls`
    (lifecycle_calls.py): a repeat while one runs shares its result, any other
    is refused with ABORTED. Each takes `gave_up`, which says whether its caller
    has left, so an abandoned call leaves nothing queued on the engine thread.
    """

    # --------------------------------------------------------- lifecycle
    def init_device(self, args: DeviceArgs, *, gave_up: GaveUp = None) -> DeviceInfo:
        def job() -> DeviceInfo:
            self._require("InitDevice", S.NEW)
            channel = self._replica.channel
            wanted = replace(args, world_size=args.world_size or channel.size)
            device = self._replica.device
            if device is not None:
                if self._device_args is not None and wanted != self._device_args:
                    raise FailedPrecondition(
                        "InitDevice: the device is already initialised, and this call asks "
                        f"for {wanted.differences(self._device_args)}; repeat the first "
                        "call's arguments, or restart the worker to change them"
                    )
                return device
            wanted.check(channel.size, channel.backend)
            device = self._replica.init_device(args.kind)
            self._device_args = wanted
            self._set_state(S.DEVICE_READY)
            return device

        return self._lifecycle.run("InitDevice", asdict(args), job, gave_up=gave_up)

    def load_model(
        self, spec: LoadSpec, *, gave_up: GaveUp = None
    ) -> tuple[loader.LoadedModel, int]:
        def job() -> tuple[loader.LoadedModel, int]:
            self._require("LoadModel", S.DEVICE_READY)
            if self._loaded is not None and spec == self._load_spec:
                return self._loaded, self._epoch
            self._require_idle("LoadModel")
            loaded = self._replica.load(spec)  # raises before anything changes
            self._loaded, self._load_spec = loaded, spec
            self._model_info = loaded.info
            self._chat_template = str(getattr(loaded.tokenizer, "chat_template", "") or "")
            self._runner, self._memory, self._cache_config = None, None, None
            self._new_epoch("restarted or loaded a model")
            self._set_state(S.MODEL_LOADED)
            return loaded, self._epoch

        return self._lifecycle.run("LoadModel", asdict(spec), job, gave_up=gave_up)

    def determine_memory(
        self,
        memory_utilization: float,
        max_num_batched_tokens: int,
        block_size: int,
        *,
        gave_up: GaveUp = None,
    ) -> MemoryProfile:
        """Profiles memory; `max_num_batched_tokens` 0 takes the device's default size."""
        util = memory_utilization or DEFAULT_MEMORY_UTILIZATION
        if not 0 < util <= 1:
            raise InvalidArgument(f"memory_utilization must be in (0, 1], got {util}")
        device, info = self._replica.device, self._model_info
        tokens = max_num_batched_tokens or default_profile_tokens(
            device.kind if device else None, info.max_context_length if info else 0
        )
        block = block_size or DEFAULT_BLOCK_SIZE
        _check_block_size(block, "DetermineMemory.block_size")

        def job() -> MemoryProfile:
            self._require("DetermineMemory", S.MODEL_LOADED)
            loaded = self._need_model()
            if tokens > loaded.info.max_context_length:
                raise InvalidArgument(
                    f"max_num_batched_tokens ({tokens}) exceeds the context length "
                    f"({loaded.info.max_context_length})"
                )
            self._require_idle("DetermineMemory")
            self._memory = self._replica.profile(
                memory_utilization=util,
                max_num_batched_tokens=tokens,
                block_size=block,
            )
            if self._state is S.MODEL_LOADED:
                self._set_state(S.MEMORY_PROFILED)
            return self._memory

        # float32 on the wire: 0.9 sent by a client and the default 0.9 are one call.
        args = {
            "memory_utilization": round(util, 6),
            "max_num_batched_tokens": tokens,
            "block_size": block,
        }
        return self._lifecycle.run("DetermineMemory", args, job, gave_up=gave_up)

    def init_cache(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool | None = None,
        memory_limit_bytes: int = 0,
        gave_up: GaveUp = None,
    ) -> CacheConfig:
        if not 1 <= num_blocks <= MAX_NUM_BLOCKS:
            raise InvalidArgument(f"num_blocks must be in [1, {MAX_NUM_BLOCKS}], got {num_blocks}")
        if block_size:
            _check_block_size(block_size, "InitCache.block_size")

        def job() -> CacheConfig:
            self._require("InitCache", S.MEMORY_PROFILED)
            profile = self._memory
            assert profile is not None
            loaded = self._need_model()
            wanted = prefix_caching is None or prefix_caching
            block = block_size or profile.block_size
            limit = memory_guard.budget_limit(profile, num_blocks, block, memory_limit_bytes)
            config = CacheConfig(
                num_blocks=num_blocks,
                block_size=block,
                prefix_caching=wanted and prefix_cache.supported(loaded.model),
                memory_limit_bytes=min(limit, MAX_MEMORY_LIMIT),
            )
            if self._runner is not None and self._cache_config == config:
                return config
            self._require_idle("InitCache")
            self._runner = self._replica.new_runner(config, profile)
            self._cache_config = config
            if self._state is S.MEMORY_PROFILED:
                self._set_state(S.READY)
            return config

        args = {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "enable_prefix_caching": prefix_caching,
            "memory_limit_bytes": memory_limit_bytes,
        }
        return self._lifecycle.run("InitCache", args, job, gave_up=gave_up)

    def warm_up(
        self, batch_sizes: list[int], prefill_lengths: list[int], *, gave_up: GaveUp = None
    ) -> tuple[int, float]:
        sizes = batch_sizes or [1]
        lengths = prefill_lengths or [16]
        if any(b < 1 for b in sizes) or any(n < 1 for n in lengths):
            raise InvalidArgument("WarmUp batch_sizes and prefill_lengths must all be >= 1")
        if len(sizes) + len(lengths) > MAX_WARM_UP_SHAPES or max(sizes) > MAX_WARM_UP_BATCH:
            raise InvalidArgument(
                f"WarmUp runs at most {MAX_WARM_UP_SHAPES} shapes and batch sizes up to "
                f"{MAX_WARM_UP_BATCH}"
            )

        def job() -> tuple[int, float]:
            self._require("WarmUp", S.READY)
            loaded = self._need_model()
            too_long = [n for n in lengths if n > loaded.info.max_context_length]
            if too_long:
                raise InvalidArgument(f"WarmUp prefill_lengths {too_long} exceed the context")
            start = time.perf_counter()
            shapes = self._replica.warm_up(sizes, lengths)
            self._set_state(S.SERVING)
            return shapes, time.perf_counter() - start

        args = {"batch_sizes": tuple(sizes), "prefill_lengths": tuple(lengths)}
        return self._lifecycle.run("WarmUp", args, job, gave_up=gave_up)

    # ---------------------------------------------------------- stepping
    def execute(self, plan: StepPlan, *, received_ns: int | None = None) -> StepResult:
        """Runs one scheduler step; `received_ns` (perf_counter_ns) starts total_ns."""
        received = received_ns if received_ns is not None else time.perf_counter_ns()
        # Grammars compile here, on the caller's thread; the engine finds them cached.
        self._compile_grammars(
            (
                r.sampling.structured_outputs,
                f"new_requests[{i}] (req_id {r.req_id!r}).sampling_params.structured_outputs",
            )
            for i, r in enumerate(plan.new_requests)
        )
        return self._engine.call(lambda: self._execute(plan, received), bounded=True)

    def _execute(self, plan: StepPlan, received_ns: int) -> StepResult:
        # While draining, steps for requests already running still run, so the
        # scheduler can finish them within the grace period; new ones are refused.
        if not (self._state is S.DRAINING and not plan.new_requests):
            self._require("Execute", S.READY)
        runner = self._need_runner("Execute")
        if plan.worker_epoch != self._epoch:
            why = f"since that epoch the worker {self._epoch_change}"
            if plan.worker_epoch > self._epoch:
                why = "newer than the worker's own, so from another worker or process"
            raise FailedPrecondition(
                f"Execute.worker_epoch {plan.worker_epoch} is stale; the worker's epoch is "
                f"{self._epoch} ({why}): resubmit requests from scratch"
            )
        leaving = sum((Origin.EXECUTE, r) in runner.seqs for r in plan.finished_req_ids)
        self._admit_requests(f"Execute step {plan.step_id}", len(plan.new_requests), leaving)
        work = runner.plan(plan)
        if self._streams:
            internal, _ = runner.internal_work(GENERATE_PREFILL_CHUNK, base=work)
            if internal.scheduled:
                merged = work.merge(internal)
                # Generate requests ride along only if the step still fits.
                with contextlib.suppress(ResourceExhausted):
                    runner.check_memory(merged, f"step {plan.step_id} with Generate requests")
                    work = merged
        outcome = self._run(runner, work)
        outputs = [outcome.outputs[key] for key in work.touched if key[0] is Origin.EXECUTE]
        if self._state is S.READY:
            self._set_state(S.SERVING)
        timings = replace(outcome.timings, total_ns=time.perf_counter_ns() - received_ns)
        return StepResult(plan.step_id, self._epoch, outputs, timings)

    # ------------------------------------------------------------ queries
    def health(self, deep: bool) -> HealthReport:
        deep_ns = 0
        if deep and self._loaded is not None and self._state not in (S.STOPPED, S.SLEEPING):
            deep_ns = self._engine.call(self._replica.deep_check, bounded=True)
        runner = self._runner
        running, preempted = runner.count() if runner else (0, 0)
        dead = self._engine.dead
        return HealthReport(
            state=self._state,
            healthy=dead is None and self._state not in (S.STOPPED,),
            num_running_requests=running,
            num_preempted_requests=preempted,
            kv=self.kv_usage(),
            last_error=repr(dead) if dead else self._last_error,
            worker_epoch=self._epoch,
            deep_check_ns=deep_ns,
            uptime_seconds=time.monotonic() - self._started,
            memory=self.memory_usage(),
            bringing_up=self._lifecycle.bringing_up,
        )

    def kv_nbytes(self, req_id: str) -> int:
        """Bytes the KV buffers of an Execute request take now (0 if unknown)."""
        runner = self._runner
        key = (Origin.EXECUTE, req_id)
        return self._engine.call(lambda: runner.kv_nbytes(key)) if runner else 0

    def memory_usage(self) -> MemoryUsage:
        config = self._cache_config
        return memory_guard.usage(config.memory_limit_bytes if config else 0)

    def kv_usage(self) -> KVUsage:
        runner, config = self._runner, self._cache_config
        if runner is not None:
            return runner.kv_usage()
        if config is not None:  # asleep: the budget stands, nothing is held
            return KVUsage(num_blocks=config.num_blocks, block_size=config.block_size)
        return KVUsage()

    @property
    def device(self) -> DeviceInfo | None:
        """The device (and, in a group, every rank with its share of the weights)."""
        return self._replica.device

    @property
    def model_info(self) -> tuple[ModelInfo | None, str]:
        """The loaded model's facts and chat template (kept while asleep)."""
        return self._model_info, self._chat_template

    # ------------------------------------------------------ sleep, wake up
    def sleep(self, level: int) -> SleepReport:
        """Frees all KV (level 1) and also the weights (level 2); see the proto."""
        if level not in (0, 1, 2):
            raise InvalidArgument(f"Sleep.level must be 1 or 2 (0 means 1), got {level}")
        level = level or 1

        def job() -> SleepReport:
            aborted = 0
            before = memory_guard.usage(0).active_bytes
            if self._state is not S.SLEEPING:
                self._require("Sleep", S.READY)
                aborted = len(self._runner.seqs) if self._runner else 0
                for request_id in self._streams.ids():
                    self._end_stream(
                        request_id, Aborted(f"the worker went to sleep (level {level})")
                    )
                self._runner = None
                self._awake_state = self._state
                self._new_epoch(f"slept (Sleep level {level} aborted every request)")
                self._set_state(S.SLEEPING)
            if level == 2:
                self._loaded = None
            self._sleep_level = max(self._sleep_level, level)
            self._replica.release(model=level == 2)
            freed = max(before - memory_guard.usage(0).active_bytes, 0)
            return SleepReport(S.SLEEPING, self._sleep_level, aborted, freed, self._epoch)

        return self._engine.call(job)

    def wake_up(self) -> tuple[WorkerState, int, float]:
        """Restores what Sleep freed; returns (state, epoch, seconds)."""

        def job() -> tuple[WorkerState, int, float]:
            start = time.perf_counter()
            if self._state is not S.SLEEPING:
                self._require("WakeUp", S.READY)
                return self._state, self._epoch, 0.0
            if self._loaded is None:
                assert self._load_spec is not None
                self._loaded = self._replica.load(self._load_spec)  # raises: still asleep
            assert self._cache_config is not None and self._memory is not None
            self._runner = self._replica.new_runner(self._cache_config, self._memory)
            self._sleep_level = 0
            self._set_state(self._awake_state)
            return self._state, self._epoch, time.perf_counter() - start

        return self._engine.call(job)

    def reset_prefix_cache(self) -> int:
        """Drops the prefix cache; returns the blocks it held."""

        def job() -> int:
            self._require("ResetPrefixCache", S.READY)
            return self._need_runner("ResetPrefixCache").reset_prefix_cache()

        return self._engine.call(job)

    # ------------------------------------------------------------- drain
    def begin_drain(self) -> None:
        """Stops accepting new work; running requests may finish.

        Lifecycle calls are refused from now on and their waiters woken. One
        that is running (a load or a profile, which cannot be interrupted) is
        not waited for: the state turns DRAINING when it ends.
        """

        def job() -> None:
            if self._state is not S.STOPPED:
                self._set_state(S.DRAINING)

        self._lifecycle.close()
        if self._engine.dead is None:
            done = self._engine.submit(job)
            if not self._lifecycle.busy:
                done.result()

    def wait_generate_idle(self, timeout: float) -> bool:
        """Waits until no Generate stream is open; returns whether it got there."""
        return self._streams.wait_empty(timeout)

    def close(self) -> None:
        """Aborts what is left, frees the model and caches, stops the engine.

        Behind a lifecycle call still running it does not wait: there is nothing
        to drain, and the process may exit while the engine thread finishes it.
        """

        def job() -> None:
            for request_id in self._streams.ids():
                self._end_stream(request_id, Aborted("the worker shut down before it finished"))
            if self._runner is not None:
                self._runner.abort_all()
            self._runner = None
            self._loaded = None
            self._replica.close()
            self._set_state(S.STOPPED)

        self._watchdog.stop()
        if self._lifecycle.busy:
            self._engine.submit(job)
            self._engine.stop(timeout=0)
            return
        if self._state is not S.STOPPED and self._engine.dead is None:
            with contextlib.suppress(Unavailable):
                self._engine.call(job)
        self._engine.stop(timeout=10)
        # After an engine death the job above could not run: drop the arrays here.
        self._runner, self._loaded = None, None
        self._set_state(S.STOPPED)
