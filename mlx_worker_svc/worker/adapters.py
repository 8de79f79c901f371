"""The adapter calls: AddLora, RemoveLora, PinLora, ListLoras.

`AdapterCalls` takes the worker's core and runs each call as one job on the
engine thread, over the loaded model's `AdapterSet` (engine/lora/registry.py).
It adds what the engine does not know: the state a call needs (a loaded
model), the group rule (a worker group serves no adapters: its weights are
sharded and adapters would have to be too), the memory check against the KV
budget once InitCache set one, and the adapters loaded with every model
(`serve --lora-modules`, `EngineOptions.lora_modules`), again after a deep
sleep. After InitCache, adapters that do not fit the memory limit beside the
full KV budget take their bytes from it: the budget shrinks by the blocks they
fill, while that many are free (else RESOURCE_EXHAUSTED), and grows back when
they go. Invariants: a failed call changes nothing; adapters live and die with
the model they were loaded on (a new LoadModel starts with the start-up ones).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace

from mlx_worker_svc.core.adapters import AdapterAdded, AdapterInfo
from mlx_worker_svc.core.errors import FailedPrecondition, ResourceExhausted, WorkerError
from mlx_worker_svc.core.reports import WorkerState
from mlx_worker_svc.engine.lora.registry import AdapterSet
from mlx_worker_svc.engine.memory import guard as memory_guard
from mlx_worker_svc.engine.model.loader import LoadedModel
from mlx_worker_svc.worker.core import WorkerCore

log = logging.getLogger(__name__)

S = WorkerState


class AdapterCalls:
    """The LoRA calls over one worker core."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    def _adapters(self, call: str) -> AdapterSet:
        core = self.core
        if core.replica.channel.grouped:
            raise FailedPrecondition(
                f"{call}: this worker is a group of {core.replica.channel.size} ranks, which "
                "serves no LoRA adapters (its weights are sharded; adapters are not): serve "
                "adapters from a single-process worker"
            )
        if core.state is not S.SLEEPING:
            core.require(call, S.MODEL_LOADED)
        adapters = core.need_model(call).adapters
        adapters.max_loras = core.replica.options.max_loras
        adapters.in_use = self._users  # the live runner's requests (none while asleep)
        return adapters

    def _users(self) -> Counter[str]:
        runner = self.core.runner
        return runner.adapter_users() if runner is not None else Counter()

    def add(self, name: str, path: str) -> AdapterAdded:
        core = self.core

        def job() -> AdapterAdded:
            try:
                added = self._adapters("AddLora").add(name, path, self._room)
            except WorkerError as exc:
                # Refused: its frames (the adapter's weights, loaded to be measured) go now,
                # not when the error is dropped (the next AddLora's, say).
                raise exc.with_traceback(None) from None
            fit_budget(self.core)
            core.lifecycle.forget()  # a repeated DetermineMemory measures again
            return added

        return core.engine.call(job)

    def _room(self, more: int) -> None:
        """Refuses `more` adapter bytes the KV budget cannot give room for (free blocks)."""
        core, loaded, config = self.core, self.core.loaded, self.core.cache_config
        if loaded is None or config is None:
            return
        adapters = loaded.adapters.nbytes + more
        give = given_up(self.core, adapters)
        held = core.runner.state.request_blocks() if core.runner is not None else 0
        if give and config.num_blocks - give < max(held, 1):
            start = (
                f"AddLora: the adapters would take {adapters} bytes, which the memory limit "
                f"({config.memory_limit_bytes} bytes) leaves room for only if the KV budget "
                f"gives up {give} of its {config.num_blocks} blocks"
            )
            if give >= config.num_blocks:  # no request is in the way: nothing would be left
                raise ResourceExhausted(
                    f"{start}, which would leave it none: remove an adapter, or give the "
                    "worker more memory (InitCache's memory_limit_bytes)"
                )
            raise ResourceExhausted(
                f"{start}, and requests hold {held}: remove an adapter, finish requests, or "
                "set a smaller KV budget (InitCache)"
            )

    def remove(self, name: str) -> str:
        def job() -> str:
            path = self._adapters("RemoveLora").remove(name)
            fit_budget(self.core)
            self.core.lifecycle.forget()
            return path

        return self.core.engine.call(job)

    def pin(self, name: str, pinned: bool) -> AdapterInfo:
        return self.core.engine.call(lambda: self._adapters("PinLora").pin(name, pinned))

    def list(self) -> tuple[list[AdapterInfo], int]:
        """The resident adapters (none without a model) and --max-loras (0 on a group,
        which holds none)."""
        grouped = self.core.replica.channel.grouped
        cap = 0 if grouped else self.core.replica.options.max_loras

        def job() -> list[AdapterInfo]:
            loaded = self.core.loaded
            if loaded is None:
                return []
            loaded.adapters.in_use = self._users
            return loaded.adapters.infos()

        return self.core.engine.call(job), cap


def load_adapters(loaded: LoadedModel, specs: Iterable[tuple[str, str, bool]], cap: int) -> None:
    """Loads (name, path, pinned) adapters onto a model just loaded (raises at a bad one)."""
    loaded.adapters.max_loras = cap
    for name, path, pinned in specs:
        loaded.adapters.add(name, path)
        if pinned:
            loaded.adapters.pin(name, True)


def reload_adapters(
    loaded: LoadedModel, specs: Iterable[tuple[str, str, bool]], cap: int
) -> tuple[str, ...]:
    """Loads again the adapters a level-2 Sleep released; returns those that no longer
    load (their files gone or changed), each logged with the cause: a WakeUp wakes the
    model without them rather than staying asleep for good."""
    dropped = []
    for spec in specs:
        try:
            load_adapters(loaded, [spec], cap)
        except WorkerError as exc:
            dropped.append(spec[0])
            log.warning(
                "adapter dropped at WakeUp: it no longer loads",
                extra={"lora_name": spec[0], "path": spec[1], "error": exc.message},
            )
    return tuple(dropped)


def given_up(core: WorkerCore, adapter_bytes: int) -> int:
    """KV blocks the budget gives up so that adapters of these bytes fit the memory limit
    beside the weights, the full InitCache budget and the activation peak.

    Adapter bytes DetermineMemory counted (resident when it ran) are in the weights
    InitCache's budget was checked against: only bytes past them take blocks.
    """
    config, profile, loaded = core.cache_config, core.memory, core.loaded
    if config is None or profile is None or loaded is None:
        return 0  # DetermineMemory counts the adapters resident when it runs
    kv = memory_guard.kv_bytes(profile, config.num_blocks, config.block_size)
    need = loaded.info.weight_bytes + adapter_bytes + kv + profile.activation_peak_bytes
    per_block = memory_guard.kv_bytes(profile, 1, config.block_size)
    # Only the adapters' new bytes are taken from the budget: a limit that InitCache set
    # below the full budget on its own is the per-step memory guard's to enforce.
    over = min(need - config.memory_limit_bytes, adapter_bytes - profile.adapter_bytes)
    return -(-over // per_block) if over > 0 and per_block else 0


def kept_blocks(core: WorkerCore) -> int:
    """The KV budget with the adapters resident: InitCache's, less the blocks they take."""
    loaded, config = core.loaded, core.cache_config
    if config is None:
        return 0
    return config.num_blocks - (given_up(core, loaded.adapters.nbytes) if loaded else 0)


def fit_budget(core: WorkerCore) -> None:
    """The KV budget after the adapters changed: InitCache's, less the blocks they take."""
    runner = core.runner
    if runner is None or core.loaded is None or core.cache_config is None:
        return
    keep = kept_blocks(core)
    state = runner.state
    state.budget = replace(state.budget, num_blocks=keep)
    if state.prefix is not None:
        state.prefix.evict(len(state.prefix) + state.request_blocks() - keep)
