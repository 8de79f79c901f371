"""The fleet's text calls (Tokenize, Detokenize) on a worker of the model that serves.

A text prompt is tokenized on the least loaded worker up with its model. One
that turns out not to serve (draining, asleep, gone, or no answer within the
hang budget, at least 10 s) is passed over for the next; when every one
failed so, the call is NoWorkers (UNAVAILABLE) with the last cause, not the
worker's own refusal (which would tell a client to call WakeUp, or read as
its own cancel). Text past what the worker takes in one message is the
caller's mistake (BadRequest), refused before it is sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.fleet.checks import check_size
from mlx_worker_svc.fleet.errors import NoWorkers
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.fleet.step_outcome import worker_lost

log = logging.getLogger(__name__)

MIN_BUDGET_SECONDS = 10.0


class TextCalls:
    def __init__(
        self,
        wait_for: Callable[[str, bool], Awaitable[object]],
        up: Callable[[str], list[WorkerLink]],
        detection_seconds: float,
    ) -> None:
        """`wait_for(model, want)` returns once a worker of `model` is up (or raises);
        `up(model)` lists them."""
        self._wait_for, self._up = wait_for, up
        self.budget = max(detection_seconds, MIN_BUDGET_SECONDS)

    async def call(self, model: str, method: str, request: Any, *, want: bool = False) -> Any:
        """`method` ("tokenize", "detokenize") of `request` on a worker of `model`."""
        tried: set[WorkerLink] = set()
        last: ClientError | None = None
        while True:
            await self._wait_for(model, want)
            fresh = [link for link in self._up(model) if link not in tried]
            if not fresh:
                raise NoWorkers(f"no worker of the fleet could answer: {last}")
            link = min(fresh, key=lambda candidate: candidate.load)
            if method == "tokenize":  # not the worker's transport error (RESOURCE_EXHAUSTED)
                check_size(request, link.max_message, link.max_context)
            try:
                return await getattr(link.client, method)(request, timeout=self.budget)
            except ClientError as exc:
                if not worker_lost(exc):
                    raise
                log.info("%s on %s failed (%s): trying another worker", method, link.target, exc)
                tried.add(link)
                last = exc
