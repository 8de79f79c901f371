"""Which worker of a model's up workers a request goes to (`FleetConfig.routing`).

`prefix` (the default): requests sharing their first `affinity_tokens` tokens
go where that prefix went before, so its KV is in that worker's prefix cache,
unless that worker is busier than the least-loaded one by a full batch
(`max_num_seqs`) or is no longer up. Otherwise, and in `least-loaded` mode, the
worker with the least work, ties broken in turn so equal workers share the load.
"""

from __future__ import annotations

import itertools

from mlx_worker_svc.fleet.config import Routing
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.fleet.request import FleetRequest


class Router:
    def __init__(self, routing: Routing, affinity_tokens: int, busy: int) -> None:
        self._routing, self._affinity_tokens, self._busy = routing, affinity_tokens, busy
        self._affinity: dict[int, WorkerLink] = {}
        self._turn = itertools.count()

    def pick(self, r: FleetRequest, up: list[WorkerLink]) -> WorkerLink:
        """The worker of `up` (the up workers of `r`'s model) that `r` goes to."""
        turn = next(self._turn)
        spread = min(up, key=lambda link: (link.load, (up.index(link) - turn) % len(up)))
        if self._routing != "prefix" or len(r.prompt) < self._affinity_tokens:
            return spread
        key = hash((r.model, tuple(r.prompt[: self._affinity_tokens])))
        home = self._affinity.get(key)
        if home is None or home not in up or home.load >= spread.load + self._busy:
            self._affinity[key] = home = spread
        return home
