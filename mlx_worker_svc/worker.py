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
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

from mlx_worker_svc.domain import (
    ChatMessage,
    DeviceInfo,
    GenerateChunk,
    GenerateSpec,
    HealthReport,
    KVUsage,
    LoadSpec,
    MemoryProfile,
    Origin,
    StepPlan,
    StepResult,
    WorkerState,
)
from mlx_worker_svc.engine import device as device_mod
from mlx_worker_svc.engine import loader, memory, text
from mlx_worker_svc.engine.kv_budget import KVBudget
from mlx_worker_svc.engine.runner import ModelRunner, StepOutcome
from mlx_worker_svc.engine.sequence import Work
from mlx_worker_svc.engine_loop import EngineLoop
from mlx_worker_svc.errors import (
    Aborted,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
    WorkerError,
)
from mlx_worker_svc.generation import GenerateStream, StreamTable
from mlx_worker_svc.lifecycle import DeviceArgs, require

S = WorkerState
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_BATCHED_TOKENS = 2048
DEFAULT_MEMORY_UTILIZATION = 0.9
# Generate prompts are prefilled in chunks of this many tokens per step, so a
# long prompt does not stall the requests decoding beside it.
GENERATE_PREFILL_CHUNK = 512


class Worker:
    """One model on one device, driven through its lifecycle."""

    def __init__(self, *, on_state: Callable[[WorkerState], None] | None = None) -> None:
        self._on_state = on_state or (lambda _state: None)
        self._state = S.NEW
        self._started = time.monotonic()
        self._device_args: DeviceArgs | None = None
        self._device: DeviceInfo | None = None
        self._load_spec: LoadSpec | None = None
        self._loaded: loader.LoadedModel | None = None
        self._epoch = 0
        self._memory: MemoryProfile | None = None
        self._runner: ModelRunner | None = None
        self._streams = StreamTable()
        self._last_error = ""
        self._engine = EngineLoop(
            self._generate_pending, self._generate_step, on_exit=device_mod.settle_thread
        )

    # ------------------------------------------------------------- state
    @property
    def state(self) -> WorkerState:
        return self._state

    @property
    def epoch(self) -> int:
        return self._epoch

    def _set_state(self, state: WorkerState) -> None:
        if state is not self._state:
            self._state = state
            self._on_state(state)

    def _require(self, call: str, minimum: WorkerState) -> None:
        require(self._state, call, minimum)

    def _require_idle(self, call: str) -> None:
        if self._runner is not None and self._runner.seqs:
            raise FailedPrecondition(
                f"{call}: {len(self._runner.seqs)} requests are live; finish them first"
            )

    # --------------------------------------------------------- lifecycle
    def init_device(self, args: DeviceArgs) -> DeviceInfo:
        def job() -> DeviceInfo:
            self._require("InitDevice", S.NEW)
            if args.world_size > 1:
                raise Unimplemented(
                    "InitDevice.world_size > 1 needs worker groups over mx.distributed, "
                    "which are not built yet"
                )
            if self._device is not None:
                if args != self._device_args:
                    raise FailedPrecondition(
                        "InitDevice: the device is already initialised with different "
                        "arguments; restart the worker to change it"
                    )
                return self._device
            self._device = device_mod.init_device(
                args.kind, rank=args.rank, local_rank=args.local_rank, world_size=1
            )
            self._device_args = args
            self._set_state(S.DEVICE_READY)
            return self._device

        return self._engine.call(job)

    def load_model(self, spec: LoadSpec) -> tuple[loader.LoadedModel, int]:
        def job() -> tuple[loader.LoadedModel, int]:
            self._require("LoadModel", S.DEVICE_READY)
            if self._loaded is not None and spec == self._load_spec:
                return self._loaded, self._epoch
            self._require_idle("LoadModel")
            loaded = loader.load(spec)  # raises before anything changes
            self._loaded, self._load_spec = loaded, spec
            self._runner, self._memory = None, None
            self._epoch = max(time.time_ns(), self._epoch + 1)
            self._set_state(S.MODEL_LOADED)
            return loaded, self._epoch

        return self._engine.call(job)

    def determine_memory(
        self, memory_utilization: float, max_num_batched_tokens: int, block_size: int
    ) -> MemoryProfile:
        util = memory_utilization or DEFAULT_MEMORY_UTILIZATION
        if not 0 < util <= 1:
            raise InvalidArgument(f"memory_utilization must be in (0, 1], got {util}")
        tokens = max_num_batched_tokens or DEFAULT_MAX_BATCHED_TOKENS
        block = block_size or DEFAULT_BLOCK_SIZE

        def job() -> MemoryProfile:
            self._require("DetermineMemory", S.MODEL_LOADED)
            loaded = self._need_model()
            if tokens > loaded.info.max_context_length:
                raise InvalidArgument(
                    f"max_num_batched_tokens ({tokens}) exceeds the context length "
                    f"({loaded.info.max_context_length})"
                )
            self._require_idle("DetermineMemory")
            self._memory = memory.profile(
                loaded.model,
                loaded.info,
                memory_utilization=util,
                max_num_batched_tokens=tokens,
                block_size=block,
            )
            if self._state is S.MODEL_LOADED:
                self._set_state(S.MEMORY_PROFILED)
            return self._memory

        return self._engine.call(job)

    def init_cache(self, num_blocks: int, block_size: int) -> KVBudget:
        if num_blocks < 1:
            raise InvalidArgument(f"num_blocks must be >= 1, got {num_blocks}")

        def job() -> KVBudget:
            self._require("InitCache", S.MEMORY_PROFILED)
            assert self._memory is not None
            budget = KVBudget(num_blocks, block_size or self._memory.block_size)
            if self._runner is not None and self._runner.budget == budget:
                return budget
            self._require_idle("InitCache")
            self._runner = ModelRunner(self._need_model(), budget)
            if self._state is S.MEMORY_PROFILED:
                self._set_state(S.READY)
            return budget

        return self._engine.call(job)

    def warm_up(self, batch_sizes: list[int], prefill_lengths: list[int]) -> tuple[int, float]:
        sizes = batch_sizes or [1]
        lengths = prefill_lengths or [16]
        if any(b < 1 for b in sizes) or any(n < 1 for n in lengths):
            raise InvalidArgument("WarmUp batch_sizes and prefill_lengths must all be >= 1")

        def job() -> tuple[int, float]:
            self._require("WarmUp", S.READY)
            loaded = self._need_model()
            too_long = [n for n in lengths if n > loaded.info.max_context_length]
            if too_long:
                raise InvalidArgument(f"WarmUp prefill_lengths {too_long} exceed the context")
            start = time.perf_counter()
            shapes = memory.warm_up(loaded.model, sizes, lengths)
            self._set_state(S.SERVING)
            return shapes, time.perf_counter() - start

        return self._engine.call(job)

    # ---------------------------------------------------------- stepping
    def execute(self, plan: StepPlan, *, received_ns: int | None = None) -> StepResult:
        """Runs one scheduler step; `received_ns` (perf_counter_ns) starts total_ns."""
        received = received_ns if received_ns is not None else time.perf_counter_ns()
        return self._engine.call(lambda: self._execute(plan, received))

    def _execute(self, plan: StepPlan, received_ns: int) -> StepResult:
        # While draining, steps for requests already running still run, so the
        # scheduler can finish them within the grace period; new ones are refused.
        if not (self._state is S.DRAINING and not plan.new_requests):
            self._require("Execute", S.READY)
        runner = self._need_runner("Execute")
        if plan.worker_epoch != self._epoch:
            raise FailedPrecondition(
                f"Execute.worker_epoch {plan.worker_epoch} is stale; the worker's epoch is "
                f"{self._epoch} (it restarted or reloaded): resubmit requests from scratch"
            )
        work = runner.plan(plan)
        if self._streams:
            internal, _ = runner.internal_work(GENERATE_PREFILL_CHUNK, base=work)
            work = work.merge(internal)
        outcome = self._run(runner, work)
        outputs = [outcome.outputs[key] for key in work.touched if key[0] is Origin.EXECUTE]
        if self._state is S.READY:
            self._set_state(S.SERVING)
        timings = replace(outcome.timings, total_ns=time.perf_counter_ns() - received_ns)
        return StepResult(plan.step_id, self._epoch, outputs, timings)

    def _run(self, runner: ModelRunner, work: Work) -> StepOutcome:
        """Runs work on the engine thread and routes Generate outputs to streams."""
        try:
            outcome = runner.run(work)
        except WorkerError:
            raise
        except Exception as exc:
            self._last_error = f"{type(exc).__name__}: {exc}"
            raise
        self._streams.dispatch(outcome.outputs)
        return outcome

    # ------------------------------------------------------------ queries
    def health(self, deep: bool) -> HealthReport:
        deep_ns = 0
        if deep and self._loaded is not None and self._state not in (S.STOPPED, S.SLEEPING):
            model = self._loaded.model
            deep_ns = self._engine.call(lambda: memory.deep_check(model))
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
        )

    def kv_usage(self) -> KVUsage:
        runner = self._runner
        return runner.kv_usage() if runner else KVUsage()

    @property
    def device(self) -> DeviceInfo | None:
        return self._device

    @property
    def loaded(self) -> loader.LoadedModel | None:
        return self._loaded

    def _need_model(self) -> loader.LoadedModel:
        if self._loaded is None:
            raise FailedPrecondition("no model is loaded: call LoadModel first")
        return self._loaded

    def _need_runner(self, call: str) -> ModelRunner:
        if self._runner is None:
            raise FailedPrecondition(f"{call}: the KV cache is not set up: call InitCache first")
        return self._runner

    def tokenize_text(self, value: str, add_special_tokens: bool) -> list[int]:
        self._require("Tokenize", S.MODEL_LOADED)
        return text.encode_text(
            self._need_model().tokenizer, value, add_special_tokens=add_special_tokens
        )

    def tokenize_chat(
        self, messages: tuple[ChatMessage, ...], add_generation_prompt: bool
    ) -> tuple[list[int], str]:
        self._require("Tokenize", S.MODEL_LOADED)
        return text.render_chat(
            self._need_model().tokenizer, messages, add_generation_prompt=add_generation_prompt
        )

    def detokenize(self, ids: list[int], skip_special_tokens: bool) -> str:
        self._require("Detokenize", S.MODEL_LOADED)
        loaded = self._need_model()
        for i, token in enumerate(ids):
            if not 0 <= token < loaded.info.vocab_size:
                raise InvalidArgument(
                    f"token_ids[{i}] = {token} is out of the vocabulary "
                    f"(size {loaded.info.vocab_size})"
                )
        return text.decode(loaded.tokenizer, ids, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------- generate
    def generate(self, spec: GenerateSpec) -> tuple[Iterator[GenerateChunk], Callable[[], None]]:
        """Starts a Generate request; returns its chunk iterator and a cancel."""
        self._require("Generate", S.READY)
        prompt = self._generate_prompt(spec)
        request_id = spec.request_id or uuid.uuid4().hex

        def job() -> GenerateStream:
            self._require("Generate", S.READY)
            runner = self._need_runner("Generate")
            loaded = self._need_model()
            if request_id in self._streams:
                raise InvalidArgument(f"request_id {request_id!r} is already streaming")
            runner.add_generate(request_id, tuple(prompt), spec.sampling)
            skip = frozenset(loaded.info.eos_token_ids) if spec.skip_special_tokens else frozenset()
            stream = GenerateStream(
                request_id=request_id,
                prompt_tokens=len(prompt),
                text=text.TextStream(loaded.tokenizer, skip_ids=skip),
            )
            self._streams.open(stream)
            return stream

        stream = self._engine.call(job)

        def cancel() -> None:
            self._engine.submit(lambda: self._end_stream(request_id, None))

        return stream.chunks(), cancel

    def _generate_prompt(self, spec: GenerateSpec) -> list[int]:
        forms = sum(bool(x) for x in (spec.prompt, spec.messages, spec.prompt_token_ids))
        if forms != 1:
            raise InvalidArgument(
                "Generate needs exactly one of prompt, messages or prompt_token_ids"
            )
        if spec.messages:
            return self.tokenize_chat(spec.messages, True)[0]
        if spec.prompt:
            return self.tokenize_text(spec.prompt, True)
        return list(spec.prompt_token_ids)

    def _end_stream(self, request_id: str, error: WorkerError | None) -> None:
        if self._runner is not None:
            self._runner.free((Origin.GENERATE, request_id))
        self._streams.close(request_id, error)

    def _generate_pending(self) -> bool:
        return bool(self._streams) and self._runner is not None

    def _generate_step(self) -> None:
        runner = self._runner
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
            self._run(runner, work)
        except Exception as exc:
            # No caller waits on this step: end the streams it carried with the
            # cause instead of letting the engine thread die for all requests.
            for _, request_id in work.scheduled:
                self._end_stream(request_id, Internal(f"Generate step failed: {exc!r}"))

    # ------------------------------------------------------------- drain
    def begin_drain(self) -> None:
        """Stops accepting new work; running requests may finish."""
        self._engine.call(lambda: self._set_state(S.DRAINING))

    def wait_generate_idle(self, timeout: float) -> bool:
        """Waits until no Generate stream is open; returns whether it got there."""
        return self._streams.wait_empty(timeout)

    def close(self) -> None:
        """Aborts what is left, frees the model and caches, stops the engine."""

        def job() -> None:
            for request_id in self._streams.ids():
                self._end_stream(request_id, Aborted("the worker shut down before it finished"))
            if self._runner is not None:
                self._runner.abort_all()
            self._runner = None
            self._loaded = None
            memory.release()
            self._set_state(S.STOPPED)

        if self._state is not S.STOPPED and self._engine.dead is None:
            with contextlib.suppress(Unavailable):
                self._engine.call(job)
        self._engine.stop(timeout=10)
        self._set_state(S.STOPPED)
