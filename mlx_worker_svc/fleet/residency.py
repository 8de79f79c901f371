"""Where the fleet's models live: which workers serve each, what is wanted, what loads.

`Residency` keeps, for the scheduler, the models requests wait for (`wanted`:
requests being admitted, plus those the scheduler holds back for want of a
worker of their model), the loads on demand under way and their outcomes, and
per-model counts. `place` starts the loads that `models.plan_loads` asks for;
`status` reports one model (fleet.proto's ModelStatus).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.fleet.errors import BadRequest, ModelNotFound
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.fleet.metrics import FleetMetrics
from mlx_worker_svc.fleet.models import ModelCatalog, plan_loads
from mlx_worker_svc.fleet.step_outcome import WORKER_DOWN
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2

log = logging.getLogger(__name__)


class Residency:
    def __init__(
        self, catalog: ModelCatalog, links: list[WorkerLink], metrics: FleetMetrics
    ) -> None:
        self.catalog, self.links, self.metrics = catalog, links, metrics
        self.wanted: Counter[str] = Counter()  # requests waiting for a model, outside the queue
        self.loads: dict[WorkerLink, tuple[str, float]] = {}  # loads under way: model, since
        self.errors: dict[str, tuple[float, str]] = {}  # model -> (when a load failed, why)
        self.ended: Counter[str] = Counter()  # requests ended, per model
        self.num_loads: Counter[str] = Counter()

    def models(self) -> list[str]:
        """Every model: the configured ones in order, then those workers held, by name."""
        held = {link.model_name for link in self.links if link.model_name}
        return [*self.catalog.configured, *sorted(held - set(self.catalog.configured))]

    def up(self, model: str = "") -> list[WorkerLink]:
        """The workers up with `model` (any model: "")."""
        return [link for link in self.links if link.up and model in ("", link.model_name)]

    def resolve(self, asked: str) -> str:
        """The model a request names (ModelNotFound), or the fleet's only one for ""."""
        known = self.models()
        if not asked:
            if len(known) > 1:
                served = ", ".join(repr(name) for name in known)
                raise BadRequest(
                    f"model: the fleet serves {len(known)} models ({served}): name one"
                )
            return known[0] if known else ""
        if asked not in known:
            raise ModelNotFound(asked, known)
        return asked

    @contextlib.contextmanager
    def wanting(self, model: str) -> Iterator[None]:
        """Counts `model` as wanted meanwhile (so it is loaded, and its workers kept)."""
        self.wanted[model] += 1
        try:
            yield
        finally:
            self.wanted[model] -= 1
            if self.wanted[model] <= 0:
                del self.wanted[model]

    def may_load(self, model: str) -> bool:
        """Whether a worker will load `model`: it is configured, and some worker up or loading."""
        loadable = self.catalog.path_of(model) is not None
        return loadable and any(link.up or link.loading for link in self.links)

    def failed_since(self, model: str, since: float) -> str | None:
        """Why a load of `model` failed after `since`, if one did."""
        failed = self.errors.get(model)
        return failed[1] if failed is not None and failed[0] >= since else None

    # ------------------------------------------------------------- loads
    def place(self, held_back: Iterable[str]) -> None:
        """Starts the loads the policy asks for; `held_back`: the models of queued requests."""
        wanted = [*held_back, *self.wanted]
        for link, name in plan_loads(self.links, wanted, self.catalog):
            path = self.catalog.path_of(name)
            assert path is not None
            log.info("loading model %s on %s in place of %s", name, link.target, link.model_name)
            self.loads[link] = (name, time.monotonic())
            link.swap_model(name, path)

    def on_up(self, link: WorkerLink) -> None:
        """A worker is up: counts the load that brought it up, if it was one."""
        loaded = self.loads.pop(link, None)
        if loaded is not None:
            self.num_loads[loaded[0]] += 1
            self.metrics.loaded(loaded[0], time.monotonic() - loaded[1])

    def on_failed(self, link: WorkerLink, model: str, exc: Exception) -> str | None:
        """A load failed: why, for its requests to fail with; None if the worker only went
        away (the model is placed again)."""
        self.loads.pop(link, None)
        if isinstance(exc, ClientError) and exc.code in WORKER_DOWN:
            return None
        why = f"model {model!r} could not be loaded on worker {link.target}: {exc}"
        self.errors[model] = (time.monotonic(), why)
        return why

    # ------------------------------------------------------------ status
    def status(self, name: str, held_back: int) -> fleet_pb2.ModelStatus:
        """One model; `held_back`: its requests the scheduler holds for want of a worker."""
        mine = [link for link in self.links if link.model_name == name]
        path = self.catalog.path_of(name)
        queued = self.wanted[name] + held_back + sum(len(link.waiting) for link in mine if link.up)
        return fleet_pb2.ModelStatus(
            name=name,
            path=path or next((link.model for link in mine), ""),
            workers=[link.target for link in mine if link.up],
            loading=[link.target for link in self.links if link.loading == name],
            num_queued=queued,
            num_loads=self.num_loads[name],
            num_finished=self.ended[name],
            configured=path is not None,
        )
