"""The fleet scheduler: many workers behind one Generate.

Requests are admitted into a bounded queue (past it, `Overloaded` at once),
routed to a worker (routing.py: prefix affinity or least-loaded), and
streamed back as the worker's `GenerateResponse` messages. Stop strings
are checked here on the detokenized text. A request whose worker dies
continues on another from prompt + generated tokens; callers see no error.
Each request logs a line, with its `req_id`, when it is admitted, moves to
another worker and ends, and is counted in `metrics` (fleet/metrics.py).

Workers may serve different models: a request names one
(`GenerateRequest.model`, resolved against `ModelCatalog`, fleet/models.py)
and is tokenized, routed, given prefix affinity and failed over among the
workers of that model only. A configured model that no worker holds is loaded
on demand (`models.plan_loads`): its requests wait in the queue meanwhile
(fleet/pending.py, which also fails those no worker will come for); one naming
a LoRA adapter runs on a worker that holds it (fleet/adapters.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.errors import WorkerError
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.fleet.adapters import AdapterPlacement
from mlx_worker_svc.fleet.checks import kv_budget_refusal, largest_kv_budget
from mlx_worker_svc.fleet.config import FleetConfig
from mlx_worker_svc.fleet.errors import (
    FleetError,
    LoadFailed,
    NoWorkers,
    Outgrew,
    ShutDown,
)
from mlx_worker_svc.fleet.intake import Intake
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.fleet.metrics import FleetMetrics, error_outcome, finish_outcome
from mlx_worker_svc.fleet.models import ModelCatalog
from mlx_worker_svc.fleet.pending import PendingRequests
from mlx_worker_svc.fleet.request import FleetRequest, Phase
from mlx_worker_svc.fleet.residency import Residency
from mlx_worker_svc.fleet.routing import Router
from mlx_worker_svc.fleet.text_calls import TextCalls
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)
# Outcomes that are finish reasons (a request that ended normally).
_FINISHED = frozenset(finish_outcome(v) for v in pb.FinishReason.values())


class FleetScheduler(Intake):
    def __init__(self, targets: list[str], config: FleetConfig | None = None) -> None:
        if not targets:
            raise ValueError("a fleet needs at least one worker")
        self.config = config or FleetConfig()
        self.catalog = ModelCatalog(self.config.models)
        self.metrics = FleetMetrics()
        self.links: list[WorkerLink] = []  # filled below, once `pending` exists
        self.residency = Residency(self.catalog, self.links, self.metrics)
        self.adapters = AdapterPlacement(self.config.lora_modules, self.config.lora_bases)
        self._up = self.residency.up
        self.pending = PendingRequests(
            self.residency,
            self.adapters,
            timeout=self.config.no_worker_timeout,
            on_up=self._on_up,
            why_down=self._why_down,
        )
        self.links.extend(
            WorkerLink(
                t,
                self.config.link,
                on_lost=self._failover,
                on_up=self._on_up,
                emit=self._emit,
                on_load_failed=self.pending.load_failed,
                on_adapters=self.adapters.take_listing,
                catalog=self.catalog,
                initial=self.catalog.initial(i),
            )
            for i, t in enumerate(dict.fromkeys(targets))
        )
        self._suffixes = itertools.count(1)
        self._where: dict[FleetRequest, WorkerLink] = {}
        busy = self.config.link.max_num_seqs  # a full batch: prefix affinity yields past it
        self._router = Router(self.config.routing, self.config.affinity_tokens, busy)
        self._tasks: list[asyncio.Task[None]] = []
        self.num_finished = 0
        self.num_rejected = 0
        self.draining = False  # drain(): no new request is taken
        # Admitted requests whose stream has not ended, by the id their workers know
        # them by (`_claim_id`).
        self._live: dict[str, FleetRequest] = {}
        self._admitting = 0  # admitted requests whose prompt is being tokenized
        self._cut = False  # drain(): the grace ran out; requests still admitting end
        self._hurry = False  # hurry(): the grace period ends now
        self.text = TextCalls(
            lambda model, want: self._some_link(model, want=want),
            self._up,
            self.config.link.detection_seconds,
        )

    # --------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.metrics.watch(self.status, asyncio.get_running_loop())
        self._tasks = [asyncio.create_task(link.run(), name=link.target) for link in self.links]
        self._tasks.append(asyncio.create_task(self.pending.watch(), name="fleet-watchdog"))

    async def wait_ready(self, count: int = 1, timeout: float = 120.0) -> None:
        """Waits until `count` workers are up (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        while sum(link.up for link in self.links) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} workers came up in {timeout:.0f} s")
            await asyncio.sleep(0.05)

    async def drain(self, grace: float) -> None:
        """Takes no new request (ShuttingDown, UNAVAILABLE), lets the live ones run for
        up to `grace` seconds, then ends those left with ShutDown (ABORTED), freeing them
        on their workers."""
        self.draining = True
        deadline = time.monotonic() + grace
        # Requests admitted before the drain and still being tokenized (or waiting
        # for a worker) count as live: they run too, or end ShutDown at the cut.
        while (self._live or self._admitting) and time.monotonic() < deadline:
            if self._hurry:  # hurry(): a second signal
                break
            await asyncio.sleep(0.05)
        self._cut = True
        for r in list(self._live.values()):
            if r.phase is not Phase.DONE:
                self._cancel(r)
                r.phase = Phase.DONE
                r.outbox.put_nowait(ShutDown(cut=self._hurry))
        while (self._live or self._admitting) and time.monotonic() < deadline + 5:  # they end
            await asyncio.sleep(0.01)

    def hurry(self) -> None:
        """Ends the grace period of a drain under way at once (a second signal)."""
        if self.draining and not self._hurry:
            log.info("draining: the grace period is cut short; requests in flight end now")
            self._hurry = True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in self.links:
            await link.close()

    # ------------------------------------------------------------ status
    def status(self) -> fleet_pb2.StatusResponse:
        return fleet_pb2.StatusResponse(
            workers=[link.status() for link in self.links],
            num_queued=self._queued(),
            queue_capacity=self.config.queue_capacity,
            num_finished=self.num_finished,
            num_rejected=self.num_rejected,
            models=[
                self.residency.status(name, self.pending.count(name)) for name in self.models()
            ],
        )

    def models(self) -> list[str]:
        """Every model: the configured ones in order, then those workers held, by name."""
        return self.residency.models()

    # ---------------------------------------------------------- generate
    async def generate(
        self, request: pb.GenerateRequest, *, reserve_max_tokens: bool = False
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Runs one request on the fleet; yields the worker's Generate messages.

        A prompt longer than the context (`ContextTooLong`) or a token id out
        of the vocabulary (`OutOfVocabulary`) is refused before it is routed.
        With `reserve_max_tokens` (OpenAI's rule) the prompt must also leave
        room for `max_tokens` more, or for one token when that is unset;
        without it an answer stops at the end of the context, as the worker's
        Generate does.
        """
        started = time.monotonic()
        req_id = request.request_id or uuid.uuid4().hex  # for the logs, refused or not
        try:
            r = await self._admit(request, req_id, started, reserve_max_tokens)
        except (WorkerError, ClientError) as exc:
            model = self._model_named(request.model)
            self._ended(req_id, model, error_outcome(exc.code), started, error=str(exc))
            raise
        except asyncio.CancelledError:  # the caller left while it waited for a worker
            self._ended(req_id, self._model_named(request.model), "cancelled", started)
            raise
        try:
            while True:
                message = await r.outbox.get()
                if isinstance(message, BaseException):
                    code = getattr(message, "code", grpc.StatusCode.UNKNOWN)
                    self._ended(
                        r.request_id, r.model, error_outcome(code), r.admitted, error=str(message)
                    )
                    raise message
                yield message
                if message.finish_reason:
                    return
        finally:
            if r.phase is not Phase.DONE:
                self._cancel(r)
                self._ended(r.request_id, r.model, "cancelled", r.admitted)
            self._where.pop(r, None)
            if self._live.get(r.worker_key) is r:
                del self._live[r.worker_key]

    def _ended(self, req_id: str, model: str, outcome: str, since: float, **fields: object) -> None:
        """Counts and logs a request's end: finished, cancelled or failed (`outcome`)."""
        self.metrics.ended(outcome, time.monotonic() - since)
        self.residency.ended[model] += 1
        extra = {"req_id": clip(req_id), "model": model, "outcome": outcome, **fields}
        if outcome in ("cancelled", "aborted"):  # the caller left; a drain ended it
            log.info(f"request {outcome}", extra=extra)
        elif outcome in _FINISHED:
            log.info("request finished", extra=extra)
        else:
            log.warning("request failed", extra=extra)

    async def chat_template(self, model: str = "") -> str:
        """The model's chat template (Jinja source; empty when it has none), from a worker up."""
        return (await self._some_link(await self._resolve(model))).chat_template

    async def tokenize(self, request: pb.TokenizeRequest, model: str = "") -> pb.TokenizeResponse:
        """Tokenize on the least-loaded worker of `model` that is up ("": the only model)."""
        answer: pb.TokenizeResponse = await self.text.call(
            await self._resolve(model), "tokenize", request, want=True
        )
        return answer

    async def detokenize(
        self, request: pb.DetokenizeRequest, model: str = ""
    ) -> pb.DetokenizeResponse:
        """Detokenize on the least-loaded worker of `model` that is up ("": the only model)."""
        answer: pb.DetokenizeResponse = await self.text.call(
            await self._resolve(model), "detokenize", request, want=True
        )
        return answer

    async def _some_link(self, model: str, *, want: bool = True) -> WorkerLink:
        """The least-loaded worker up with `model`; waits for one (loading it on demand,
        counted as wanted meanwhile unless the caller counts it)."""
        began = time.monotonic()
        deadline = began + self.config.no_worker_timeout
        with self.residency.wanting(model) if want else contextlib.nullcontext():
            while not self._up(model):
                if self._cut:
                    raise ShutDown(cut=self._hurry)
                self.pending.place()
                failed = self.residency.failed_since(model, began)
                if failed is not None:
                    raise LoadFailed(failed)
                if time.monotonic() > deadline and not self.residency.may_load(model):
                    whose = f" of model {model!r}" if model else ""
                    raise NoWorkers(f"no worker{whose} of the fleet is up{self._why_down()}")
                await asyncio.sleep(0.05)
        return min(self._up(model), key=lambda link: link.load)

    def _why_down(self) -> str:
        """The causes the workers that are down last gave, for a NoWorkers message."""
        causes = [f"{link.target}: {link.last_error}" for link in self.links if link.last_error]
        return f" ({'; '.join(causes)})" if causes else ""

    # ----------------------------------------------------------- routing
    def _route(self, r: FleetRequest, *, front: bool = False) -> None:
        up = self.adapters.holders(self._up(r.model), r.lora_name)
        if not up:
            self.pending.put(r, front=front)
            return
        # Only a worker whose whole KV budget holds the request: on another it would wait
        # for room that never comes (and hold up the requests behind it).
        need = len(r.tokens) + 1
        room = [link for link in up if link.holds(need)]
        if not room:
            self._unheld(r, need, up, front=front)
            return
        if r.waited_for_load and not r.streamed and not r.attempt:
            self.metrics.load_wait(r.model, time.monotonic() - r.admitted)
        # Where its whole answer fits, if a worker's budget holds that: elsewhere it would
        # outgrow the worker's KV before it ends.
        whole = [link for link in room if link.holds(r.final_length(link.max_context))]
        link = self._router.pick(r, whole or room)
        self._where[r] = link
        log.debug("request routed", extra={"req_id": clip(r.request_id), "worker": link.target})
        link.assign(r, front=front)

    def _unheld(self, r: FleetRequest, need: int, up: list[WorkerLink], *, front: bool) -> None:
        """A request no worker up holds: a new one is refused at once; one that ran (moving
        off a lost worker) waits for a worker of its model that held it, while one may
        come back, and otherwise fails saying how far it got."""
        budgets = [(link.num_blocks, link.block_size) for link in up]
        error: FleetError | None
        if r.attempt or r.generated:
            mine = [link for link in self.links if r.model in ("", link.model_name)]
            if any(not link.up and link.holds(need) for link in mine):
                self.pending.put(r, front=front)
                return
            error = Outgrew(len(r.prompt), len(r.generated), largest_kv_budget(budgets))
        else:
            error = kv_budget_refusal(need, budgets, "prompt_token_ids", len(r.tokens))
        assert error is not None  # every worker up has a budget, and none holds `need`
        r.phase = Phase.DONE
        r.outbox.put_nowait(error)

    def _on_up(self, link: WorkerLink) -> None:
        self.residency.on_up(link)
        self.adapters.learn(link)
        self.adapters.warn_shadowed(self.links, self.models())
        adapters = {"", *link.adapters}
        for r in self.pending.take(
            lambda r: r.model in ("", link.model_name) and r.lora_name in adapters
        ):
            self._route(r)
        self.pending.place()

    def _failover(self, lost: list[FleetRequest]) -> None:
        for r in reversed(lost):
            if r.phase is Phase.DONE or r.cancelled:
                continue
            extra = {"req_id": clip(r.request_id), "generated_tokens": len(r.generated)}
            log.info("request moves to another worker", extra=extra)
            self._route(r, front=True)

    def _cancel(self, r: FleetRequest) -> None:
        r.cancelled = True
        link = self._where.get(r)
        if link is not None:
            link.cancel(r)
        self.pending.drop(r)

    # ------------------------------------------------------------ stream
    def _emit(self, link: WorkerLink, r: FleetRequest) -> bool:
        """Streams what a step gave `r`; returns whether a stop string ended it."""
        first = not r.streamed
        message, stopped = r.next_message()
        self.metrics.generation_tokens.inc(len(message.token_ids))
        if first:
            self.metrics.first_token(r.model, time.monotonic() - r.admitted, r.waited_for_load)
        if message.finish_reason:
            if stopped:  # the fleet ends it (the worker's finishes count there)
                link.stats.num_finished += 1
            self.num_finished += 1
            self.pending.place()  # its worker may be idle now
            self._ended(
                r.request_id,
                r.model,
                finish_outcome(message.finish_reason),
                r.admitted,
                worker=link.target,
                prompt_tokens=message.prompt_tokens,
                completion_tokens=message.completion_tokens,
            )
        if message.token_ids or message.text or message.finish_reason:
            r.outbox.put_nowait(message)
        return stopped
