"""The fleet's requests that wait for a worker: of their model, or holding their adapter.

The scheduler puts a request here when no worker up can take it (its model is
being loaded, or no worker holds its LoRA adapter yet) and takes it out when
one comes up. Meanwhile `watch` (the fleet's watchdog) fails the requests that
waited longer than `--no-worker-timeout` for a worker that will not come, and
starts again the loads they wait for: a model's (`Residency.place`) or an
adapter's, for one waiting for room on a full worker, which waits as long as
its caller does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

from mlx_worker_svc.fleet.adapters import AdapterPlacement
from mlx_worker_svc.fleet.errors import LoadFailed, NoWorkers
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.fleet.request import FleetRequest, Phase
from mlx_worker_svc.fleet.residency import Residency


class PendingRequests:
    def __init__(
        self,
        residency: Residency,
        adapters: AdapterPlacement,
        *,
        timeout: float,
        on_up: Callable[[WorkerLink], None],
        why_down: Callable[[], str],
    ) -> None:
        self.residency, self.adapters = residency, adapters
        self.timeout = timeout  # --no-worker-timeout
        self._on_up = on_up  # a worker came up with an adapter loaded for these
        self._why_down = why_down
        self._entries: list[tuple[float, FleetRequest]] = []  # (since, request), in order

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, model: str) -> int:
        return sum(r.model == model for _, r in self._entries)

    def put(self, r: FleetRequest, *, front: bool = False) -> None:
        """Holds `r` back (a request moving off a lost worker goes first: `front`) and
        starts the loads it needs: its model's, its adapter's."""
        entry = (time.monotonic(), r)
        self._entries.insert(0, entry) if front else self._entries.append(entry)
        self.place()
        self.adapters.place(
            self.residency.up(r.model), r.lora_name, self._on_up, self.adapter_failed
        )

    def take(self, ready: Callable[[FleetRequest], bool]) -> list[FleetRequest]:
        """Takes out, in order, the requests `ready` accepts."""
        taken, keep = [], []
        for since, r in self._entries:
            taken.append(r) if ready(r) else keep.append((since, r))
        self._entries = keep
        return taken

    def drop(self, r: FleetRequest) -> None:
        self._entries = [(t, p) for t, p in self._entries if p is not r]

    def fail(self, which: Callable[[FleetRequest], bool], exc: Exception) -> None:
        """Ends the requests `which` accepts with `exc`."""
        for r in self.take(which):
            r.phase = Phase.DONE
            r.outbox.put_nowait(exc)

    def models(self) -> Iterator[str]:
        return (r.model for _, r in self._entries)

    def place(self) -> None:
        """Starts the loads the residency policy asks for (fleet/models.py)."""
        self.residency.place(self.models())

    def load_failed(self, link: WorkerLink, model: str, exc: Exception) -> None:
        """A load on demand failed: its requests fail, unless the worker only went away."""
        why = self.residency.on_failed(link, model, exc)
        if why is None:
            return  # placed again on another worker
        self.fail(lambda r: r.model == model, LoadFailed(why))

    def adapter_failed(self, name: str, exc: Exception) -> None:
        """A worker refused to load a configured adapter: the requests waiting for it fail."""
        self.fail(lambda r: r.lora_name == name, exc)

    async def watch(self) -> None:
        """The watchdog: every half second, `sweep`."""
        while True:
            await asyncio.sleep(0.5)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        """Fails the requests that waited too long for a worker; starts loads waited for."""
        keep = []
        room: set[tuple[str, str]] = set()  # (model, adapter) waiting for a slot
        for since, r in self._entries:
            too_long = now - since > self.timeout
            # One waiting for a worker of its model to have room for its adapter
            # waits as long as its caller does; the load is tried again below.
            loadable = self.adapters.path_of(r.lora_name) is not None  # never for ""
            for_room = loadable and bool(self.residency.up(r.model))
            if for_room:
                room.add((r.model, r.lora_name))
            if too_long and not for_room and not self.residency.may_load(r.model):
                r.phase = Phase.DONE
                whose = f" of model {r.model!r}" if r.model else ""
                why = self._why_down()
                r.outbox.put_nowait(
                    NoWorkers(f"no worker{whose} of the fleet came up in time{why}")
                )
            else:
                keep.append((since, r))
        self._entries = keep
        self.place()
        for model, name in room:
            self.adapters.place(self.residency.up(model), name, self._on_up, self.adapter_failed)
