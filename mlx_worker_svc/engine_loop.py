"""The single engine thread: every MLX call of the worker runs here.

MLX is not thread-safe, and a forward pass holds the GIL for long stretches,
so gRPC threads never compute: they validate, enqueue a job and wait on its
future. Between jobs the loop runs `idle_step` (the worker's own scheduling of
Generate requests) while it reports pending work. If the thread dies, every
waiting and later call fails with INTERNAL naming the cause, never hangs, and
`on_death` tells the owner (which ends its streams and reports unhealthy).
Work that callers bring (Execute steps, Generate starts) is admitted only while
fewer than `max_queued` such jobs wait; past that, RESOURCE_EXHAUSTED at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from mlx_worker_svc.errors import Internal, ResourceExhausted, Unavailable

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
    ) -> None:
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._max_queued = max_queued
        self._admitted = 0  # bounded jobs queued and not yet started
        self._admitted_lock = threading.Lock()
        self._idle_pending = idle_pending
        self._idle_step = idle_step
        self._on_exit = on_exit
        self._on_death = on_death
        self._dead: BaseException | None = None
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

    def submit(self, fn: Callable[[], T], *, bounded: bool = False) -> Future[T]:
        """Queues `fn`; a `bounded` job is refused when `max_queued` already wait."""
        future: Future[T] = Future()
        if self._dead is not None:
            future.set_exception(Internal(f"the engine thread died: {self._dead!r}"))
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

    def stop(self, timeout: float | None = None) -> None:
        """Finishes queued jobs, then stops the thread."""
        if not self._stopped:
            self._stopped = True
            self._jobs.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._jobs.get(block=not self._idle_pending())
                except queue.Empty:
                    self._idle_step()
                    continue
                if item is _STOP:
                    break
                fn, future, bounded = item
                if bounded:
                    self._release()
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
        except BaseException as exc:  # the loop itself failed: fail everything
            log.exception("engine thread died")
            self._dead = exc
        finally:
            self._on_exit()
        self._drain_queue()
        if self._dead is not None:
            self._on_death(self._dead)

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
                future.set_exception(Internal(f"the engine thread died: {self._dead!r}"))
            else:
                future.set_exception(Unavailable("the worker has shut down"))
