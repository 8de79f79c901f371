"""One worker as the fleet drives it: bring-up, the step loop, failure.

A `WorkerLink` owns one worker's client and a continuous-batching loop over
the requests routed to it: each step gives every decoding request one token,
then fills the token budget with prefill chunks, admitting waiting requests
while the KV budget the worker reported has room. It speaks only the public
Execute protocol. An idle worker is probed with CheckHealth every
`probe_interval` seconds (one attempt, `probe_timeout` each); a busy one shows
it lives with each step's reply, and is probed the same way while a reply is
later than `probe_interval`. When it refuses
connections, misses `probe_misses` probes in a row (hung), or comes back with a
new `worker_epoch` (restarted), every request on it is handed back to the
fleet to continue elsewhere: a hang is found within
`probe_misses x (probe_interval + probe_timeout)` seconds. The link then probes
it with backoff until it is back. A worker bringing itself up
(`serve --auto-init`, CheckHealth.bringing_up) is waited for, never driven;
requests go to a worker only once it is READY or SERVING. `swap_model` has an
idle worker load another model (bring_up.py): it is down meanwhile, and back
on its own model if the load fails. What the fleet knows of the worker, and
the views read of it, are `LinkState`'s (link_state.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from typing import Literal

import grpc

from mlx_worker_svc.client.step_stream import step_error
from mlx_worker_svc.client.worker import AsyncWorkerClient, ClientError
from mlx_worker_svc.fleet.bring_up import (
    ModelNotFetched,
    drive_up,
    held_adapters,
    load_refused,
    not_fetched,
)
from mlx_worker_svc.fleet.config import LinkConfig
from mlx_worker_svc.fleet.link_state import LinkState
from mlx_worker_svc.fleet.models import ModelCatalog
from mlx_worker_svc.fleet.pipeline import views_of
from mlx_worker_svc.fleet.probe import Prober, hint
from mlx_worker_svc.fleet.request import FleetRequest, Phase
from mlx_worker_svc.fleet.step_outcome import (
    apply_outputs,
    cancel,
    lost_adapter,
    refuse_step,
    restart_stalled,
    undo_step,
    without_adapter,
    worker_lost,
)
from mlx_worker_svc.fleet.step_plan import KVRoom, decode_steps, plan_step
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)

_BringUp = Literal["up", "starting", "down"]


class WorkerLink(LinkState):
    def __init__(
        self,
        target: str,
        config: LinkConfig,
        *,
        on_lost: Callable[[list[FleetRequest]], None],
        on_up: Callable[[WorkerLink], None],
        emit: Callable[[WorkerLink, FleetRequest], bool],
        on_load_failed: Callable[[WorkerLink, str, Exception], None] | None = None,
        on_adapters: Callable[[WorkerLink, pb.ListLorasResponse], None] | None = None,
        catalog: ModelCatalog | None = None,
        initial: str = "",
    ) -> None:
        super().__init__(target, config, catalog or ModelCatalog())
        self.initial = initial  # LoadModel's model when the worker holds none
        # What the worker holds just before the fleet swaps its model (which drops its
        # adapters): those added from outside are learned with the model they ran on.
        self._on_adapters = on_adapters
        self.client = AsyncWorkerClient(target, config.client)
        self._prober = Prober(target, config)
        self._swap = ""  # the path drive_up puts in place of the worker's model
        self._on_lost, self._on_up, self._emit = on_lost, on_up, emit
        self._on_load_failed = on_load_failed
        self._wake = asyncio.Event()
        self._closed = False
        self._step_id = 0
        self._orphans: list[str] = []  # ids a lost worker may still hold

    # ----------------------------------------------------------- control
    def assign(self, request: FleetRequest, *, front: bool = False) -> None:
        """Queues a request here (`front`: ahead of the others, e.g. after failover)."""
        request.phase = Phase.QUEUED
        self.last_used = time.monotonic()
        if front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)
        self._wake.set()

    def cancel(self, request: FleetRequest) -> None:
        """Frees a request's worker state at the next step (sent at once when idle)."""
        cancel(request, self._queues)
        self._wake.set()

    def swap_model(self, name: str, path: str) -> None:
        """Loads model `name` (from `path`) in place of this idle worker's own, then serves it."""
        assert self.idle and self.up, "only an idle worker that is up changes its model"
        self.up, self.loading, self._swap = False, name, path
        if self._pipe is not None:  # its ExecuteStream ends with the model
            self._pipe.reset()
        self._wake.set()

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._pipe is not None:
            self._pipe.reset()
        await self.client.close()
        await self._prober.close()

    # -------------------------------------------------------------- loop
    async def run(self) -> None:
        backoff = self.config.retry_backoff
        while not self._closed:
            if not self.up:
                outcome = await self._bring_up()
                self.reached = True
                if outcome == "up":
                    backoff = self.config.retry_backoff
                    self._on_up(self)
                elif outcome == "starting":  # answering: look again soon
                    await asyncio.sleep(self.config.probe_interval)
                else:
                    await asyncio.sleep(backoff * (1 + random.random() / 4))
                    backoff = min(backoff * 2, self.config.max_backoff)
                continue
            if not (self.running or self.waiting or self.to_free or self._in_flight):
                await self._idle()
                continue
            await (self._stream_step() if self._pipe is not None else self._step())

    async def _idle(self) -> None:
        """Waits for work, probing the worker every probe interval meanwhile."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.config.probe_interval)
        if not self._wake.is_set() and not self._closed:
            why = await self._probe()
            if why is not None:
                self._lose_everything(why)

    async def _probe(self) -> str | None:
        """One CheckHealth: None while the worker is usable, else why it is not."""
        return await self._prober.check(self.epoch)

    async def _bring_up(self) -> _BringUp:
        """Takes the worker through its lifecycle, adopts it if it is ready, or
        waits while it brings itself up."""
        try:
            health = await self._prober.health()
            self.state = health.state  # Status shows what the probe answered while down
            if health.bringing_up:
                self.last_error = "the worker is bringing itself up (serve --auto-init): waiting"
                return "starting"
            began = time.monotonic()
            if self._swap and self.model_name and self._on_adapters is not None:
                self._on_adapters(self, await self.client.list_loras(pb.ListLorasRequest()))
            info = await drive_up(self.client, self.config, load=self.initial, swap=self._swap)
            loras = await held_adapters(self.client)
            if info.worker_epoch == self.epoch:
                await self._free_orphans()
        except (ClientError, RuntimeError) as exc:
            # A worker that stays down fails the same way at every try: WARNING
            # once, DEBUG while the cause stays the same (Status has it meanwhile).
            why = f"{exc}{hint(exc, self.config)}"
            same, self.last_error = self.last_error == why, why
            (log.debug if same else log.warning)("worker %s not usable: %s", self.target, why)
            if self.loading:
                name, self.loading = self.loading, ""
                # Back to the model it had (it may be asleep without weights).
                self._swap = self.catalog.path_of(self.model_name) or self.model
                if self._on_load_failed is not None:
                    cause: Exception = exc
                    if not_fetched(exc) and await self._prober.answers():  # the model failed
                        cause = ModelNotFetched(str(exc))
                    self._on_load_failed(self, name, cause)
            elif load_refused(exc) and self.initial:
                # The model it was to start with does not load (a bad path): its
                # requests fail with the cause, and the next try is the next model.
                failed, self.initial = self.initial, self.catalog.after(self.initial)
                if self._on_load_failed is not None:
                    self._on_load_failed(self, self.catalog.name_of(failed), exc)
            return "down"
        if self.loading:
            self.num_loads += 1
            took = time.monotonic() - began
            log.info("worker %s loaded model %s in %.1f s", self.target, self.loading, took)
        self.loading = self._swap = ""
        self._orphans.clear()
        self.adopt(info, loras)
        self.up, self.last_error, self._prober.misses = True, "", 0
        log.info(
            "worker %s up: epoch %d, %d KV blocks (%s KV)",
            self.target,
            self.epoch,
            self.num_blocks,
            f"{self.kv_format[0]}-bit" if self.kv_format[0] else "float",
        )
        return "up"

    async def _free_orphans(self) -> None:
        """Back with the same epoch (it was hung, not restarted): free what it still holds.
        A refusal other than NOT_FOUND (the request never arrived) is raised: a worker
        that will not free them (one that drains now: UNAVAILABLE) is not taken back."""
        for worker_id in self._orphans:
            step = pb.ExecuteRequest(
                step_id=self._step_id, worker_epoch=self.epoch, finished_req_ids=[worker_id]
            )
            self._step_id += 1
            try:
                await self.client.execute(step)
            except ClientError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise

    def _lose_everything(self, why: str) -> None:
        """The worker died, hung or restarted: every request goes back to the fleet."""
        self.up, self.last_error = False, why  # its state stays the one last seen
        if self._pipe is not None:
            self._pipe.reset()
        self._orphans = [*self.running, *self.to_free]
        lost = [*self.running.values(), *self.waiting]
        self.running.clear()
        self.waiting.clear()
        self.to_free.clear()
        self.stats.num_failed_over += len(lost)
        log.warning("worker %s lost (%s): %d requests move on", self.target, why, len(lost))
        self._on_lost(lost)

    # -------------------------------------------------------------- step
    def _plan(
        self, views: dict[str, tuple[int, int]]
    ) -> tuple[pb.ExecuteRequest, list[FleetRequest]]:
        """The next step (step_plan.py); `views` (from `views_of`) gains the requests it starts."""
        gone = without_adapter(self.waiting, self.adapters)
        if gone:  # evicted or removed since they were routed here: routed again
            self._on_lost(gone)
        request = pb.ExecuteRequest(step_id=self._step_id, worker_epoch=self.epoch)
        self._step_id += 1
        request.finished_req_ids.extend(self.to_free)
        self.to_free.clear()
        kv = KVRoom(self.num_blocks, self.block_size)
        started, used = plan_step(
            request,
            views,
            self.waiting,
            self.running,
            budget=self.config.max_num_batched_tokens,
            used=self._used_blocks(),
            max_seqs=self.max_seqs,
            kv=kv,
            max_bytes=self.max_message,
        )
        idle = not self._in_flight
        stalled = restart_stalled(request, self._queues, idle=idle)
        if stalled:  # a bug: logged so that it is found, and mended here
            log.warning(
                "worker %s: a step planned nothing for its %d running requests (computed, "
                "length: %s); they restart from their tokens",
                self.target,
                len(stalled),
                ", ".join(f"{w} {views.get(w)}" for w in stalled),
            )
        request.num_decode_steps = decode_steps(
            self.config.decode_steps,
            request,
            self.running,
            waiting=bool(self.waiting),
            used=used,
            kv=kv,
        )
        return request, started

    async def _step(self) -> None:
        request, started = self._plan(views_of(self._pipe, self.running))
        if not request.num_scheduled_tokens and not request.finished_req_ids:
            # Nothing fits: wait for room (a finish) or new work, probing meanwhile.
            await self._idle()
            return
        execute = asyncio.create_task(self.client.execute(request))
        while not execute.done():
            await asyncio.wait({execute}, timeout=self.config.probe_interval)
            if execute.done():
                break
            why = await self._probe()
            if why is not None and not execute.done():
                execute.cancel()
                self._lose_everything(why)
                return
        try:
            response = execute.result()
        except ClientError as exc:
            self._step_failed(exc, request, started)
            return
        self._deliver(response)

    async def _stream_step(self) -> None:
        """Sends the next step if there is room and work, else takes the oldest reply."""
        pipe = self._pipe
        assert pipe is not None
        if pipe.room:
            views = views_of(self._pipe, self.running)
            request, started = self._plan(views)
            if request.num_scheduled_tokens or request.finished_req_ids:
                try:
                    await pipe.send(self.client, request, started, views)
                except ClientError as exc:
                    self._lose_everything(f"{exc.code.name}: {exc.details}")
                return
        if not pipe.in_flight:
            await self._idle()  # nothing fits: wait for room or new work, probing
            return
        outcome = await pipe.reply(self._probe, self.config.probe_interval)
        if isinstance(outcome, str):
            self._lose_everything(outcome)
            return
        sent, reply = outcome
        error = step_error(reply)
        if error is None:
            pipe.settled(failed=False)
            self._deliver(reply.result)
        elif pipe.settled(failed=True):  # it counted on an earlier failed step: plan it again
            undo_step(sent.request, sent.started, self._queues)
        else:
            self._step_failed(error, sent.request, sent.started)

    def _deliver(self, response: pb.ExecuteResponse) -> None:
        """Takes a step's outputs, streams them, and frees requests that hit a stop."""
        self.last_used = time.monotonic()
        for r in apply_outputs(response, self.running, self.stats):
            stop = self._emit(self, r)
            if stop and self.running.pop(r.worker_id, None) is not None:
                self.to_free.append(r.worker_id)

    def _step_failed(
        self, exc: ClientError, request: pb.ExecuteRequest, started: list[FleetRequest]
    ) -> None:
        gone = lost_adapter(exc, started)
        if worker_lost(exc):
            self._lose_everything(f"{exc.code.name}: {exc.details}")
        elif gone is not None:  # its requests go back (`_plan`); the others run again
            log.info("worker %s no longer holds adapter %s", self.target, gone)
            self.adapters.discard(gone)
            undo_step(request, started, self._queues)
        else:
            refuse_step(exc, request, started, self._queues)
