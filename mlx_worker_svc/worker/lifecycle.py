"""The lifecycle calls of the way up: InitDevice through WarmUp.

`Lifecycle` takes the worker's core up through its states (NEW →
DEVICE_READY → MODEL_LOADED → MEMORY_PROFILED → READY → SERVING); Sleep,
WakeUp and the drain (SLEEPING, DRAINING → STOPPED) are sleep_drain.py's.
Each call checks the state it needs, then its arguments, on the caller's
thread, then runs as one job on the engine thread. Invariants: a call in the
wrong state fails with FAILED_PRECONDITION naming the call that must come
first (whatever arguments it carries);
a call that fails changes nothing; repeating InitDevice, LoadModel or
InitCache with the same arguments does nothing; a new model, KV budget or
sleep starts a new worker epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace

from mlx_worker_svc.core.domain import CacheConfig, DeviceKind, MemoryProfile
from mlx_worker_svc.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    WorkerError,
)
from mlx_worker_svc.core.lifecycle import DeviceArgs, default_profile_tokens
from mlx_worker_svc.core.limits import MAX_NUM_BLOCKS
from mlx_worker_svc.core.reports import DeviceInfo, LoadSpec, WorkerState
from mlx_worker_svc.engine import options as engine_options
from mlx_worker_svc.engine.cache import prefix_cache
from mlx_worker_svc.engine.memory import guard as memory_guard
from mlx_worker_svc.engine.memory import profile as memory_profile
from mlx_worker_svc.engine.memory.device import auto_kind
from mlx_worker_svc.engine.model import loader
from mlx_worker_svc.worker.adapters import fit_budget, load_adapters
from mlx_worker_svc.worker.core import WorkerCore

S = WorkerState
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MEMORY_UTILIZATION = 0.9
GaveUp = Callable[[], bool] | None
"""Tells a lifecycle call whether its caller left (lifecycle_calls.py)."""


# The state each call of the way up needs, or a later one (InitDevice: NEW).
NEEDS = {
    "LoadModel": S.DEVICE_READY,
    "DetermineMemory": S.MODEL_LOADED,
    "InitCache": S.MEMORY_PROFILED,
    "WarmUp": S.READY,
}

# Upper bounds on lifecycle arguments: past them a call would only exhaust memory.
MAX_BLOCK_SIZE = 1024
MAX_WARM_UP_SHAPES = 64
MAX_WARM_UP_BATCH = 1024
# MLX takes the memory limit as a size_t; keep clear of its edge.
MAX_MEMORY_LIMIT = 1 << 62


def _kv_fields(call: str) -> tuple[str, str]:
    return f"{call}.kv_bits", f"{call}.kv_group_size"


def _check_block_size(block: int, where: str) -> None:
    if not 1 <= block <= MAX_BLOCK_SIZE:
        raise InvalidArgument(f"{where} must be in [1, {MAX_BLOCK_SIZE}], got {block}")


class Lifecycle:
    """The lifecycle calls over one worker core.

    The five calls of the way up run one at a time through the core's
    `LifecycleCalls` (lifecycle_calls.py): a repeat while one runs shares its
    result, any other is refused with ABORTED. Each takes `gave_up`, which says
    whether its caller has left, so an abandoned call leaves nothing queued on
    the engine thread.
    """

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def check_order(self, call: str) -> None:
        """FAILED_PRECONDITION for a call of the way up that the worker's state does not
        take (not reached yet, or asleep; UNAVAILABLE while draining), before its
        arguments are checked: the state is the answer, whatever the call carries.
        (While another lifecycle call runs, this call's turn answers: ABORTED, or the
        state it finds.)"""
        core = self.core
        swap = call == "LoadModel" and core.state is S.SLEEPING and core.sleep_level == 2
        if not (swap or core.lifecycle.busy):
            core.require(call, NEEDS[call])

    # --------------------------------------------------------- lifecycle
    def init_device(self, args: DeviceArgs, *, gave_up: GaveUp = None) -> DeviceInfo:
        core = self.core
        channel = core.replica.channel
        args.check_rank()  # in any state, before anything
        # The defaults filled in: the group's size and backend ("" is the worker's own).
        wanted = replace(
            args,
            world_size=args.world_size or channel.size,
            distributed_init_method=args.distributed_init_method or channel.backend,
        )

        def job() -> DeviceInfo:
            if core.state is not S.SLEEPING:  # asleep, it keeps its device: a repeat answers
                core.require("InitDevice", S.NEW)
            device = core.replica.device
            if device is not None:
                asked = _kind_filled_in(wanted, device.kind)
                if core.device_args is not None and asked != core.device_args:
                    raise FailedPrecondition(
                        "InitDevice: the device is already initialised, and this call asks "
                        f"for {asked.differences(core.device_args)}; repeat the first "
                        "call's arguments, or restart the worker to change them"
                    )
                return device
            wanted.check(channel.size, channel.backend)
            device = core.replica.init_device(args.kind)
            core.device_args = replace(wanted, kind=device.kind)  # AUTO resolved
            core.set_state(S.DEVICE_READY)
            return device

        # The defaults filled in (the group's size, the kind AUTO picks or picked): a
        # repeat spelling them out is the same call, in progress as well as done.
        held = core.replica.device
        key = asdict(_kind_filled_in(wanted, held.kind if held is not None else auto_kind()))
        return core.lifecycle.run("InitDevice", key, job, gave_up=gave_up)

    def load_model(
        self, spec: LoadSpec, *, gave_up: GaveUp = None
    ) -> tuple[loader.LoadedModel, int]:
        core = self.core
        self.check_order("LoadModel")
        if spec.max_model_len == 1:  # a mistake in any state but the wrong one
            raise InvalidArgument(
                "LoadModelRequest.max_model_len is 1: a prompt must be shorter than the "
                "context, so no request would fit (0 keeps the model's context)"
            )

        def job() -> tuple[loader.LoadedModel, int]:
            # Asleep at level 2 the weights are gone: any model may be loaded,
            # which ends the sleep (a scheduler's model swap).
            swap = core.state is S.SLEEPING and core.sleep_level == 2
            if not swap:
                core.require("LoadModel", NEEDS["LoadModel"])
            if core.loaded is not None and loader.same_load(spec, core.load_spec):
                return core.loaded, core.epoch
            core.require_idle("LoadModel")
            loaded = core.replica.load(spec)  # raises before anything changes
            options = core.replica.options  # and so do the start-up adapters
            for name, path in options.lora_modules:
                try:
                    load_adapters(loaded, [(name, path, False)], options.max_loras)
                except WorkerError as exc:
                    raise FailedPrecondition(
                        f"the worker's --lora-modules adapter {name!r} ({path}) does not "
                        f"load on this model: {exc.message}; the worker stays as it was "
                        "(serve this model from a worker started without that adapter)"
                    ) from exc
            core.sleep_level = 0
            core.loaded, core.load_spec = loaded, spec
            core.model_info = loaded.info
            core.chat_template = str(getattr(loaded.tokenizer, "chat_template", "") or "")
            core.runner, core.memory, core.cache_config = None, None, None
            memory_profile.release()  # the model it replaces: nothing holds it now
            core.new_epoch("restarted or loaded a model")
            core.set_state(S.MODEL_LOADED)
            return loaded, core.epoch

        # A path written another way (or a revision, not read for a local directory)
        # is the same call, in progress as well as done.
        key = asdict(loader.canonical(spec))
        return core.lifecycle.run("LoadModel", key, job, gave_up=gave_up)

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
        """Profiles memory (KV stored as kv_bits/kv_group_size; 0: float); see the proto.

        `max_num_batched_tokens` 0 takes the device's default size.
        """
        core = self.core
        self.check_order("DetermineMemory")
        kv = engine_options.kv_format(kv_bits, kv_group_size, _kv_fields("DetermineMemory"))
        util = memory_utilization or DEFAULT_MEMORY_UTILIZATION
        if not 0 < util <= 1:
            raise InvalidArgument(f"memory_utilization must be in (0, 1], got {util}")
        device, info = core.replica.device, core.model_info
        tokens = max_num_batched_tokens or default_profile_tokens(
            device.kind if device else None, info.max_context_length if info else 0
        )
        block = block_size or DEFAULT_BLOCK_SIZE
        _check_block_size(block, "DetermineMemory.block_size")

        def job() -> MemoryProfile:
            core.require("DetermineMemory", NEEDS["DetermineMemory"])
            loaded = core.need_model()
            if tokens > loaded.info.max_context_length:
                raise InvalidArgument(
                    f"max_num_batched_tokens ({tokens}) exceeds the context length "
                    f"({loaded.info.max_context_length})"
                )
            core.require_idle("DetermineMemory")
            core.memory = core.replica.profile(
                memory_utilization=util,
                max_num_batched_tokens=tokens,
                block_size=block,
                kv=kv,
                adapter_bytes=loaded.adapters.nbytes,  # LoRA adapters count with the weights
            )
            if core.state is S.MODEL_LOADED:
                core.set_state(S.MEMORY_PROFILED)
            return core.memory

        # float32 on the wire: 0.9 sent by a client and the default 0.9 are one call.
        args = {
            "memory_utilization": round(util, 6),
            "max_num_batched_tokens": tokens,
            "block_size": block,
            "kv_bits": kv.bits,
            "kv_group_size": kv.group_size,
        }
        return core.lifecycle.run("DetermineMemory", args, job, gave_up=gave_up)

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
        core = self.core
        self.check_order("InitCache")
        kv = engine_options.kv_format(kv_bits, kv_group_size, _kv_fields("InitCache"))
        if not 1 <= num_blocks <= MAX_NUM_BLOCKS:
            raise InvalidArgument(f"num_blocks must be in [1, {MAX_NUM_BLOCKS}], got {num_blocks}")
        if block_size:
            _check_block_size(block_size, "InitCache.block_size")

        def job() -> CacheConfig:
            core.require("InitCache", NEEDS["InitCache"])
            profile = core.memory
            assert profile is not None
            loaded = core.need_model()
            if kv != profile.kv:
                if kv.quantized:  # a format this model cannot store: say so, not "measure"
                    memory_profile.bytes_per_block(
                        loaded.model, profile.block_size, kv, where="InitCache"
                    )
                raise InvalidArgument(
                    f"InitCache asks for {kv.describe()} KV (kv_bits {kv.bits}) but "
                    f"DetermineMemory measured bytes per block for {profile.kv.describe()} KV: "
                    f"call DetermineMemory with kv_bits {kv.bits} and kv_group_size "
                    f"{kv.group_size} first"
                )
            wanted = prefix_caching is None or prefix_caching
            block = block_size or profile.block_size
            limit = memory_guard.budget_limit(profile, num_blocks, block, memory_limit_bytes)
            config = CacheConfig(
                num_blocks=num_blocks,
                block_size=block,
                prefix_caching=wanted and prefix_cache.supported(loaded.model),
                memory_limit_bytes=min(limit, MAX_MEMORY_LIMIT),
                kv=kv,
            )
            if core.runner is not None and core.cache_config == config:
                return config
            core.require_idle("InitCache")
            core.set_runner(core.replica.new_runner(config, profile))
            core.cache_config = config
            fit_budget(core)  # adapters loaded since DetermineMemory
            if core.state is S.MEMORY_PROFILED:
                core.set_state(S.READY)
            return config

        # The defaults filled in: a repeat spelling them out is the same call.
        profiled = core.memory
        args = {
            "num_blocks": num_blocks,
            "block_size": block_size or (profiled.block_size if profiled else 0),
            "enable_prefix_caching": prefix_caching is not False,
            "memory_limit_bytes": memory_limit_bytes,
            "kv_bits": kv.bits,
            "kv_group_size": kv.group_size,
        }
        return core.lifecycle.run("InitCache", args, job, gave_up=gave_up)

    def warm_up(
        self, batch_sizes: list[int], prefill_lengths: list[int], *, gave_up: GaveUp = None
    ) -> tuple[int, float]:
        core = self.core
        self.check_order("WarmUp")
        sizes = batch_sizes or [1]
        lengths = prefill_lengths or [16]
        for name, values in (("batch_sizes", sizes), ("prefill_lengths", lengths)):
            if min(values) < 1:
                raise InvalidArgument(f"WarmUpRequest.{name} must all be >= 1, got {min(values)}")
        if max(sizes) > MAX_WARM_UP_BATCH:
            raise InvalidArgument(
                f"WarmUpRequest.batch_sizes: {max(sizes)} is past the largest, {MAX_WARM_UP_BATCH}"
            )
        if len(sizes) + len(lengths) > MAX_WARM_UP_SHAPES:
            raise InvalidArgument(
                f"WarmUpRequest: batch_sizes ({len(sizes)}) and prefill_lengths ({len(lengths)}) "
                f"give {len(sizes) + len(lengths)} shapes; at most {MAX_WARM_UP_SHAPES} (an "
                "empty list counts as its one default, batch 1 or a 16-token prefill)"
            )

        def job() -> tuple[int, float]:
            core.require("WarmUp", NEEDS["WarmUp"])
            loaded = core.need_model()
            too_long = [n for n in lengths if n > loaded.info.max_context_length]
            if too_long:
                raise InvalidArgument(
                    f"WarmUpRequest.prefill_lengths {too_long} exceed the context "
                    f"({loaded.info.max_context_length} tokens)"
                )
            start = time.perf_counter()
            shapes = core.replica.warm_up(sizes, lengths)
            core.set_state(S.SERVING)
            return shapes, time.perf_counter() - start

        args = {"batch_sizes": tuple(sizes), "prefill_lengths": tuple(lengths)}
        return core.lifecycle.run("WarmUp", args, job, gave_up=gave_up)


def _kind_filled_in(args: DeviceArgs, picked: DeviceKind) -> DeviceArgs:
    """`args` with the kind AUTO stands for (`picked`) in its place."""
    return replace(args, kind=picked) if args.kind is DeviceKind.AUTO else args
