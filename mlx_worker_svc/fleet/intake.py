"""The fleet's intake: the bounded queue, and a request taken in (its model and adapter
resolved, its prompt tokenized and checked, a worker-side id claimed).

`Intake` is mixed into `FleetScheduler` (scheduler.py), whose state it reads and
which routes what it takes in; it holds no state of its own. Past the queue
(`--queue`: requests being admitted, waiting for a worker, or held on one not
yet started) a request is `Overloaded` at once; `queue_slot` lets a caller that
works on a request before `generate` (the gateway's Anthropic route tokenizes
its chat first) wait in the same queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.errors import WorkerError
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.fleet.adapters import AdapterModelNotServed, AdapterPlacement
from mlx_worker_svc.fleet.checks import check_fits, check_forms, check_message, check_size
from mlx_worker_svc.fleet.config import FleetConfig
from mlx_worker_svc.fleet.errors import (
    BadRequest,
    ModelNotFound,
    Overloaded,
    ShutDown,
    ShuttingDown,
)
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.fleet.metrics import FleetMetrics, error_outcome
from mlx_worker_svc.fleet.models import ModelCatalog
from mlx_worker_svc.fleet.pending import PendingRequests
from mlx_worker_svc.fleet.request import FleetRequest, Phase
from mlx_worker_svc.fleet.residency import Residency
from mlx_worker_svc.fleet.text_calls import TextCalls
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

# A request's lines (admitted, routed, ended) are the fleet scheduler's, wherever logged.
log = logging.getLogger("mlx_worker_svc.fleet.scheduler")


class Intake:
    """The queue bound and request intake of `FleetScheduler` (its state, declared here)."""

    config: FleetConfig
    catalog: ModelCatalog
    metrics: FleetMetrics
    links: list[WorkerLink]
    residency: Residency
    adapters: AdapterPlacement
    pending: PendingRequests
    text: TextCalls
    draining: bool
    num_rejected: int
    _up: Callable[..., list[WorkerLink]]
    _live: dict[str, FleetRequest]
    _suffixes: Iterator[int]
    _admitting: int
    _cut: bool
    _hurry: bool

    # FleetScheduler's own, which the intake calls.
    def models(self) -> list[str]:
        raise NotImplementedError

    async def _some_link(self, model: str, *, want: bool = True) -> WorkerLink:
        raise NotImplementedError

    def _route(self, r: FleetRequest, *, front: bool = False) -> None:
        raise NotImplementedError

    def _ended(self, req_id: str, model: str, outcome: str, since: float, **fields: object) -> None:
        raise NotImplementedError

    async def refresh_adapters(self, name: str = "") -> None:
        """Reads again the adapters the workers hold (ListLoras) when adapter `name` is
        none the fleet knows, or for "" (a model list): one an AddLora from outside put
        on a worker since it came up shows then."""
        if not name or name not in self.adapters.known(self.links):
            await self.adapters.refresh(self._up())
            self.adapters.warn_shadowed(self.links, self.models())

    def _queued(self) -> int:
        waiting = sum(len(link.waiting) for link in self.links)
        return self._admitting + len(self.pending) + waiting

    def _check_room(self) -> None:
        """ShuttingDown while draining; Overloaded when the queue is full."""
        if self.draining:
            raise ShuttingDown()
        if self._queued() >= self.config.queue_capacity:
            self.num_rejected += 1
            raise Overloaded(
                f"the fleet's queue is full ({self.config.queue_capacity} requests waiting); "
                "retry later"
            )

    @contextlib.asynccontextmanager
    async def queue_slot(self, model: str = "", req_id: str = "") -> AsyncIterator[None]:
        """A place in the queue for what a caller does before `generate` (the gateway's
        Anthropic route tokenizes a chat first): refused as `generate` refuses (queue
        full, draining), else counted as waiting until the block ends. A refusal, or a
        fleet error the block raises (no worker up), counts as the request's end, logged
        under `req_id` (the request's own, else a new one)."""
        started, req_id = time.monotonic(), req_id or uuid.uuid4().hex
        try:
            self._check_room()
        except WorkerError as exc:
            outcome = error_outcome(exc.code)
            self._ended(req_id, self._model_named(model), outcome, started, error=str(exc))
            raise
        self._admitting += 1
        try:
            yield
        except BaseException as exc:
            cause = _fleet_error(exc)
            if cause is not None:
                outcome = error_outcome(cause.code)
                self._ended(req_id, self._model_named(model), outcome, started, error=str(cause))
            elif isinstance(exc, asyncio.CancelledError):  # the caller left meanwhile
                self._ended(req_id, self._model_named(model), "cancelled", started)
            raise
        finally:
            self._admitting -= 1

    async def _admit(
        self, request: pb.GenerateRequest, req_id: str, started: float, reserve_max_tokens: bool
    ) -> FleetRequest:
        """Takes a request into the queue and routes it (raises FleetError, ClientError)."""
        self._check_room()
        # The slot is taken before the prompt is tokenized (an await), so
        # requests arriving meanwhile see it and the bound holds.
        self._admitting += 1
        params = request.sampling_params
        try:
            ask = check_forms(request)
            lora = request.lora_name  # its model is the request's when that names none
            if lora:  # a plain request reads no adapter list
                await self.refresh_adapters(lora)
            base = self.adapters.model_of(lora, self.links)
            try:
                model = await self._resolve(request.model or base)
            except ModelNotFound:
                if request.model or not base:
                    raise
                raise AdapterModelNotServed(lora, base, self.models()) from None
            self.adapters.check(lora, model)
            waits = not self._up(model) and self.catalog.path_of(model) is not None
            with self.residency.wanting(model):  # until it is routed
                link = await self._some_link(model, want=False)
                # Not loaded here: a request no worker can run yet waits while the
                # adapter loads (`_route`), so a worker lost mid-load fails nobody.
                self.adapters.require(self._up(model), request.lora_name)
                prompt = list(request.prompt_token_ids)
                if ask is not None:
                    check_size(ask, link.max_message, link.max_context)
                    prompt = list((await self.text.call(model, "tokenize", ask)).token_ids)
                fits = {"vocab_size": link.vocab_size, "max_context": link.max_context}
                budgets = [(up.num_blocks, up.block_size) for up in self._up(model)]
                field = (
                    "prompt_token_ids" if ask is None else "messages" if ask.messages else "prompt"
                )
                check_fits(
                    prompt, params, reserve_max_tokens, kv_budgets=budgets, field=field, **fits
                )
                check_message(req_id, prompt, params, link.max_message)
                r = FleetRequest(
                    request_id=req_id,
                    model=model,
                    lora_name=request.lora_name,
                    waited_for_load=waits,
                    prompt=prompt,
                    params=params,
                    stop=tuple(params.stop),
                    skip_special_tokens=(
                        request.skip_special_tokens
                        if request.HasField("skip_special_tokens")
                        else True
                    ),
                    admitted=started,
                )
        finally:
            self._admitting -= 1
        if self._cut:
            raise ShutDown(cut=self._hurry)
        self._claim_id(r)
        self.metrics.prompt_tokens.inc(len(prompt))
        extra = {"req_id": clip(r.request_id), "model": model, "prompt_tokens": len(prompt)}
        log.info("request admitted", extra=extra)
        self._route(r)
        return r

    async def _resolve(self, asked: str) -> str:
        """The model a request names (ModelNotFound), or the fleet's only one for ""."""
        if not self.models():  # nothing configured and no worker up yet: wait for one
            await self._some_link("")
        return self.residency.resolve(asked)

    def _model_named(self, asked: str) -> str:
        """The model a refused request counts under: as `_resolve` finds it, else as named."""
        with contextlib.suppress(BadRequest, ModelNotFound):
            return self.residency.resolve(asked)
        return asked

    def _claim_id(self, r: FleetRequest) -> None:
        """Gives `r` a worker-side id no other live request has: its request_id is the
        caller's (for logs), and two callers may send the same one at once."""
        key = r.request_id
        while (holder := self._live.get(key)) is not None and holder.phase is not Phase.DONE:
            key = f"{r.request_id}~{next(self._suffixes)}"
        r.worker_key = key
        self._live[key] = r


def _fleet_error(exc: BaseException) -> WorkerError | ClientError | None:
    """The fleet's or a worker's error under `exc` (the caller's own, raised from it), if
    any; a chain that comes back on itself (`raise e from e`) is followed once."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, WorkerError | ClientError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__
    return None
