"""The single engine thread: every MLX call of the worker runs here.

MLX is not thread-safe, and a forward pass holds the GIL for long stretches,
so gRPC threads never compute: they validate, enqueue a job and wait on its
future. Between jobs the loop runs `idle_step` (the worker's own scheduling of
Generate requests) while it reports pending work. If the thread dies, every
waiting and later call fails with INTERNAL naming the cause, never hangs, and
`on_death` tells the owner (which ends its streams and reports unhealthy).
`fail()` declares it dead from outside, for a job that can never return (a
worker group's hung collective): waiting and later calls get that error.
Work that callers bring (Execute steps, Generate starts) is admitted only while
fewer than `max_queued` such jobs wait; past that, RESOURCE_EXHAUSTED at once.
With `tick`, an idle loop runs `on_tick` every `tick` seconds (a worker group's
rank 0 keeps its followers in step that way).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

from mlx_worker_svc.core.errors import Internal, ResourceExhausted, Unavailable, WorkerError

T = TypeVar("T")
log = logging.getLogger(__name__)

_STOP = object()


class EngineLoop:
    """Runs submitted jobs one at a time on a dedicated thread."""

    def __init__(
        self,
        idle_pending: Callable[[], bool],
        idle_step: Callable[[], None],
        *,
        on_exit: Callable[[], None] = lambda: None,
        on_death: Callable[[BaseException], None] = lambda _exc: None,
        name: str = "mlx-engine",
        max_queued: int = 1 << 30,
        tick: float | None = None,
        on_tick: Callable[[], None] = lambda: None,
    ) -> None:
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._max_queued = max_queued
        self._admitted = 0  # bounded jobs queued and not yet started
        self._admitted_lock = threading.Lock()
        self._idle_pending = idle_pending
        self._idle_step = idle_step
        self._tick, self._on_tick = tick, on_tick
        self._on_exit = on_exit
        self._on_death = on_death
        self._dead: BaseException | None = None
        self._death_told = threading.Event()
        self._running: Future[Any] | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def dead(self) -> BaseException | None:
        return self._dead

    @property
    def queued(self) -> int:
        """Bounded jobs waiting for the engine thread."""
        return self._admitted

    def _death_error(self) -> WorkerError:
        dead = self._dead
        if isinstance(dead, WorkerError):
            return dead
        return Internal(f"the engine thread died: {dead!r}")

    def submit(self, fn: Callable[[], T], *, bounded: bool = False) -> Future[T]:
        """Queues `fn`; a `bounded` job is refused when `max_queued` already wait."""
        future: Future[T] = Future()
        if self._dead is not None:
            future.set_exception(self._death_error())
        elif self._stopped:
            future.set_exception(Unavailable("the worker has shut down"))
        elif bounded and not self._admit():
            future.set_exception(
                ResourceExhausted(
                    f"the engine has {self._max_queued} steps queued (the limit): retry later, "
                    "send the work to another worker, or raise --max-queued-steps"
                )
            )
        else:
            self._jobs.put((fn, future, bounded))
        return future

    def call(self, fn: Callable[[], T], *, bounded: bool = False) -> T:
        """Runs `fn` on the engine thread and returns its result (or raises)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn, bounded=bounded).result()

    def _admit(self) -> bool:
        with self._admitted_lock:
            if self._admitted >= self._max_queued:
                return False
            self._admitted += 1
            return True

    def _release(self) -> None:
        with self._admitted_lock:
            self._admitted -= 1

    def fail(self, error: WorkerError) -> None:
        """Declares the engine dead with `error`: the running job's caller, the
        queued jobs and every later call get it at once, and `on_death` is told."""
        if self._dead is None:
            self._dead = error
        running = self._running
        if running is not None:
            _settle(running, error=self._death_error())
        self._drain_queue()
        self._tell_death()

    def _tell_death(self) -> None:
        if self._dead is not None and not self._death_told.is_set():
            self._death_told.set()
            self._on_death(self._dead)

    def stop(self, timeout: float | None = None) -> None:
        """Finishes queued jobs, then stops the thread."""
        if not self._stopped:
            self._stopped = True
            self._jobs.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while self._dead is None:
                pending = self._idle_pending()
                try:
                    item = self._jobs.get(block=not pending, timeout=self._tick)
                except queue.Empty:
                    (self._idle_step if pending else self._on_tick)()
                    continue
                if item is _STOP:
                    break
                fn, future, bounded = item
                if bounded:
                    self._release()
                if not future.set_running_or_notify_cancel():
                    continue
                self._running = future
                try:
                    _settle(future, result=fn())
                except BaseException as exc:
                    _settle(future, error=exc)
                finally:
                    self._running = None
        except BaseException as exc:  # the loop itself failed: fail everything
            if self._dead is None:
                log.exception("engine thread died")
                self._dead = exc
        finally:
            try:
                self._on_exit()
            except Exception:
                log.exception("the engine thread could not settle")
        self._drain_queue()
        self._tell_death()

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                continue
            _, future, _ = item
            if self._dead is not None:
                _settle(future, error=self._death_error())
            else:
                _settle(future, error=Unavailable("the worker has shut down"))


def _settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Completes `future` unless `fail()` already did (from another thread)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
