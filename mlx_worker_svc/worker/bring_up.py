"""A worker bringing itself up: `serve --auto-init`'s InitDevice..WarmUp, in process.

`BringUp` is what the command line asked for; `bring_up` runs the five
lifecycle calls from the calling thread. That thread claims the worker's
lifecycle calls first (`worker.lifecycle.claim()`, before the port opens), so
CheckHealth says `bringing_up` from its first answer and a scheduler's own
lifecycle calls join the one in progress or are refused (lifecycle_calls.py);
`bring_up` releases them when it ends, done or failed. Profiling takes the
worker's device-sized default (lifecycle.PROFILE_TOKENS) unless a size is given.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_worker_svc.core.domain import FLOAT_KV, CacheConfig, DeviceKind, KVFormat, MemoryProfile
from mlx_worker_svc.core.lifecycle import DeviceArgs
from mlx_worker_svc.core.reports import DeviceInfo, LoadSpec, ModelInfo
from mlx_worker_svc.worker.worker import Worker


@dataclass(frozen=True)
class BringUp:
    """The lifecycle arguments of `serve --auto-init` (0 means the call's own default)."""

    model: str
    device: DeviceKind = DeviceKind.AUTO
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    memory_utilization: float = 0.0
    block_size: int = 16
    num_blocks: int = 0
    """0: DetermineMemory's suggested_num_blocks."""
    prefix_caching: bool = True
    memory_limit_bytes: int = 0
    kv: KVFormat = FLOAT_KV  # --kv-bits / --kv-group-size: float unless set


@dataclass(frozen=True)
class BroughtUp:
    """What the worker reported on the way up (the ready line prints it)."""

    device: DeviceInfo
    model: ModelInfo
    profile: MemoryProfile
    cache: CacheConfig


def bring_up(worker: Worker, plan: BringUp) -> BroughtUp:
    """Takes `worker` from NEW to SERVING; raises the first call's error."""
    try:
        device = worker.init_device(DeviceArgs(kind=plan.device))
        # Keep the facts, not the LoadedModel: a reference here would pin the
        # weights through Sleep level 2.
        spec = LoadSpec(model=plan.model, max_model_len=plan.max_model_len)
        model = worker.load_model(spec)[0].info
        profile = worker.determine_memory(
            plan.memory_utilization,
            plan.max_num_batched_tokens,
            plan.block_size,
            kv_bits=plan.kv.bits,
            kv_group_size=plan.kv.group_size,
        )
        cache = worker.init_cache(
            plan.num_blocks or max(profile.suggested_num_blocks, 1),
            plan.block_size,
            prefix_caching=plan.prefix_caching,
            memory_limit_bytes=plan.memory_limit_bytes,
            kv_bits=plan.kv.bits,
            kv_group_size=plan.kv.group_size,
        )
        worker.warm_up([1], [16])
    finally:
        worker.lifecycle.release()
    return BroughtUp(device, model, profile, cache)
