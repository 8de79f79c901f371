"""The worker's queries: CheckHealth (shallow and deep), KV and memory usage.

They read copies of the state and never wait for a step, except a deep check,
which runs a 1-token forward on the engine thread after the calls queued
before it: never refused for the queue's limit (`--max-queued-steps`), and
shared by the deep checks that come while it waits, so probes of a
saturated worker wait their turn and cannot pile up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from mlx_worker_svc.core.domain import KVUsage, Origin
from mlx_worker_svc.core.reports import HealthReport, MemoryUsage, WorkerState
from mlx_worker_svc.engine.memory import guard as memory_guard
from mlx_worker_svc.worker.adapters import kept_blocks
from mlx_worker_svc.worker.core import WorkerCore

S = WorkerState


class Queries:
    """The queries over one worker's core."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        # The deep check on the engine thread that callers share (None: none running).
        self._deep: Future[int] | None = None
        self._deep_lock = threading.Lock()

    def _shared_deep_check(self, check: Callable[[], int]) -> int:
        """Runs `check` on the engine thread, after the calls queued before it; callers
        that come while it waits share it (one that comes once it runs queues another,
        which sees what was queued before it, a Sleep say). Never refused for the
        queue's limit: a probe of a saturated worker waits its turn, and probes cannot
        pile up."""
        with self._deep_lock:
            if self._deep is None:
                queued: list[Future[int]] = []

                def run() -> int:
                    with self._deep_lock:  # started: later callers queue a fresh one
                        if self._deep is queued[0]:
                            self._deep = None
                    return check()

                future = self.core.engine.submit(run)
                queued.append(future)
                if not future.done():  # a dead or stopped engine answers at once
                    self._deep = future
            else:
                future = self._deep
        return future.result()

    def health(self, deep: bool) -> HealthReport:
        core = self.core
        deep_ns = 0
        if deep and core.loaded is not None and core.state not in (S.STOPPED, S.SLEEPING):

            def deep_check() -> int:  # a Sleep queued before it may have freed the model
                asleep = core.state in (S.STOPPED, S.SLEEPING) or core.loaded is None
                return 0 if asleep else core.replica.deep_check()

            deep_ns = self._shared_deep_check(deep_check)
        runner = core.runner
        running, preempted = runner.count() if runner else (0, 0)
        dead = core.engine.dead
        return HealthReport(
            state=core.state,
            healthy=dead is None and core.state not in (S.STOPPED,),
            num_running_requests=running,
            num_preempted_requests=preempted,
            kv=self.kv_usage(),
            last_error=repr(dead) if dead else core.last_error,
            worker_epoch=core.epoch,
            deep_check_ns=deep_ns,
            uptime_seconds=time.monotonic() - core.started,
            memory=self.memory_usage(),
            bringing_up=core.lifecycle.bringing_up,
        )

    def kv_nbytes(self, req_id: str) -> int:
        """Bytes the KV buffers of an Execute request take now (0 if unknown)."""
        runner = self.core.runner
        key = (Origin.EXECUTE, req_id)
        return self.core.engine.call(lambda: runner.kv_nbytes(key)) if runner else 0

    def memory_usage(self) -> MemoryUsage:
        config = self.core.cache_config
        return memory_guard.usage(config.memory_limit_bytes if config else 0)

    def kv_usage(self) -> KVUsage:
        runner, config = self.core.runner, self.core.cache_config
        if runner is not None:
            return runner.kv_usage()
        if config is not None:  # asleep: the budget WakeUp restores, nothing held
            blocks = kept_blocks(self.core) if self.core.loaded else self.core.asleep_blocks
            return KVUsage(
                num_blocks=blocks or config.num_blocks, block_size=config.block_size, kv=config.kv
            )
        return KVUsage()
