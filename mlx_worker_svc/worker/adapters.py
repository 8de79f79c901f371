"""The adapter calls: AddLora, RemoveLora, PinLora, ListLoras.

`AdapterCalls` takes the worker's core and runs each call as one job on the
engine thread, over the loaded model's `AdapterSet` (engine/lora/registry.py).
It adds what the engine does not know: the state a call needs (a loaded
model), the group rule (a worker group serves no adapters: its weights are
sharded and adapters would have to be too), the memory check against the KV
budget once InitCache set one, and the adapters loaded with every model
(`serve --lora-modules`, `EngineOptions.lora_modules`), again after a deep
sleep. Invariants: a failed call changes nothing; adapters live and die with
the model they were loaded on (a new LoadModel starts with the start-up ones).
"""

from __future__ import annotations

from collections.abc import Iterable

from mlx_worker_svc.core.adapters import AdapterAdded, AdapterInfo
from mlx_worker_svc.core.errors import FailedPrecondition, ResourceExhausted
from mlx_worker_svc.core.reports import WorkerState
from mlx_worker_svc.engine.lora.registry import AdapterSet
from mlx_worker_svc.engine.memory import guard as memory_guard
from mlx_worker_svc.engine.model.loader import LoadedModel
from mlx_worker_svc.worker.core import WorkerCore

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
        adapters = core.need_model().adapters
        adapters.max_loras = core.replica.options.max_loras
        return adapters

    def add(self, name: str, path: str) -> AdapterAdded:
        core = self.core

        def job() -> AdapterAdded:
            added = self._adapters("AddLora").add(name, path, self._room)
            core.lifecycle.forget()  # a repeated DetermineMemory measures again
            return added

        return core.engine.call(job)

    def _room(self, more: int) -> None:
        """Refuses `more` adapter bytes that the KV budget InitCache set leaves no room for."""
        core = self.core
        config, profile, loaded = core.cache_config, core.memory, core.loaded
        if config is None or profile is None or loaded is None:
            return  # DetermineMemory counts the adapters resident when it runs
        adapters = loaded.adapters.nbytes + more
        kv = memory_guard.kv_bytes(profile, config.num_blocks, config.block_size)
        weights, peak = loaded.info.weight_bytes, profile.activation_peak_bytes
        need = weights + adapters + kv + peak
        if need > config.memory_limit_bytes:
            raise ResourceExhausted(
                f"AddLora: the adapters would take {adapters} bytes; with {weights} bytes of "
                f"weights, {kv} bytes of KV budget and {peak} bytes of activations that is "
                f"{need} bytes, over the memory limit of {config.memory_limit_bytes}: remove "
                "an adapter, or set a smaller KV budget (InitCache)"
            )

    def remove(self, name: str) -> str:
        def job() -> str:
            path = self._adapters("RemoveLora").remove(name)
            self.core.lifecycle.forget()
            return path

        return self.core.engine.call(job)

    def pin(self, name: str, pinned: bool) -> AdapterInfo:
        return self.core.engine.call(lambda: self._adapters("PinLora").pin(name, pinned))

    def list(self) -> tuple[list[AdapterInfo], int]:
        """The resident adapters (none without a model) and --max-loras."""
        cap = self.core.replica.options.max_loras

        def job() -> list[AdapterInfo]:
            loaded = self.core.loaded
            return loaded.adapters.infos() if loaded is not None else []

        return self.core.engine.call(job), cap


def load_adapters(loaded: LoadedModel, specs: Iterable[tuple[str, str, bool]], cap: int) -> None:
    """Loads (name, path, pinned) adapters onto a model just loaded (raises at a bad one)."""
    loaded.adapters.max_loras = cap
    for name, path, pinned in specs:
        loaded.adapters.add(name, path)
        if pinned:
            loaded.adapters.pin(name, True)
