"""The memory guard: a step whose activations would not fit is refused up front.

MLX's CPU backend does not enforce its memory limit (an allocation past the
machine's memory crashes the process), and on Metal and CUDA an allocation
failure surfaces in the middle of a step. So before a step changes anything
the guard estimates the peak of its largest forward from the activation model
DetermineMemory fitted (`bytes_per_token * c + bytes_per_token_pair * c * L`
for c tokens over a context of L) and compares it with what the memory limit
leaves beside MLX's active memory. The prefix cache gives its blocks back
first where that makes room enough; else the step is refused with
RESOURCE_EXHAUSTED and the cache keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import mlx.core as mx

from mlx_worker_svc.core.domain import MemoryProfile
from mlx_worker_svc.core.errors import InvalidArgument, ResourceExhausted
from mlx_worker_svc.core.reports import MemoryUsage

_MIB = 1 << 20


def kv_bytes(profile: MemoryProfile, num_blocks: int, block_size: int) -> int:
    """Bytes a full KV budget of `num_blocks` blocks of `block_size` tokens takes."""
    return num_blocks * block_size * profile.bytes_per_block // profile.block_size


def budget_limit(profile: MemoryProfile, num_blocks: int, block_size: int, asked: int) -> int:
    """The memory limit for a KV budget; raises if the budget can never fit.

    `asked` is InitCache.memory_limit_bytes. 0 derives the limit: the larger of
    memory_utilization x the recommended working set and weights + activation
    peak + the full budget, which must then fit the device's total memory.
    """
    if asked:
        check_budget(profile, num_blocks, block_size, asked, "InitCache.memory_limit_bytes")
        return asked
    total = profile.total_memory_bytes
    check_budget(profile, num_blocks, block_size, total, "the device's memory")
    allowance = int(profile.recommended_working_set_bytes * profile.memory_utilization)
    need = profile.weight_bytes + profile.activation_peak_bytes
    return max(allowance, need + kv_bytes(profile, num_blocks, block_size))


def check_budget(
    profile: MemoryProfile, num_blocks: int, block_size: int, limit: int, limit_field: str
) -> None:
    """Refuses a KV budget that, full, would leave no room for a step: the weights, the
    KV and a one-token step's activations over `limit` bytes.

    `limit_field` names where the limit came from, for the message.
    """
    kv = kv_bytes(profile, num_blocks, block_size)
    step = one_token_step_bytes(profile)
    if profile.weight_bytes + kv + step <= limit:
        return
    per_block = kv_bytes(profile, 1, block_size)
    room = max(limit - profile.weight_bytes - step, 0)
    fits = room // per_block if per_block else 0
    raise InvalidArgument(
        f"InitCache.num_blocks {num_blocks} of {block_size} tokens would take {kv} bytes of "
        f"KV ({per_block} bytes a block) beside {profile.weight_bytes} bytes of weights and "
        f"{step} bytes for a one-token step's activations, more than {limit_field} "
        f"({limit} bytes): at most {fits} blocks fit; lower num_blocks (DetermineMemory "
        f"suggests one) or raise the limit (past {profile.weight_bytes + kv + step}, what "
        "those take; requests' KV is allocated 256 tokens at a time, so leave room beyond)"
    )


def activation_bytes(profile: MemoryProfile, tokens: int, context: int) -> float:
    """The activations of a forward of `tokens` over `context`, as profiled."""
    return (
        profile.activation_bytes_fixed
        + profile.activation_bytes_per_token * tokens
        + profile.activation_bytes_per_token_pair * tokens * context
    )


def one_token_step_bytes(profile: MemoryProfile) -> int:
    """The activations of the smallest step (one token, one of context): a limit
    without room for them beside a full KV budget would refuse every step."""
    return max(int(activation_bytes(profile, 1, 1)), 0)


# MLX's peak is process-wide, and a measurement resets it (profile.py): the highest it
# had before the last reset, so that MemoryUsage.peak_bytes is the highest since start.
_peak_before_reset = [0]


def reset_peak() -> None:
    """Resets MLX's peak for a measurement, keeping the highest one for `usage`."""
    _peak_before_reset[0] = max(_peak_before_reset[0], int(mx.get_peak_memory()))
    mx.reset_peak_memory()


def usage(limit: int) -> MemoryUsage:
    return MemoryUsage(
        active_bytes=int(mx.get_active_memory()),
        peak_bytes=max(_peak_before_reset[0], int(mx.get_peak_memory())),
        cache_bytes=int(mx.get_cache_memory()),
        limit_bytes=limit,
    )


class MemoryGuard:
    def __init__(self, profile: MemoryProfile, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self._profile = profile
        mx.set_memory_limit(limit_bytes)

    def estimate(self, forwards: Iterable[tuple[int, int]]) -> int:
        """Peak bytes of the largest of `forwards`, each (tokens, context)."""
        peak = 0.0
        for tokens, context in forwards:
            peak = max(peak, activation_bytes(self._profile, tokens, context))
        return int(peak)

    def check(
        self, need: int, what: str, make_room: Callable[[int], int], reclaimable: int = 0
    ) -> None:
        """Raises ResourceExhausted unless `need` bytes fit under the limit.

        `make_room(bytes)` may free memory first (the prefix cache's blocks), but
        only when the `reclaimable` bytes it could free would make `need` fit: a
        step refused anyway leaves the cache as it was.
        """
        free = self.limit - int(mx.get_active_memory())
        if need <= free:
            return
        if need <= free + reclaimable:
            make_room(need - free)
            free = self.limit - int(mx.get_active_memory())
            if need <= free:
                return
        raise ResourceExhausted(
            f"{what} needs about {need / _MIB:.1f} MiB of activations but only "
            f"{max(free, 0) / _MIB:.1f} MiB are free under the memory limit of "
            f"{self.limit / _MIB:.1f} MiB; schedule fewer tokens or preempt requests"
        )


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether an exception from MLX is an out-of-memory condition."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        word in text for word in ("malloc", "allocate", "out of memory", "outofmemory")
    )
