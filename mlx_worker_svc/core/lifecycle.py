"""The lifecycle rules: which state each call needs and what to call first.

NEW → DEVICE_READY → MODEL_LOADED → MEMORY_PROFILED → READY → SERVING, with
SLEEPING beside SERVING and DRAINING → STOPPED at the end (DESIGN.md). The
worker asks `require()` before every call; the answer names the state and the
call that must come first, so a scheduler can recover without guessing.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from mlx_worker_svc.core.domain import DeviceKind
from mlx_worker_svc.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.core.reports import WorkerState

# mx.distributed's backends (InitDeviceRequest.distributed_init_method).
BACKENDS = ("ring", "jaccl", "mpi", "nccl")

S = WorkerState
ORDER = (S.NEW, S.DEVICE_READY, S.MODEL_LOADED, S.MEMORY_PROFILED, S.READY, S.SERVING)
NEXT_CALL = {
    S.NEW: "InitDevice",
    S.DEVICE_READY: "LoadModel",
    S.MODEL_LOADED: "DetermineMemory",
    S.MEMORY_PROFILED: "InitCache",
    S.SLEEPING: "WakeUp",
}
EXECUTABLE = (S.READY, S.SERVING)
PROFILE_TOKENS = {DeviceKind.CPU: 32, DeviceKind.GPU: 2048}
"""DetermineMemory's profiling size when the call leaves max_num_batched_tokens 0,
by device: a CPU computes a 2,048-token forward of a small model in tens of
seconds, a GPU in well under one (the memory model extrapolates to larger steps)."""


def default_profile_tokens(kind: DeviceKind | None, max_context: int) -> int:
    """The device's profiling size (CPU before InitDevice), at most `max_context` (if > 0)."""
    tokens = PROFILE_TOKENS[DeviceKind.GPU if kind is DeviceKind.GPU else DeviceKind.CPU]
    return min(tokens, max_context) if max_context > 0 else tokens


@dataclass(frozen=True)
class DeviceArgs:
    """What InitDevice was asked for; equal args make InitDevice a no-op."""

    kind: DeviceKind = DeviceKind.AUTO
    rank: int = 0
    local_rank: int = 0
    world_size: int = 0
    """0: the worker as it was started (one process, or the group mlx.launch started)."""
    distributed_init_method: str = ""
    """"" or the group's mx.distributed backend ("ring", "jaccl", "mpi")."""

    def differences(self, held: DeviceArgs) -> str:
        """The InitDevice fields in which these args differ from `held`, with both values."""
        changed = []
        for f in fields(self):
            asked, had = getattr(self, f.name), getattr(held, f.name)
            if asked != had:
                name = "device" if f.name == "kind" else f.name
                shown = [_shown(v) for v in (asked, had)]
                changed.append(f"{name} {shown[0]} (initialised with {shown[1]})")
        return ", ".join(changed)

    def check_rank(self) -> None:
        """Raises InvalidArgument unless the ranks are 0 and the backend one MLX has (a
        mistake in any state)."""
        if self.rank or self.local_rank:
            raise InvalidArgument(
                f"InitDevice.rank is {self.rank} and local_rank {self.local_rank}: only rank 0 "
                "of a worker group serves gRPC (the other ranks follow it), so both must be 0"
            )
        if self.distributed_init_method not in ("", *BACKENDS):
            raise InvalidArgument(
                f"InitDevice.distributed_init_method {clip(self.distributed_init_method)!r} "
                f'is no mx.distributed backend: "" or one of {", ".join(BACKENDS)}'
            )

    def check(self, world_size: int, backend: str) -> None:
        """Raises unless these args describe the worker as started."""
        self.check_rank()
        if self.world_size not in (0, world_size):
            if world_size == 1:
                raise FailedPrecondition(
                    f"InitDevice.world_size is {self.world_size} but this worker is a single "
                    f"process: start a group with `mlx-worker serve --world-size "
                    f"{self.world_size}` (or mlx.launch ... mlx-worker serve --group)"
                )
            raise FailedPrecondition(
                f"InitDevice.world_size is {self.world_size} but this worker is a group of "
                f"{world_size} processes; restart it with the size wanted"
            )
        if self.distributed_init_method not in ("", backend):
            raise FailedPrecondition(
                f"InitDevice.distributed_init_method is {self.distributed_init_method!r} but "
                + (
                    f"this worker group runs on the {backend!r} backend"
                    if backend
                    else "this worker is a single process (no mx.distributed backend)"
                )
            )


def _shown(value: object) -> str:
    if isinstance(value, DeviceKind):  # the proto's DeviceKind names
        return "DEVICE_KIND_" + ("UNSPECIFIED" if value is DeviceKind.AUTO else value.name)
    return repr(value)


def require(state: WorkerState, call: str, minimum: WorkerState) -> None:
    """Raises unless `state` is `minimum` or later in the lifecycle."""
    if state in (S.DRAINING, S.STOPPED):
        raise Unavailable(f"{call}: the worker is {state.value} and accepts no new work")
    if state in ORDER and ORDER.index(state) >= ORDER.index(minimum):
        return
    if state is S.SLEEPING:
        raise FailedPrecondition(f"{call}: the worker is SLEEPING: call WakeUp first")
    needed = NEXT_CALL.get(state, "")
    raise FailedPrecondition(
        f"{call} needs state {minimum.value} or later; the worker is {state.value}"
        + (f": call {needed} first" if needed else "")
    )
