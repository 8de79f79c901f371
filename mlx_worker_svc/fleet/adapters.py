"""Where the fleet's LoRA adapters live: which workers hold each, and loads on demand.

A request naming an adapter (`GenerateRequest.lora_name`) runs on a worker
of its model that holds that adapter (`WorkerLink.adapters`, read with
ListLoras when the worker comes up and kept as the fleet loads more). When
none does and the fleet knows the adapter's path (`fleet --lora-modules
NAME=PATH`, `FleetConfig.lora_modules`), `ensure` loads it with AddLora on the
least loaded worker of the model (one load per worker and adapter at a time,
shared by the requests that wait for it); an adapter neither held nor
configured is NOT_FOUND naming lora_name. A worker's AddLora refusal (a
missing path: NOT_FOUND, a mismatch: INVALID_ARGUMENT) reaches the request as
the worker gave it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from mlx_worker_svc.core.errors import NotFound
from mlx_worker_svc.fleet.errors import FleetError
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)


class AdapterNotFound(FleetError, NotFound):
    """GenerateRequest.lora_name names an adapter no worker holds and the fleet has no path for."""

    def __init__(self, name: str, known: list[str]) -> None:
        held = ", ".join(repr(n) for n in known) or "none"
        super().__init__(
            f"lora_name: no worker of the fleet holds adapter {name!r} and the fleet has no "
            f"path for it (fleet --lora-modules NAME=PATH); adapters held or known: {held}"
        )


class AdapterPlacement:
    """The configured adapters (name -> path) and the loads under way."""

    def __init__(
        self, configured: Mapping[str, str] | None = None, bases: Mapping[str, str] | None = None
    ) -> None:
        self.configured = dict(configured or {})
        self.bases = dict(bases or {})  # adapter -> its model, where configured
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}  # (worker, adapter)
        self._background: set[asyncio.Future[None]] = set()  # place()'s loads

    def known(self, links: list[WorkerLink]) -> list[str]:
        """Every adapter a worker holds or the fleet may load, by name."""
        held = {name for link in links for name in link.adapters}
        return sorted(held | set(self.configured))

    @staticmethod
    def holders(up: list[WorkerLink], name: str) -> list[WorkerLink]:
        """The workers of `up` that can run a request of adapter `name` ("": all)."""
        return [link for link in up if not name or name in link.adapters]

    async def ensure(self, up: list[WorkerLink], name: str) -> None:
        """Makes some worker of `up` hold adapter `name` (loading it there if need be)."""
        if not name or not up or self.holders(up, name):
            return
        path = self.configured.get(name)
        if path is None:
            raise AdapterNotFound(name, self.known(up))
        link = min(up, key=lambda candidate: candidate.load)
        key = (link.target, name)
        task = self._loads.get(key)
        if task is None:
            task = self._loads[key] = asyncio.ensure_future(self._load(link, name, path))
            task.add_done_callback(lambda _task: self._loads.pop(key, None))
        await asyncio.shield(task)

    @staticmethod
    async def _load(link: WorkerLink, name: str, path: str) -> None:
        log.info("loading adapter %s on %s", name, link.target)
        added = await link.client.add_lora(pb.AddLoraRequest(name=name, path=path))
        link.adapters.discard(added.evicted)  # under the worker's --max-loras
        link.adapters.add(name)
        if added.kv.num_blocks:  # the budget the adapters left (AddLoraResponse.kv)
            link.num_blocks = added.kv.num_blocks

    def place(
        self, up: list[WorkerLink], name: str, on_loaded: Callable[[WorkerLink], None]
    ) -> None:
        """For a request that no worker of `up` can run now (its holder was lost): loads
        the adapter in the background when the fleet has its path, then `on_loaded(link)`."""
        if not name or not up or name not in self.configured:
            return

        async def load() -> None:
            try:
                await self.ensure(up, name)
            except Exception as exc:  # the request waits; the watchdog fails it in time
                log.warning("adapter %s could not be loaded: %s", name, exc)
                return
            for link in self.holders(up, name):
                on_loaded(link)

        self._background.add(task := asyncio.ensure_future(load()))
        task.add_done_callback(self._background.discard)

    def parents(self, links: list[WorkerLink], models: list[str]) -> dict[str, str]:
        """Adapter -> the model it runs on: the configured base, else its holders'
        model, else the fleet's only one ("": not known)."""
        only = models[0] if len(models) == 1 else ""
        out = {name: self.bases.get(name, only) for name in self.configured}
        for link in links:
            for name in link.adapters:
                out.setdefault(name, link.model_name)
                out[name] = out[name] or link.model_name
        return out
