"""Prometheus instruments shared by the worker and the fleet, with no gRPC in them.

Every server keeps its metrics in a `CollectorRegistry` of its own (never the
process-wide default, so several servers can live in one process, as in the
tests): `ServerMetrics` holds it, with the RPC and token counters the worker
and the fleet both have. What is counted on the hot path (every engine step)
uses `OneWriterCounter` and `OneWriterHistogram`: written by one thread only
(the engine thread, or the fleet's event loop), so an update is an add with no
lock. `RpcMetrics` is the counter the RPC layer's interceptors
(`rpc/metrics.py`) record each call's final status code into, by name.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# No `*_created` series (a gauge per labelled counter and histogram, in the text format):
# operations.md lists every series there is; vLLM leaves them out too.
disable_created_metrics()  # type: ignore[no-untyped-call]

# Step and request latencies: a tiny model's step is ~1 ms, a large prefill seconds.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# Requests per step.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class OneWriterCounter:
    """A counter only one thread increments (no lock); any thread may read it."""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc = name, doc
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def family(self) -> Metric:
        return CounterMetricFamily(self.name, self.doc, value=self.value)


class OneWriterHistogram:
    """A histogram only one thread observes: a bisect and two adds, no lock.

    A scrape may see it an observation late (the sum read before a bucket
    moved), but `_count` is always the +Inf bucket: both come from one read.
    """

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc = name, doc
        self._bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def family(self) -> Metric:
        total, cumulative = self._sum, list(itertools.accumulate(self._counts))
        # `cumulative` has one more entry than `_bounds`: the +Inf bucket.
        buckets = [(str(b), n) for b, n in zip(self._bounds, cumulative, strict=False)]
        buckets.append(("+Inf", cumulative[-1]))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


class ServerMetrics(Collector):
    """A registry of its own, with what every server counts: RPCs and tokens.

    The one-writer instruments made by `counter` and `histogram` are
    reported through this collector.
    """

    def __init__(self, prefix: str, *, prompt_doc: str, generation_doc: str) -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self.rpcs = RpcMetrics(prefix, self.registry)
        self._instruments: list[OneWriterCounter | OneWriterHistogram] = []
        self.prompt_tokens = self.counter("prompt_tokens", prompt_doc)
        self.generation_tokens = self.counter("generation_tokens", generation_doc)
        self.registry.register(self)

    def counter(self, name: str, doc: str) -> OneWriterCounter:
        counter = OneWriterCounter(f"{self.prefix}_{name}", doc)
        self._instruments.append(counter)
        return counter

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> OneWriterHistogram:
        histogram = OneWriterHistogram(f"{self.prefix}_{name}", doc, buckets)
        self._instruments.append(histogram)
        return histogram

    def collect(self) -> Iterator[Metric]:
        for instrument in self._instruments:
            yield instrument.family()


class RpcMetrics:
    """`<prefix>_rpcs_total{service, method, code}`: every RPC by its final status code.

    The servers' interceptors (rpc/metrics.py) name a method no service of the
    process defines "/unknown/unknown": a caller without credentials cannot grow
    the label set.
    """

    def __init__(self, prefix: str, registry: CollectorRegistry) -> None:
        self._total = Counter(
            f"{prefix}_rpcs",
            "RPCs handled, by service, method and final gRPC status code",
            ["service", "method", "code"],
            registry=registry,
        )

    def record(self, method: str, code: str) -> None:
        """Counts one RPC; `method` is the full path ("/pkg.Service/Method"), `code` a name."""
        service, _, name = method.lstrip("/").rpartition("/")
        self._total.labels(service, name, code).inc()
