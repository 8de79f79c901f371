"""The fleet scheduler: many workers behind one Generate.

Requests are admitted into a bounded queue (past it, `Overloaded` at once),
routed to a worker (`prefix`: requests sharing their first `affinity_tokens`
tokens go where that prefix went before, so its KV is in that worker's prefix
cache; otherwise, and in `least-loaded` mode, the worker with the least work),
and streamed back as the worker's `GenerateResponse` messages. Stop strings
are checked here on the detokenized text. A request whose worker dies
continues on another from prompt + generated tokens; callers see no error.
Each request logs a line, with its `req_id`, when it is admitted, moves to
another worker and ends, and is counted in `metrics` (fleet/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import grpc

from mlx_worker_svc.client.worker import ClientError
from mlx_worker_svc.core.errors import InvalidArgument, ResourceExhausted, Unavailable, WorkerError
from mlx_worker_svc.core.log_format import clip
from mlx_worker_svc.fleet.config import LinkConfig
from mlx_worker_svc.fleet.link import WorkerLink
from mlx_worker_svc.fleet.metrics import FleetMetrics, error_outcome, finish_outcome
from mlx_worker_svc.fleet.request import FleetRequest, Phase
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)
Routing = Literal["prefix", "least-loaded"]
# Outcomes that are finish reasons (a request that ended normally).
_FINISHED = frozenset(finish_outcome(v) for v in pb.FinishReason.values())


class FleetError(WorkerError):
    """A request the fleet cannot take; `code` is the status callers get."""


class Overloaded(FleetError, ResourceExhausted):
    """The queue is full."""


class NoWorkers(FleetError, Unavailable):
    """No worker is up (in time)."""


class BadRequest(FleetError, InvalidArgument):
    """The request is malformed."""


class ContextTooLong(BadRequest):
    """The prompt (with room for `max_tokens`, when asked) does not fit the model's context."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, context_length: int) -> None:
        asked = f" and max_tokens is {max_tokens}" if max_tokens is not None else ""
        super().__init__(
            f"the prompt has {prompt_tokens} tokens{asked}; "
            f"the model's context length is {context_length} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.context_length = context_length


class OutOfVocabulary(BadRequest):
    """A token id of the request (`field` names where) is not in the model's vocabulary."""

    def __init__(self, field: str, token: int, vocab_size: int) -> None:
        super().__init__(f"{field}: token {token} is out of the vocabulary (size {vocab_size})")
        self.field, self.token, self.vocab_size = field, token, vocab_size


@dataclass(frozen=True)
class FleetConfig:
    link: LinkConfig = field(default_factory=LinkConfig)
    queue_capacity: int = 256
    routing: Routing = "prefix"
    affinity_tokens: int = 256
    # How long a request may wait for any worker to be up before it fails.
    no_worker_timeout: float = 30.0


class FleetScheduler:
    def __init__(self, targets: list[str], config: FleetConfig | None = None) -> None:
        if not targets:
            raise ValueError("a fleet needs at least one worker")
        self.config = config or FleetConfig()
        self.links = [
            WorkerLink(
                t, self.config.link, on_lost=self._failover, on_up=self._on_up, emit=self._emit
            )
            for t in dict.fromkeys(targets)
        ]
        self._pending: list[tuple[float, FleetRequest]] = []
        self._where: dict[FleetRequest, WorkerLink] = {}
        self._affinity: dict[int, WorkerLink] = {}
        self._turn = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._any_up = asyncio.Event()
        self.num_finished = 0
        self.num_rejected = 0
        self._admitting = 0  # admitted requests whose prompt is being tokenized
        self.metrics = FleetMetrics()

    # --------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.metrics.watch(self.status, asyncio.get_running_loop())
        self._tasks = [asyncio.create_task(link.run(), name=link.target) for link in self.links]
        self._tasks.append(asyncio.create_task(self._watchdog(), name="fleet-watchdog"))

    async def wait_ready(self, count: int = 1, timeout: float = 120.0) -> None:
        """Waits until `count` workers are up (raises TimeoutError)."""
        deadline = time.monotonic() + timeout
        while sum(link.up for link in self.links) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} workers came up in {timeout:.0f} s")
            await asyncio.sleep(0.05)

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
        )

    def _queued(self) -> int:
        waiting = sum(len(link.waiting) for link in self.links)
        return self._admitting + len(self._pending) + waiting

    def _up(self) -> list[WorkerLink]:
        return [link for link in self.links if link.up]

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
        try:
            r = await self._admit(request, started, reserve_max_tokens)
        except (WorkerError, ClientError) as exc:
            self._ended(request.request_id, error_outcome(exc.code), started, error=str(exc))
            raise
        try:
            while True:
                message = await r.outbox.get()
                if isinstance(message, BaseException):
                    code = getattr(message, "code", grpc.StatusCode.UNKNOWN)
                    self._ended(r.request_id, error_outcome(code), r.admitted, error=str(message))
                    raise message
                yield message
                if message.finish_reason:
                    return
        finally:
            if r.phase is not Phase.DONE:
                self._cancel(r)
                self._ended(r.request_id, "cancelled", r.admitted)
            self._where.pop(r, None)

    async def _admit(
        self, request: pb.GenerateRequest, started: float, reserve_max_tokens: bool
    ) -> FleetRequest:
        """Takes a request into the queue and routes it (raises FleetError, ClientError)."""
        if self._queued() >= self.config.queue_capacity:
            self.num_rejected += 1
            raise Overloaded(
                f"the fleet's queue is full ({self.config.queue_capacity} requests waiting); "
                "retry later"
            )
        # The slot is taken before the prompt is tokenized (an await), so
        # requests arriving meanwhile see it and the bound holds.
        self._admitting += 1
        params = request.sampling_params
        try:
            prompt = await self._prompt(request)
            await self._fit_model(prompt, params, reserve_max_tokens)
        finally:
            self._admitting -= 1
        r = FleetRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt=prompt,
            params=params,
            stop=tuple(params.stop),
            skip_special_tokens=(
                request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            ),
            admitted=started,
        )
        self.metrics.prompt_tokens.inc(len(prompt))
        log.info(
            "request admitted", extra={"req_id": clip(r.request_id), "prompt_tokens": len(prompt)}
        )
        self._route(r)
        return r

    def _ended(self, req_id: str, outcome: str, since: float, **fields: object) -> None:
        """Counts and logs a request's end: finished, cancelled or failed (`outcome`)."""
        self.metrics.ended(outcome, time.monotonic() - since)
        extra = {"req_id": clip(req_id), "outcome": outcome, **fields}
        if outcome == "cancelled":
            log.info("request cancelled", extra=extra)
        elif outcome in _FINISHED:
            log.info("request finished", extra=extra)
        else:
            log.warning("request failed", extra=extra)

    async def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        forms = sum(bool(x) for x in (request.prompt, request.messages, request.prompt_token_ids))
        if forms != 1:
            raise BadRequest("Generate needs exactly one of prompt, messages or prompt_token_ids")
        if request.sampling_params.HasField("prompt_logprobs"):
            raise BadRequest(
                "sampling_params.prompt_logprobs: GenerateResponse has no field for them; "
                "use WorkerService.Execute"
            )
        if request.tools_json and not request.messages:
            raise BadRequest("tools_json needs messages (a chat to render the tools into)")
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        link = await self._some_link()
        if request.messages:
            ask = pb.TokenizeRequest(messages=request.messages, tools_json=request.tools_json)
        else:
            ask = pb.TokenizeRequest(text=request.prompt, add_special_tokens=True)
        return list((await link.client.tokenize(ask)).token_ids)

    async def _fit_model(self, prompt: list[int], params: pb.SamplingParams, reserve: bool) -> None:
        """Raises what the workers would refuse mid-step, in the request's own terms."""
        link = await self._some_link()
        vocab = link.vocab_size
        named = {
            "prompt_token_ids": prompt,
            "sampling_params.logit_bias": list(params.logit_bias),
            "sampling_params.stop_token_ids": list(params.stop_token_ids),
        }
        for name, ids in named.items():
            if vocab and max(ids, default=0) >= vocab:
                raise OutOfVocabulary(name, next(t for t in ids if t >= vocab), vocab)
        limit = link.max_context
        max_tokens = params.max_tokens if params.HasField("max_tokens") else None
        need = len(prompt) + ((max_tokens or 1) if reserve else 0)
        if limit and need > limit:
            raise ContextTooLong(len(prompt), max_tokens if reserve else None, limit)

    async def chat_template(self) -> str:
        """The model's chat template (Jinja source; empty when it has none), from a worker up."""
        return (await self._some_link()).chat_template

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """Tokenize on the least-loaded worker that is up (the fleet serves one model)."""
        return await (await self._some_link()).client.tokenize(request)

    async def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        """Detokenize on the least-loaded worker that is up (the fleet serves one model)."""
        return await (await self._some_link()).client.detokenize(request)

    async def _some_link(self) -> WorkerLink:
        deadline = time.monotonic() + self.config.no_worker_timeout
        while not self._up():
            if time.monotonic() > deadline:
                raise NoWorkers("no worker of the fleet is up")
            await asyncio.sleep(0.05)
        return min(self._up(), key=lambda link: link.load)

    # ----------------------------------------------------------- routing
    def _route(self, r: FleetRequest, *, front: bool = False) -> None:
        up = self._up()
        if not up:
            entry = (time.monotonic(), r)
            self._pending.insert(0, entry) if front else self._pending.append(entry)
            return
        link = self._pick(r, up)
        self._where[r] = link
        log.debug("request routed", extra={"req_id": clip(r.request_id), "worker": link.target})
        link.assign(r, front=front)

    def _pick(self, r: FleetRequest, up: list[WorkerLink]) -> WorkerLink:
        turn = next(self._turn)
        spread = min(up, key=lambda link: (link.load, (up.index(link) - turn) % len(up)))
        if self.config.routing != "prefix" or len(r.prompt) < self.config.affinity_tokens:
            return spread
        key = hash(tuple(r.prompt[: self.config.affinity_tokens]))
        home = self._affinity.get(key)
        busy = self.config.link.max_num_seqs
        if home is None or not home.up or home.load >= spread.load + busy:
            self._affinity[key] = home = spread
        return home

    def _on_up(self, link: WorkerLink) -> None:
        self._any_up.set()
        waiting, self._pending = self._pending, []
        for _, r in waiting:
            self._route(r)

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
        self._pending = [(t, p) for t, p in self._pending if p is not r]

    async def _watchdog(self) -> None:
        """Fails requests that waited too long for any worker to come up."""
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            keep = []
            for since, r in self._pending:
                if now - since > self.config.no_worker_timeout:
                    r.phase = Phase.DONE
                    r.outbox.put_nowait(NoWorkers("no worker of the fleet came up in time"))
                else:
                    keep.append((since, r))
            self._pending = keep

    # ------------------------------------------------------------ stream
    async def _emit(self, link: WorkerLink, r: FleetRequest) -> bool:
        """Streams what a step gave `r`; returns whether a stop string ended it."""
        full = await self._detokenize(link, r)
        stop: str | None = None
        piece = ""
        if full is not None:
            piece, stop = r.new_text(full)
        tokens, logprobs = r.take_tokens()
        message = pb.GenerateResponse(
            token_ids=tokens, text=piece, logprobs=logprobs, request_id=r.request_id
        )
        self.metrics.generation_tokens.inc(len(tokens))
        if not r.streamed:
            r.streamed = True
            message.num_cached_prompt_tokens = r.cached_tokens
            self.metrics.time_to_first_token.observe(time.monotonic() - r.admitted)
        if stop is not None or r.phase is Phase.DONE:
            if stop is not None:
                message.finish_reason = pb.FINISH_REASON_STOP_STRING
                message.stop_string = stop
            else:
                message.finish_reason = r.finish_reason
                message.text += r.flush()
            message.prompt_tokens = len(r.prompt)
            message.completion_tokens = len(r.generated)
            r.phase = Phase.DONE
            self.num_finished += 1
            self._ended(
                r.request_id,
                finish_outcome(message.finish_reason),
                r.admitted,
                worker=link.target,
                prompt_tokens=message.prompt_tokens,
                completion_tokens=message.completion_tokens,
            )
        if message.token_ids or message.text or message.finish_reason:
            r.outbox.put_nowait(message)
        return stop is not None

    async def _detokenize(self, link: WorkerLink, r: FleetRequest) -> str | None:
        ask = pb.DetokenizeRequest(token_ids=r.generated, skip_special_tokens=r.skip_special_tokens)
        for candidate in [link, *(other for other in self._up() if other is not link)]:
            with contextlib.suppress(ClientError):
                return (await candidate.client.detokenize(ask)).text
        return None
