"""The calls that take a worker down: Sleep and WakeUp, ResetPrefixCache, the drain, close.

`SleepAndDrain` moves the worker's core from READY or SERVING to SLEEPING and
back (a new worker epoch, every request aborted), and through DRAINING to
STOPPED; the way up is lifecycle.py's. Each call runs as one job on the
engine thread, as the lifecycle calls do.
"""

from __future__ import annotations

import contextlib
import time

from mlx_worker_svc.core.domain import Origin
from mlx_worker_svc.core.errors import Aborted, InvalidArgument, Unavailable
from mlx_worker_svc.core.reports import SleepReport, WakeReport, WorkerState
from mlx_worker_svc.engine.memory import guard as memory_guard
from mlx_worker_svc.worker.adapters import fit_budget, kept_blocks, reload_adapters
from mlx_worker_svc.worker.core import WorkerCore

S = WorkerState


class SleepAndDrain:
    """The calls that take one worker core down (and WakeUp, which brings it back)."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    # ------------------------------------------------------ sleep, wake up
    def sleep(self, level: int) -> SleepReport:
        """Frees all KV (level 1) and also the weights (level 2); see the proto."""
        core = self.core
        if core.state is not S.SLEEPING and not core.lifecycle.busy:
            core.require("Sleep", S.READY)  # the wrong state first, whatever the level
        if level not in (0, 1, 2):
            raise InvalidArgument(f"Sleep.level must be 1 or 2 (0 means 1), got {level}")
        level = level or 1

        def job() -> SleepReport:
            aborted = 0
            before = memory_guard.usage(0).active_bytes
            if core.state is not S.SLEEPING:
                core.require("Sleep", S.READY)
                aborted = len(core.runner.state.seqs) if core.runner else 0
                for request_id in core.streams.ids():
                    core.end_stream(
                        request_id, Aborted(f"the worker went to sleep (level {level})")
                    )
                core.set_runner(None)
                core.awake_state = core.state
                core.new_epoch(f"slept (Sleep level {level} aborted every request)")
                core.set_state(S.SLEEPING)
            if level == 2:
                if core.loaded is not None:  # WakeUp loads its adapters again
                    core.asleep_adapters = core.loaded.adapters.specs()
                    core.asleep_blocks = kept_blocks(core)
                core.loaded = None
            core.sleep_level = max(core.sleep_level, level)
            core.replica.release(model=level == 2)
            freed = max(before - memory_guard.usage(0).active_bytes, 0)
            return SleepReport(S.SLEEPING, core.sleep_level, aborted, freed, core.epoch)

        return core.engine.call(job)

    def wake_up(self) -> WakeReport:
        """Restores what Sleep freed (adapters that no longer load are dropped)."""
        core = self.core

        def job() -> WakeReport:
            start = time.perf_counter()
            if core.state is not S.SLEEPING:
                core.require("WakeUp", S.READY)
                return WakeReport(core.state, core.epoch, 0.0)
            dropped: tuple[str, ...] = ()
            if core.loaded is None:
                assert core.load_spec is not None
                loaded = core.replica.load(core.load_spec)  # raises: still asleep
                cap = core.replica.options.max_loras
                dropped = reload_adapters(loaded, core.asleep_adapters, cap)
                core.asleep_adapters = []
                core.loaded = loaded
            assert core.cache_config is not None and core.memory is not None
            core.set_runner(core.replica.new_runner(core.cache_config, core.memory))
            fit_budget(core)
            core.sleep_level = 0
            core.set_state(core.awake_state)
            return WakeReport(core.state, core.epoch, time.perf_counter() - start, dropped)

        return core.engine.call(job)

    def reset_prefix_cache(self) -> int:
        """Drops the prefix cache; returns the blocks it held."""
        core = self.core

        def job() -> int:
            core.require("ResetPrefixCache", S.READY)
            return core.need_runner("ResetPrefixCache").reset_prefix_cache()

        return core.engine.call(job)

    # ------------------------------------------------------------- drain
    def begin_drain(self) -> None:
        """Stops accepting new work; running requests may finish.

        Lifecycle calls are refused from now on and their waiters woken. One
        that is running (a load or a profile, which cannot be interrupted) is
        not waited for: the state turns DRAINING when it ends.
        """
        core = self.core

        def job() -> None:
            if core.state is not S.STOPPED:
                core.set_state(S.DRAINING)

        core.lifecycle.close()
        if core.engine.dead is None:
            done = core.engine.submit(job)
            if not core.lifecycle.busy:
                done.result()

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no Generate stream is open and no scheduler's request is running
        (one its scheduler has not finished, preempted or freed); returns whether it got
        there. A draining worker still runs the steps of running requests (`_execute`),
        so a scheduler finishes them within the grace period."""
        core = self.core
        deadline = time.monotonic() + timeout
        if not core.streams.wait_empty(timeout):
            return False
        while _scheduled_running(core):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self) -> None:
        """Aborts what is left, frees the model and caches, stops the engine.

        Behind a lifecycle call still running it does not wait: there is nothing
        to drain, and the process may exit while the engine thread finishes it.
        """
        core = self.core

        def job() -> None:
            for request_id in core.streams.ids():
                core.end_stream(request_id, Aborted("the worker shut down before it finished"))
            if core.runner is not None:
                core.runner.abort_all()
            core.runner = None
            core.loaded = None
            core.replica.close()
            core.set_state(S.STOPPED)

        core.watchdog.stop()
        if core.lifecycle.busy:
            core.engine.submit(job)
            core.engine.stop(timeout=0)
            return
        if core.state is not S.STOPPED and core.engine.dead is None:
            with contextlib.suppress(Unavailable):
                core.engine.call(job)
        core.engine.stop(timeout=10)
        # After an engine death the job above could not run: drop the arrays here.
        core.runner, core.loaded = None, None
        core.set_state(S.STOPPED)


def _scheduled_running(core: WorkerCore) -> bool:
    """Whether a scheduler's (Execute) request is running: read off the engine thread,
    a snapshot of the requests' dict, which the engine thread replaces or changes."""
    runner = core.runner
    if runner is None:
        return False
    seqs = list(runner.state.seqs.items())
    return any(key[0] is Origin.EXECUTE and not seq.preempted for key, seq in seqs)
