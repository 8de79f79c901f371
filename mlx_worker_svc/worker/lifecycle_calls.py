"""Lifecycle calls run one at a time: a repeat joins the run, anything else is refused.

InitDevice, LoadModel, DetermineMemory, InitCache and WarmUp can each hold the
engine thread for seconds to minutes. `LifecycleCalls` keeps at most one of
them queued or running. A call with the same name and arguments as the one in
progress waits for it and gets its result; any other lifecycle call meanwhile
is refused with ABORTED naming the call in progress and the arguments that
differ. A caller that gives up (deadline, cancel) stops waiting at once; when
it was the last one waiting, a run that has not started is cancelled (nothing
is left queued on the engine thread) and a run that has started finishes. The
result of the last run is kept: if the next lifecycle call is identical and the
worker's state and epoch have not changed since, it gets that result at once.
While a thread holds the calls (`claim`: the worker bringing itself up under
`serve --auto-init`), only that thread starts lifecycle calls; others join a
run in progress or are refused.
`close` (the drain) refuses every later call and wakes every waiter.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from mlx_worker_svc.core.errors import Aborted, Unavailable

T = TypeVar("T")

_POLL = 0.2
"""How often a waiter whose caller may give up checks that it has not."""


@dataclass
class _Run:
    call: str
    args: Mapping[str, Hashable]
    future: Future[Any]
    waiters: int = 0

    def describe(self) -> str:
        shown = ", ".join(f"{k}={_show(v)}" for k, v in self.args.items())
        return f"{self.call}({shown})"


def _show(value: object) -> str:
    return repr(getattr(value, "value", value))


class LifecycleCalls:
    """The lifecycle call in progress, shared by every caller that repeats it."""

    def __init__(
        self,
        submit: Callable[[Callable[[], Any]], Future[Any]],
        snapshot: Callable[[], Hashable],
    ) -> None:
        """`submit` queues a job on the engine thread; `snapshot` is the worker's
        (state, epoch), read when a run ends and before its kept result is reused."""
        self._submit = submit
        self._snapshot = snapshot
        self._cond = threading.Condition(threading.RLock())
        self._run: _Run | None = None
        self._kept: tuple[_Run, Hashable] | None = None
        self._owner: int | None = None
        self._closed = False

    @property
    def bringing_up(self) -> bool:
        """Whether a thread holds the calls (the worker is bringing itself up)."""
        return self._owner is not None

    @property
    def busy(self) -> bool:
        """Whether a lifecycle call is running on the engine thread now."""
        run = self._run
        return run is not None and run.future.running()

    @property
    def in_progress(self) -> str | None:
        """The call queued or running, as `Name(arg=value, ...)`, or None."""
        run = self._run
        return run.describe() if run is not None else None

    def claim(self) -> None:
        """Lets only this thread start lifecycle calls until `release`."""
        with self._cond:
            self._owner = threading.get_ident()

    def release(self) -> None:
        with self._cond:
            self._owner = None

    def forget(self) -> None:
        """Drops the kept result: what it measured changed (an adapter came or went)."""
        with self._cond:
            self._kept = None

    def close(self) -> None:
        """Refuses later calls, cancels a run not yet started and wakes every waiter."""
        with self._cond:
            self._closed = True
            if self._run is not None:
                self._run.future.cancel()
            self._cond.notify_all()

    def run(
        self,
        call: str,
        args: Mapping[str, Hashable],
        job: Callable[[], T],
        *,
        gave_up: Callable[[], bool] | None = None,
    ) -> T:
        """Runs `job` as lifecycle call `call(args)`, or joins the identical run in progress.

        `gave_up` tells whether the caller left (its deadline passed, it cancelled).
        """
        with self._cond:
            if self._closed:
                raise Unavailable(f"{call}: the worker is shutting down")
            run = self._run
            if run is not None and (run.call, dict(run.args)) != (call, dict(args)):
                raise Aborted(_conflict(call, args, run))
            if run is None:
                if self._owner not in (None, threading.get_ident()):
                    raise Aborted(
                        f"{call}: the worker is bringing itself up (serve --auto-init) and "
                        "takes no lifecycle calls from outside meanwhile: wait until "
                        "CheckHealth.bringing_up is false"
                    )
                kept = self._take_kept(call, args)
                if kept is not None:
                    return cast(T, kept.result())
                run = self._run = _Run(call, dict(args), self._submit(job))
                run.future.add_done_callback(functools.partial(self._ended, run))
            run.waiters += 1
        return cast(T, self._wait(run, gave_up))

    def _take_kept(self, call: str, args: Mapping[str, Hashable]) -> Future[Any] | None:
        kept, self._kept = self._kept, None
        if kept is None:
            return None
        run, snapshot = kept
        if (run.call, dict(run.args)) == (call, dict(args)) and snapshot == self._snapshot():
            return run.future
        return None

    def _ended(self, run: _Run, _future: Future[Any]) -> None:
        """A run finished (on the engine thread) or was cancelled."""
        with self._cond:
            if self._run is run:
                self._run = None
            if not run.future.cancelled() and run.future.exception() is None:
                self._kept = (run, self._snapshot())
            self._cond.notify_all()

    def _wait(self, run: _Run, gave_up: Callable[[], bool] | None) -> Any:
        with self._cond:
            try:
                while not run.future.done():
                    if self._closed:
                        raise Unavailable(f"{run.call}: the worker is shutting down")
                    if gave_up is not None and gave_up():
                        raise Aborted(f"{run.call}: the caller gave up (deadline or cancel)")
                    self._cond.wait(_POLL if gave_up is not None else None)
            finally:
                run.waiters -= 1
                if run.waiters == 0 and not run.future.done():
                    run.future.cancel()  # only a run not yet started: it never starts
        if run.future.cancelled():
            raise Unavailable(f"{run.call}: the worker is shutting down")
        return run.future.result()


def _conflict(call: str, args: Mapping[str, Hashable], run: _Run) -> str:
    if call != run.call:
        return (
            f"{call}: {run.describe()} is in progress; lifecycle calls run one at a time: "
            "wait for it (CheckHealth.state) and call again"
        )
    differ = [
        f"{key}={_show(value)} (in progress: {_show(run.args.get(key))})"
        for key, value in args.items()
        if run.args.get(key) != value
    ]
    return (
        f"{call}: the same call with other arguments is in progress ({run.describe()}); "
        f"this one asks for {', '.join(differ)}: wait for it and call again"
    )
