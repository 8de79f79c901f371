"""The fleet's Prometheus metrics (`mlx_fleet_*`), in a registry of its own.

Counted as requests go, on the event loop only (one-writer instruments):
requests ended by outcome (the finish reason, a status code, or `cancelled`),
prompt and generated tokens, time to first token and request duration
(histograms); every FleetService RPC by status code (`core.metrics.RpcMetrics`).
Read when scraped, from `FleetScheduler.status()` on the scheduler's event
loop (its state is not thread-safe): queued requests, and per worker whether
it is up, the requests it has in flight, its KV blocks and its failovers.
Per model (label `model`): its workers, queued and ended requests and loads
on demand (status), how long each load took, how long requests waited for one,
and the time to first token of those that did.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlx_worker_svc.core.errors import Code
from mlx_worker_svc.core.metrics import LATENCY_BUCKETS, ServerMetrics
from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

PREFIX = "mlx_fleet"
# How long a scrape waits for the event loop to read the fleet's state.
_SCRAPE_TIMEOUT = 5.0


def finish_outcome(reason: int) -> str:
    """`FINISH_REASON_STOP_STRING` -> "stop_string"."""
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def error_outcome(code: grpc.StatusCode | Code) -> str:
    """`RESOURCE_EXHAUSTED` -> "resource_exhausted"."""
    return code.name.lower()


class FleetMetrics(ServerMetrics):
    """What the fleet counts; `watch` adds the gauges read at scrape time."""

    def __init__(self) -> None:
        super().__init__(
            PREFIX,
            prompt_doc="Prompt tokens of the requests admitted",
            generation_doc="Tokens streamed to callers",
        )
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests ended, by outcome: the finish reason (length, eos, stop_string, ...), "
            "cancelled, or the status code that failed them (resource_exhausted, ...)",
            ["outcome"],
            registry=self.registry,
        )
        self.time_to_first_token = self.histogram(
            "time_to_first_token_seconds", "From Generate to its first token", LATENCY_BUCKETS
        )
        self.request_seconds = self.histogram(
            "request_duration_seconds",
            "From Generate to the request's end, whatever the outcome",
            LATENCY_BUCKETS,
        )

        self._load_seconds = self._by_model(
            "model_load_seconds", "From a load on demand's start (Sleep) to its worker up again"
        )
        self._load_wait = self._by_model(
            "model_load_wait_seconds",
            "From Generate to the request's routing, for requests whose model no worker held",
        )
        self._ttft_after_load = self._by_model(
            "time_to_first_token_after_load_seconds",
            "From Generate to its first token, for requests whose model no worker held",
        )

    def _by_model(self, name: str, doc: str) -> Histogram:
        return Histogram(
            f"{PREFIX}_{name}", doc, ["model"], registry=self.registry, buckets=LATENCY_BUCKETS
        )

    def ended(self, outcome: str, seconds: float) -> None:
        self.requests.labels(outcome).inc()
        self.request_seconds.observe(seconds)

    def first_token(self, model: str, seconds: float, waited_for_load: bool) -> None:
        self.time_to_first_token.observe(seconds)
        if waited_for_load:
            self._ttft_after_load.labels(model).observe(seconds)

    def load_wait(self, model: str, seconds: float) -> None:
        self._load_wait.labels(model).observe(seconds)

    def loaded(self, model: str, seconds: float) -> None:
        self._load_seconds.labels(model).observe(seconds)

    def watch(
        self, status: Callable[[], fleet_pb2.StatusResponse], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Reads the gauges from `status()`, run on `loop`, whenever the registry is scraped."""
        self.registry.register(_StatusGauges(status, loop))


class _StatusGauges(Collector):
    def __init__(
        self, status: Callable[[], fleet_pb2.StatusResponse], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._status = status
        self._loop = loop

    async def _read(self) -> fleet_pb2.StatusResponse:
        return self._status()

    def collect(self) -> Iterator[Metric]:
        future = asyncio.run_coroutine_threadsafe(self._read(), self._loop)
        status = future.result(timeout=_SCRAPE_TIMEOUT)
        yield GaugeMetricFamily(
            f"{PREFIX}_requests_queued",
            "Requests admitted and waiting: for a worker, or on a worker's list for room",
            value=status.num_queued,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_queue_capacity",
            "Requests that may wait (--queue)",
            value=status.queue_capacity,
        )
        per_worker = [
            GaugeMetricFamily(
                f"{PREFIX}_worker_up", "1 while the worker is usable", labels=["worker"]
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_requests",
                "Requests on the worker: running, or waiting there for room",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_kv_blocks_used",
                "KV blocks the worker's running requests hold, as the fleet counts them",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_worker_kv_blocks_free",
                "KV blocks of the worker's budget not held by requests",
                labels=["worker"],
            ),
        ]
        failovers = CounterMetricFamily(
            f"{PREFIX}_failovers",
            "Requests moved off a worker that died, hung or restarted",
            labels=["worker"],
        )
        for w in status.workers:
            values = (float(w.up), w.num_running, w.kv.used_blocks, w.kv.free_blocks)
            for family, value in zip(per_worker, values, strict=True):
                family.add_metric([w.target], value)
            failovers.add_metric([w.target], w.num_failed_over)
        yield from per_worker
        yield failovers
        yield from _model_families(status)


def _model_families(status: fleet_pb2.StatusResponse) -> Iterator[Metric]:
    """The per-model series of a status."""
    workers = GaugeMetricFamily(
        f"{PREFIX}_model_workers", "Workers up with the model", labels=["model"]
    )
    queued = GaugeMetricFamily(
        f"{PREFIX}_model_requests_queued",
        "Requests for the model waiting: for a worker of it (or its load), or for room on one",
        labels=["model"],
    )
    ended = CounterMetricFamily(
        f"{PREFIX}_model_requests", "Requests for the model ended, every outcome", labels=["model"]
    )
    loads = CounterMetricFamily(
        f"{PREFIX}_model_loads",
        "Times the model was loaded on a worker on demand",
        labels=["model"],
    )
    for m in status.models:
        workers.add_metric([m.name], len(m.workers))
        queued.add_metric([m.name], m.num_queued)
        ended.add_metric([m.name], m.num_finished)
        loads.add_metric([m.name], m.num_loads)
    yield from (workers, queued, ended, loads)
