"""The lifecycle rules: which state each call needs and what to call first.

NEW → DEVICE_READY → MODEL_LOADED → MEMORY_PROFILED → READY → SERVING, with
SLEEPING beside SERVING and DRAINING → STOPPED at the end (DESIGN.md). The
worker asks `require()` before every call; the answer names the state and the
call that must come first, so a scheduler can recover without guessing.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_worker_svc.domain import DeviceKind, WorkerState
from mlx_worker_svc.errors import FailedPrecondition, Unavailable

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


@dataclass(frozen=True)
class DeviceArgs:
    """What InitDevice was asked for; equal args make InitDevice a no-op."""

    kind: DeviceKind = DeviceKind.AUTO
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    distributed_init_method: str = ""


def require(state: WorkerState, call: str, minimum: WorkerState) -> None:
    """Raises unless `state` is `minimum` or later in the lifecycle."""
    if state in (S.DRAINING, S.STOPPED):
        raise Unavailable(f"{call}: the worker is {state.value} and accepts no new work")
    if state in ORDER and ORDER.index(state) >= ORDER.index(minimum):
        return
    needed = NEXT_CALL.get(state, "")
    raise FailedPrecondition(
        f"{call} needs state {minimum.value} or later; the worker is {state.value}"
        + (f": call {needed} first" if needed else "")
    )
