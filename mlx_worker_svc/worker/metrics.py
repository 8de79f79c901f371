"""The worker's Prometheus metrics (`mlx_worker_*`), in a registry of its own.

Counted as the work happens, on the engine thread only (so with one-writer
instruments: a few adds per step, no lock): step latency and requests per
step (histograms), tokens computed, prompt tokens of admitted requests and
generated tokens (counters); every RPC by method and status code
(`core.metrics.RpcMetrics`), and ExecuteStream steps answered with an error
by code. Read only when scraped, from the worker's
health report: KV blocks used and free, prefix-cache blocks, running and
preempted requests, steps queued for the engine (and the admission limits on
both), MLX memory and the lifecycle state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlx_worker_svc.core.domain import StepTimings
from mlx_worker_svc.core.limits import AdmissionLimits
from mlx_worker_svc.core.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, ServerMetrics
from mlx_worker_svc.core.reports import HealthReport, WorkerState

PREFIX = "mlx_worker"


class WorkerMetrics(ServerMetrics):
    """What the worker counts; `watch` adds the gauges read at scrape time."""

    def __init__(self) -> None:
        super().__init__(
            PREFIX,
            prompt_doc="Prompt tokens of the requests admitted (Execute and Generate)",
            generation_doc="Tokens sampled (generated)",
        )
        self.step_seconds = self.histogram(
            "step_duration_seconds",
            "Wall time of one engine step (an Execute step or a Generate step)",
            LATENCY_BUCKETS,
        )
        self.step_requests = self.histogram(
            "step_batch_size",
            "Requests computed in one step (prefill chunks and decodes)",
            BATCH_BUCKETS,
        )
        self.computed_tokens = self.counter(
            "computed_tokens",
            "Tokens whose KV the steps computed (prefill and decode; prefix-cache hits excluded)",
        )
        # Counted on the gRPC threads that answer the streams (a locked counter): the
        # stream's RPC ends OK, so rpcs_total does not show its refused steps.
        self.stream_step_errors = Counter(
            f"{PREFIX}_stream_step_errors",
            "ExecuteStream steps answered with an error, by gRPC status code",
            ["code"],
            registry=self.registry,
        )

    def observe_step(
        self, timings: StepTimings, num_requests: int, prompt_tokens: int, sampled_tokens: int
    ) -> None:
        """One step ran: its timings, the requests it computed, new prompt tokens it
        admitted and the tokens it sampled (several a request with num_decode_steps)."""
        self.step_seconds.observe(timings.total_ns / 1e9)
        self.step_requests.observe(num_requests)
        self.computed_tokens.inc(timings.num_tokens)
        self.generation_tokens.inc(sampled_tokens)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)

    def watch(
        self,
        health: Callable[[], HealthReport],
        queued_steps: Callable[[], int],
        limits: AdmissionLimits,
    ) -> None:
        """Reads the gauges from `health()` and `queued_steps()` whenever scraped."""
        self.registry.register(_HealthGauges(health, queued_steps, limits))


class _HealthGauges(Collector):
    def __init__(
        self,
        health: Callable[[], HealthReport],
        queued_steps: Callable[[], int],
        limits: AdmissionLimits,
    ) -> None:
        self._health = health
        self._queued_steps = queued_steps
        self._limits = limits

    def collect(self) -> Iterator[Metric]:
        report, limits = self._health(), self._limits
        kv, memory = report.kv, report.memory
        for name, doc, value in (
            ("kv_blocks_used", "KV blocks the requests hold", kv.used_blocks),
            ("kv_blocks_free", "KV blocks of the budget not held by requests", kv.free_blocks),
            (
                "kv_blocks_capacity",
                "KV blocks of the budget in force (InitCache's, less those adapters take)",
                kv.num_blocks,
            ),
            ("kv_bits", "Bits of the quantized KV (0: the model's float dtype)", kv.kv.bits),
            ("kv_group_size", "Quantization group of the KV (0: float KV)", kv.kv.group_size),
            (
                "prefix_cache_blocks",
                "Evictable blocks the prefix cache holds (not in used)",
                kv.prefix_cache_blocks,
            ),
            (
                "requests_running",
                "Requests the worker holds that are not preempted",
                report.num_running_requests,
            ),
            (
                "requests_preempted",
                "Preempted requests: tokens kept, KV freed, waiting to be resumed",
                report.num_preempted_requests,
            ),
            (
                "max_running_requests",
                "Live requests admitted (running or preempted) before RESOURCE_EXHAUSTED",
                limits.max_running_requests,
            ),
            (
                "steps_queued",
                "Execute steps and Generate starts waiting for the engine thread",
                self._queued_steps(),
            ),
            (
                "max_queued_steps",
                "Steps that may wait for the engine before RESOURCE_EXHAUSTED",
                limits.max_queued_steps,
            ),
            ("memory_active_bytes", "MLX active memory", memory.active_bytes),
            ("memory_cache_bytes", "MLX buffer cache", memory.cache_bytes),
            ("memory_limit_bytes", "MLX memory limit (0: none set)", memory.limit_bytes),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        state = GaugeMetricFamily(
            f"{PREFIX}_state", "Lifecycle state (1 for the current one)", labels=["state"]
        )
        for each in WorkerState:
            state.add_metric([each.value], 1.0 if each is report.state else 0.0)
        yield state
