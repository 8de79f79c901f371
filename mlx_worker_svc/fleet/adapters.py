"""Where the fleet's LoRA adapters live: which workers hold each, and loads on demand.

A request naming an adapter (`GenerateRequest.lora_name`) runs on a worker
of its model that holds that adapter (`WorkerLink.adapters`, read with
ListLoras when the worker comes up and kept as the fleet loads more). An
adapter runs on one model: the `base_model_name` it was configured with, else
the model of the first worker seen holding it (`learn`), else the fleet's only
model; a request naming another model is INVALID_ARGUMENT naming lora_name
(`check`). When no worker holds it and the fleet knows the adapter's path
(`fleet --lora-modules NAME=PATH`, `FleetConfig.lora_modules`), its requests
wait while `place` loads it in the background (`ensure`: AddLora on the least
loaded worker of the model, one load per worker at a time, shared by the
requests that wait for it); a worker lost meanwhile fails none of them: the
load is tried again on the workers still up. On a worker whose
adapter slots (its --max-loras) are full the fleet first removes one that no
request of that worker needs (one it can load again first); when every slot is needed the
load waits (the requests stay queued and the scheduler tries again), so a
load never evicts an adapter requests were routed to. An adapter neither held
nor configured is NOT_FOUND naming lora_name; one the worker refuses to load
fails its requests with UNAVAILABLE naming the adapter, its path and the
worker (`AdapterLoadFailed`): a flag of the fleet's, not the caller's mistake.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import grpc

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.errors import InvalidArgument, NotFound
from mlx_worker_svc.fleet.errors import FleetError, LoadFailed
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.fleet.step_outcome import worker_lost
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


class AdapterOfAnotherModel(FleetError, InvalidArgument):
    """GenerateRequest.lora_name names an adapter of another model than the request's."""

    def __init__(self, name: str, base: str, model: str) -> None:
        super().__init__(
            f"lora_name: adapter {name!r} is an adapter of model {base!r}, not of {model!r} "
            f"(the request's model): name model {base!r}, or none"
        )


class AdapterModelNotServed(FleetError, NotFound):
    """GenerateRequest.lora_name names an adapter whose model the fleet serves no more
    (another model was loaded in its place from outside), and the request no model."""

    def __init__(self, name: str, base: str, served: list[str]) -> None:
        models = ", ".join(repr(m) for m in served) or "none"
        super().__init__(
            f"lora_name: adapter {name!r} runs on model {base!r}, which the fleet does not "
            f"serve now (it serves {models}); an adapter keeps the model it was first seen "
            "with (docs/adapters.md)"
        )


class AdapterLoadFailed(LoadFailed):
    """A worker refused to load a configured adapter (its path or its shapes)."""

    def __init__(self, name: str, path: str, target: str, exc: ClientError) -> None:
        super().__init__(
            f"lora_name: adapter {name!r} (fleet --lora-modules, {path}) does not load on "
            f"worker {target}: {exc.code.name}: {exc.details}"
        )


class AdapterPlacement:
    """The configured adapters (name -> path) and the loads under way."""

    def __init__(
        self, configured: Mapping[str, str] | None = None, bases: Mapping[str, str] | None = None
    ) -> None:
        self.configured = dict(configured or {})
        self.bases = dict(bases or {})  # adapter -> its model, where configured
        # A worker's own adapters (ListLoras when it came up): their paths, to load them
        # again when it no longer holds one (the fleet removed it to make room, or a
        # RemoveLora from outside did).
        self.seen: dict[str, str] = {}
        self._waits_logged: set[tuple[str, str]] = set()  # (worker, adapter): pinned full
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}  # (worker, adapter)
        self._locks: dict[str, asyncio.Lock] = {}  # per worker: one load at a time
        self._background: set[asyncio.Future[None]] = set()  # place()'s loads
        self._reading: asyncio.Future[None] | None = None  # refresh()'s ListLoras calls
        self._shadowed: set[str] = set()  # adapters named like a model, logged once
        self._clashes: set[tuple[str, str]] = set()  # (adapter, another path), logged once

    def learn(self, link: WorkerLink) -> None:
        """Takes the model of a worker that came up as the base of the adapters it is
        the first seen holding (a worker's own --lora-modules stay with the model they
        came with, whatever model the worker holds later), and their paths."""
        for name, path in link.adapter_paths.items():
            self._see(name, path, link.target)
        if link.model_name:
            for name in link.adapters:
                self.bases.setdefault(name, link.model_name)

    async def refresh(self, up: list[WorkerLink]) -> None:
        """Reads again what the workers of `up` hold (ListLoras): an AddLora or
        RemoveLora from outside the fleet since a worker came up shows then. Callers
        waiting meanwhile share the reading under way."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self._read_all(up))
        await asyncio.shield(self._reading)

    async def _read_all(self, up: list[WorkerLink]) -> None:
        try:
            await asyncio.gather(*(self._read(link) for link in up))
        finally:
            self._reading = None

    async def _read(self, link: WorkerLink) -> None:
        async with self._locks.setdefault(link.target, asyncio.Lock()):
            try:
                listing = await link.client.list_loras(pb.ListLorasRequest())
            except ClientError as exc:  # a worker lost meanwhile: its link finds out
                log.debug("no adapter list from %s: %s", link.target, exc)
                return
            self.take_listing(link, listing)

    def take_listing(self, link: WorkerLink, listing: pb.ListLorasResponse) -> None:
        """Takes what a worker's ListLoras says it holds now: an adapter added from
        outside runs on this worker's model and is loaded again from its path when
        removed (the fleet made room, or a RemoveLora from outside)."""
        link.adapters = set(listing.names)
        for adapter in listing.adapters:
            self._see(adapter.name, adapter.path, link.target)
        self.learn(link)

    def _see(self, name: str, path: str, target: str) -> None:
        """Keeps the first path seen for an adapter; logs (once each) a worker holding
        one of its name from another path: the fleet knows an adapter by its name, and
        routes a request for it to either."""
        first = self.configured.get(name) or self.seen.setdefault(name, path)
        if path and first and path != first and (name, path) not in self._clashes:
            self._clashes.add((name, path))
            log.warning(
                "adapter %s on worker %s comes from %s, but the fleet knows it from %s: "
                "requests for %s may run on either; give different adapters different names",
                name,
                target,
                path,
                first,
                name,
            )

    def warn_shadowed(self, links: list[WorkerLink], models: list[str]) -> None:
        """Logs, once each, the adapters named like a model of the fleet (a name learned
        from a worker's directory, or an AddLora from outside): the model wins."""
        named = set(self.configured) | {name for link in links for name in link.adapters}
        for name in sorted((named & set(models)) - self._shadowed):
            self._shadowed.add(name)
            log.warning(
                "adapter %s has the name of a model of the fleet: requests for %s get the "
                "model; give the adapter another name",
                name,
                name,
            )

    def model_of(self, name: str, links: list[WorkerLink]) -> str:
        """The model a request naming adapter `name` and no model runs on: its base
        ("" when not known). AdapterNotFound for an adapter no worker holds and the
        fleet may not load, once every worker was reached (one not heard from yet
        may report it)."""
        known = self.known(links)
        if name and name not in known and all(link.reached for link in links):
            raise AdapterNotFound(name, known)
        return self.bases.get(name, "")

    def check(self, name: str, model: str) -> None:
        """Raises AdapterOfAnotherModel when adapter `name` runs on another model."""
        base = self.bases.get(name, "")
        if name and base and base != model:
            raise AdapterOfAnotherModel(name, base, model)

    def known(self, links: list[WorkerLink]) -> list[str]:
        """Every adapter a worker holds or the fleet may load, by name."""
        held = {name for link in links for name in link.adapters}
        return sorted(held | set(self.configured) | set(self.seen))

    def path_of(self, name: str) -> str | None:
        """Where the fleet may load adapter `name` from: configured, or seen on a worker."""
        return self.configured.get(name) or self.seen.get(name)

    @staticmethod
    def holders(up: list[WorkerLink], name: str) -> list[WorkerLink]:
        """The workers of `up` that can run a request of adapter `name` ("": all)."""
        return [link for link in up if not name or name in link.adapters]

    def require(self, up: list[WorkerLink], name: str) -> None:
        """AdapterNotFound for an adapter no worker of `up` holds and the fleet may not
        load (a request for one that is loadable waits for its load: `place`)."""
        if name and up and not self.holders(up, name) and self.path_of(name) is None:
            raise AdapterNotFound(name, self.known(up))

    async def ensure(self, up: list[WorkerLink], name: str) -> None:
        """Makes some worker of `up` hold adapter `name` (loading it there if need be)."""
        self.require(up, name)
        path = self.path_of(name)
        if not name or not up or self.holders(up, name) or path is None:
            return
        link = min(up, key=lambda candidate: candidate.load)
        key = (link.target, name)
        task = self._loads.get(key)
        if task is None:
            task = self._loads[key] = asyncio.ensure_future(self._load(link, name, path))
            task.add_done_callback(lambda _task: self._loads.pop(key, None))
        await asyncio.shield(task)

    async def _load(self, link: WorkerLink, name: str, path: str) -> None:
        async with self._locks.setdefault(link.target, asyncio.Lock()):
            listing = await link.client.list_loras(pb.ListLorasRequest())
            self.take_listing(link, listing)
            if name in link.adapters or not await self._make_room(link, listing, name):
                return
            log.info("loading adapter %s on %s", name, link.target)
            try:
                added = await link.client.add_lora(pb.AddLoraRequest(name=name, path=path))
            except ClientError as exc:
                if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # no room yet: it waits
                    log.debug("adapter %s waits for room on %s: %s", name, link.target, exc)
                    return
                if worker_lost(exc):
                    raise
                raise AdapterLoadFailed(name, path, link.target, exc) from exc
            link.adapters.discard(added.evicted)
            link.adapters.add(name)
            if added.kv.num_blocks:  # the budget the adapters left (AddLoraResponse.kv)
                link.num_blocks = added.kv.num_blocks

    async def _make_room(
        self, link: WorkerLink, listing: pb.ListLorasResponse, wanted: str
    ) -> bool:
        """Frees an adapter slot on a worker whose --max-loras are all taken: removes an
        adapter no request routed there needs, neither pinned nor in use (one the fleet
        can load again first); False when there is none (the load waits)."""
        if not listing.max_loras or len(listing.adapters) < listing.max_loras:
            return True
        needed = {r.lora_name for r in [*link.waiting, *link.running.values()]}
        spare = sorted(
            (a.name not in self.configured, a.name)
            for a in listing.adapters
            if a.name not in needed and not a.pinned and not a.num_requests
        )
        if not spare:
            pinned = all(a.pinned for a in listing.adapters)
            if pinned and (link.target, wanted) not in self._waits_logged:
                self._waits_logged.add((link.target, wanted))
                log.warning(
                    "adapter %s waits: every --max-loras slot of %s holds a pinned adapter "
                    "(PinLora unpin=true frees one)",
                    wanted,
                    link.target,
                )
            log.debug("no adapter slot free on %s: every one is needed", link.target)
            return False
        self._waits_logged.discard((link.target, wanted))
        _, name = spare[0]
        link.adapters.discard(name)  # no request is routed to it from now
        try:
            await link.client.remove_lora(pb.RemoveLoraRequest(name=name))
        except ClientError as exc:
            if exc.code is not grpc.StatusCode.NOT_FOUND:  # in use after all: wait
                link.adapters.add(name)
                return False
        log.info("removed adapter %s from %s to make room", name, link.target)
        return True

    def place(
        self,
        up: list[WorkerLink],
        name: str,
        on_loaded: Callable[[WorkerLink], None],
        on_failed: Callable[[str, Exception], None],
    ) -> None:
        """For requests that no worker of `up` can run now (their holder was lost, or
        had no room): loads the adapter in the background when the fleet has its path,
        then `on_loaded(link)`; a load the worker refuses: `on_failed(name, error)`."""
        if not name or not up or self.path_of(name) is None:
            return

        async def load() -> None:
            try:
                await self.ensure(up, name)
            except AdapterLoadFailed as exc:
                on_failed(name, exc)
                return
            except Exception as exc:  # the worker went away: the requests wait
                log.warning("adapter %s could not be loaded: %s", name, exc)
                return
            for link in self.holders(up, name):
                on_loaded(link)

        self._background.add(task := asyncio.ensure_future(load()))
        task.add_done_callback(self._background.discard)

    def parents(self, links: list[WorkerLink], models: list[str]) -> dict[str, str]:
        """Adapter -> the model it runs on: its base (configured or learned), else its
        holders' model, else the fleet's only one ("": not known). A name that is also
        a model's is the model's."""
        only = models[0] if len(models) == 1 else ""
        # Configured, or seen on a worker (loaded again from there when asked for).
        out = {name: self.bases.get(name, only) for name in (*self.configured, *self.seen)}
        for link in links:
            for name in link.adapters:
                out[name] = out.get(name) or self.bases.get(name) or link.model_name
        return {name: base for name, base in out.items() if name not in models}
