"""Device selection and the memory facts MLX reports for it.

Works on macOS (Metal), Linux with CUDA and Linux CPU alike: the device is
detected through MLX, never assumed. Where MLX reports no memory size (the
CPU backend) the operating system's physical memory is used instead.
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import version

import mlx.core as mx

from mlx_worker_svc.core.domain import DeviceKind
from mlx_worker_svc.core.errors import FailedPrecondition
from mlx_worker_svc.core.reports import DeviceInfo


def _os_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def memory_facts() -> tuple[int, int]:
    """(total bytes, recommended working-set bytes) for the default device."""
    info: dict[str, object] = {}
    try:
        info = dict(mx.device_info())
    except (RuntimeError, AttributeError):
        info = {}
    total = info.get("memory_size") or info.get("total_memory") or 0
    recommended = info.get("max_recommended_working_set_size") or 0
    total_bytes = int(total) if isinstance(total, int | float) else 0
    if total_bytes <= 0:
        total_bytes = _os_memory_bytes()
    rec_bytes = int(recommended) if isinstance(recommended, int | float) else 0
    return total_bytes, rec_bytes if rec_bytes > 0 else total_bytes


def cuda_gpu_count() -> int:
    """CUDA GPUs MLX can use on this machine (0 without MLX's CUDA backend)."""
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return 0
    return int(mx.device_count(mx.gpu))


def auto_kind() -> DeviceKind:
    """The kind InitDevice picks when asked for none: the GPU where MLX has one."""
    return DeviceKind.GPU if mx.is_available(mx.gpu) else DeviceKind.CPU


def init_device(
    kind: DeviceKind, *, rank: int = 0, local_rank: int = 0, world_size: int = 1
) -> DeviceInfo:
    """Selects `kind` as MLX's default device and describes it."""
    gpu_available = bool(mx.is_available(mx.gpu))
    if kind is DeviceKind.GPU and not gpu_available:
        raise FailedPrecondition(
            "InitDevice asked for a GPU but MLX has no GPU backend on this machine "
            "(install mlx with Metal on macOS or mlx[cuda13] on Linux, or ask for CPU)"
        )
    chosen = auto_kind() if kind is DeviceKind.AUTO else kind
    mx.set_default_device(mx.gpu if chosen is DeviceKind.GPU else mx.cpu)
    try:
        info = dict(mx.device_info())
    except (RuntimeError, AttributeError):
        info = {}
    name = str(info.get("device_name") or info.get("architecture") or platform.machine())
    total, recommended = memory_facts()
    return DeviceInfo(
        kind=chosen,
        name=name,
        total_memory_bytes=total,
        recommended_working_set_bytes=recommended,
        mlx_version=version("mlx"),
        mlx_lm_version=version("mlx-lm"),
        platform=f"{platform.system()} {platform.machine()}",
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
    )


def settle_thread() -> None:
    """Waits for work MLX still has queued on this thread's stream.

    Called as the engine thread ends: a thread that exits with work pending on
    its stream aborts the process at interpreter exit ("terminate called
    without an active exception").
    """
    mx.synchronize()
