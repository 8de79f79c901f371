"""Steps ahead: a link's ExecuteStream to its worker and the steps in flight.

With `LinkConfig.steps_ahead` n >= 1 the link keeps up to n + 1 steps in
flight: it plans step t + 1 while step t runs, counting what the steps in
flight will compute. A request the steps in flight sample for decodes from
the end of the sequence they will leave (`view`); one whose prefill chunk in
flight stops short of its prompt's end waits for that reply (a prefix-cache
hit may move it). A finish is never predicted: the worker leaves a finished
request out of later steps (already_finished_req_ids).

After a failed step the pipeline stops sending until the steps in flight are
answered (`resyncing`, cleared by `settled` once the last of them is
handled): the later ones that counted on the failed one fail too, and the
link undoes them quietly; the first failure is handled as a failed Execute
is.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from mlx_worker_svc.client.step_stream import AsyncExecuteStream
from mlx_worker_svc.client.worker import AsyncWorkerClient, ClientError
from mlx_worker_svc.fleet.request import FleetRequest
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


@dataclass
class Sent:
    """A step in flight."""

    request: pb.ExecuteRequest
    started: list[FleetRequest]
    samples: dict[str, int] = field(default_factory=dict)  # worker id -> tokens it samples
    chunked: set[str] = field(default_factory=set)  # worker ids of chunks short of the end


class Pipeline:
    """The stream to one worker and what is in flight on it."""

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        self.in_flight: deque[Sent] = deque()
        self.resyncing = False
        self._stream: AsyncExecuteStream | None = None

    @property
    def room(self) -> bool:
        """Whether another step may be sent now."""
        return not self.resyncing and len(self.in_flight) <= self.ahead

    def view(self, r: FleetRequest) -> tuple[int, int] | None:
        """(computed, length) after the steps in flight; None while a chunk of it is."""
        samples = 0
        for sent in self.in_flight:
            if r.worker_id in sent.chunked:
                return None
            samples += sent.samples.get(r.worker_id, 0)
        length = len(r.tokens) + samples
        return (length - 1, length) if samples else (r.computed, length)

    async def send(
        self,
        client: AsyncWorkerClient,
        request: pb.ExecuteRequest,
        started: list[FleetRequest],
        views: dict[str, tuple[int, int]],
    ) -> None:
        """Sends a step planned from `views` (computed, length before it) and books it."""
        sent = Sent(request, started)
        for worker_id, count in request.num_scheduled_tokens.items():
            computed, length = views[worker_id]
            if computed + count < length:
                sent.chunked.add(worker_id)
            else:
                sent.samples[worker_id] = max(request.num_decode_steps, 1)
        if self._stream is None:
            self._stream = client.execute_stream()
        self.in_flight.append(sent)
        await self._stream.send(request)

    async def reply(
        self, probe: Callable[[], Awaitable[str | None]], interval: float
    ) -> tuple[Sent, pb.ExecuteStreamResponse] | str:
        """The oldest step and its reply, or why the worker was lost meanwhile.

        The worker is probed every `interval` s while the reply is awaited, as
        while a unary Execute runs.
        """
        assert self._stream is not None and self.in_flight
        read = asyncio.create_task(self._stream.receive())
        while not read.done():
            await asyncio.wait({read}, timeout=interval)
            if read.done():
                break
            why = await probe()
            if why is not None and not read.done():
                read.cancel()
                return why
        try:
            response = read.result()
        except ClientError as exc:  # the stream ended: the worker freed its requests
            return f"{exc.code.name}: {exc.details}"
        return self.in_flight.popleft(), response

    def settled(self, failed: bool) -> bool:
        """After a reply: whether it failed behind an earlier failure (so is undone).

        `failed` says whether the reply is an error. A first failure starts a
        resync while later steps are in flight; the resync ends with the last.
        """
        behind = failed and self.resyncing
        if failed and not behind:
            self.resyncing = bool(self.in_flight)
        elif not self.in_flight:
            self.resyncing = False
        return behind

    def reset(self) -> None:
        """Drops the stream (the worker frees what it created) and what was in flight."""
        if self._stream is not None:
            self._stream.cancel()
        self._stream = None
        self.in_flight.clear()
        self.resyncing = False


def views_of(pipe: Pipeline | None, running: dict[str, FleetRequest]) -> dict[str, tuple[int, int]]:
    """(computed, length) of each running request once the steps in flight are done.

    Without a pipeline (unary Execute) nothing is in flight: each request as it is.
    """
    views = {}
    for worker_id, r in running.items():
        view = pipe.view(r) if pipe is not None else (r.computed, len(r.tokens))
        if view is not None:  # None: a chunk of it is in flight
            views[worker_id] = view
    return views
