"""A worker group's command channel over `mx.distributed`, and its watchdog.

Rank 0 sends every engine operation to the other ranks through MLX's own
collectives (no other transport): an `all_gather` of an int64 header (rank 0
gives the payload's length; each follower gives a digest of what its previous
operation produced, so a follower whose tokens differ from rank 0's is caught
at the next operation; every rank gives the header's sequence number, so a row
a dead rank never sent, zeros or a stale buffer, reads as silence, not as a
divergence), then an `all_sum` of the payload bytes, to which the
followers contribute zeros. The payload is a pickle of (operation, arguments):
the ranks of a group trust each other as much as one process trusts itself,
so a group must only span machines under one operator's control.

MLX's ring backend waits for a peer by polling its socket, so a rank waiting
in a collective keeps a core busy. An idle group therefore does not wait in
one: every IDLE_POLL seconds rank 0 sends a ping (a header of length 0), after
which the followers sleep until the next one. A request that arrives while the
group idles waits up to IDLE_POLL for them; the pings also find a dead rank
between requests.

A collective that never finishes (a rank that hangs, a machine that drops off
the network) cannot be interrupted, so a `Watchdog` thread watches every
collective operation: past its time limit it reports the silent ranks and the
owner ends the process. A collective that fails (a peer's connection lost)
is reported the same way. With one process the channel is a no-op: `gather`
returns the rank's own value.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_worker_svc.core.errors import Unavailable, WorkerError

log = logging.getLogger(__name__)

# Lifecycle operations (LoadModel, DetermineMemory, WarmUp) run for much longer
# than a step; their collectives get this many times the step limit.
LIFECYCLE_FACTOR = 20
DEFAULT_TIMEOUT = 60.0
# How often an idle rank 0 pings its followers, which sleep in between.
IDLE_POLL = 0.05
PING = "ping"
Command = tuple[str, tuple[Any, ...], dict[str, Any]]


class GroupChannel:
    """One rank's end of the group's command channel."""

    def __init__(self, group: Any = None, *, backend: str = "", timeout: float = DEFAULT_TIMEOUT):
        self._group = group
        self.rank = int(group.rank()) if group is not None else 0
        self.size = int(group.size()) if group is not None else 1
        self.backend = backend if self.size > 1 else ""
        self.timeout = timeout
        self.failure: WorkerError | None = None
        self.on_failure: Callable[[WorkerError], None] = lambda _error: None
        self.pending_digest = 0
        """This rank's digest of its last operation, checked at the next header."""
        self._seq = 0  # headers exchanged; every rank counts the same
        self._busy: tuple[float, float, str] | None = None

    @property
    def grouped(self) -> bool:
        return self.size > 1

    @property
    def leads(self) -> bool:
        """Whether this is rank 0 of a group (it sends; the others follow)."""
        return self.grouped and self.rank == 0

    @property
    def mx_group(self) -> Any:
        """The `mx.distributed` group (None for one process)."""
        return self._group if self.grouped else None

    @property
    def lifecycle_limit(self) -> float:
        return self.timeout * LIFECYCLE_FACTOR

    @property
    def idle_limit(self) -> float:
        """How long a follower waits for rank 0, which pings every IDLE_POLL while idle.

        Generous: rank 0 may still be starting its server after the group formed.
        """
        return max(2 * self.timeout, 30.0)

    # ------------------------------------------------------------ collectives
    def _all_gather(self, rows: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_gather(mx.array(rows), group=self._group, stream=mx.cpu)
        return np.asarray(out)

    def _all_sum(self, values: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(values), group=self._group, stream=mx.cpu)
        return np.asarray(out)

    def send(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Rank 0: sends one operation to every follower (a no-op alone)."""
        if not self.grouped:
            return
        ping = name == PING and not args and not kwargs
        payload = b"" if ping else pickle.dumps((name, args, kwargs), pickle.HIGHEST_PROTOCOL)
        expected, self.pending_digest = self.pending_digest, 0
        self._seq += 1
        header = self._all_gather(np.array([[len(payload), 0, self._seq]], dtype=np.int64))
        silent = [rank for rank in range(1, self.size) if int(header[rank, 2]) != self._seq]
        if silent:
            ranks = ", ".join(map(str, silent))
            raise self.fail(
                "a rank's header never arrived",
                f"rank{'s' if len(silent) > 1 else ''} {ranks} did not answer",
            )
        digests = [int(d) for d in header[:, 1]]
        wrong = [rank for rank in range(1, self.size) if digests[rank] != expected]
        if wrong:
            raise self.fail(
                "the ranks diverged",
                f"rank(s) {', '.join(map(str, wrong))} sampled other tokens than rank 0 "
                "in the last step",
            )
        if payload:
            self._all_sum(np.frombuffer(payload, dtype=np.uint8))

    def receive(self) -> Command:
        """A follower: waits for rank 0's next operation."""
        digest, self.pending_digest = self.pending_digest, 0
        self._seq += 1
        header = self._all_gather(np.array([[0, digest, self._seq]], dtype=np.int64))
        if int(header[0, 2]) != self._seq:
            raise self.fail("rank 0's header never arrived", "rank 0 did not answer")
        length = int(header[0, 0])
        if length == 0:
            return PING, (), {}
        payload = self._all_sum(np.zeros((length,), dtype=np.uint8))
        command: Command = pickle.loads(payload.tobytes())
        return command

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (every rank must call it)."""
        if not self.grouped:
            return [value]
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = self._all_gather(np.array([[len(data)]], dtype=np.int64))
        lengths = [int(n) for n in sizes[:, 0]]
        padded = np.zeros((1, max(lengths)), dtype=np.uint8)
        padded[0, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        rows = self._all_gather(padded)
        return [pickle.loads(rows[r, : lengths[r]].tobytes()) for r in range(self.size)]

    # ---------------------------------------------------------- the watchdog
    @contextmanager
    def watched(self, what: str, limit: float | None = None) -> Iterator[None]:
        """Marks a stretch of collectives for the watchdog; a failure inside breaks the group.

        `limit` defaults to the step timeout.
        """
        if not self.grouped:
            yield
            return
        if self.failure is not None:
            raise self.failure
        self._busy = (time.monotonic(), limit or self.timeout, what)
        try:
            yield
        except WorkerError:  # an expected refusal, the same on every rank
            raise
        except Exception as exc:
            raise self.fail(f"{what} failed on rank {self.rank} ({exc})") from exc
        finally:
            self._busy = None

    def silent_ranks(self) -> str:
        """Which ranks may have gone silent, as words ("rank 1", "one of ranks 1, 2")."""
        others = [r for r in range(self.size) if r != self.rank]
        if len(others) == 1:
            return f"rank {others[0]}"
        return "one of ranks " + ", ".join(map(str, others))

    def fail(self, why: str, blame: str = "") -> WorkerError:
        """Marks the group broken (once) and tells the owner; returns the error.

        `blame` names the ranks at fault; by default, the ranks that may be silent.
        """
        if self.failure is None:
            blame = blame or f"{self.silent_ranks()} did not answer"
            self.failure = Unavailable(
                f"the worker group is broken: {why}; {blame}. "
                "The worker stops so that a supervisor can restart the group"
            )
            log.critical("%s", self.failure.message)
            self.on_failure(self.failure)
        return self.failure

    def overdue(self) -> str | None:
        """Why the collective in progress is past its limit, or None."""
        busy = self._busy
        if busy is None:
            return None
        since, limit, what = busy
        if time.monotonic() - since <= limit:
            return None
        return f"{what} did not finish within {limit:.1f} s"


class Watchdog:
    """Polls a channel: a collective past its time limit breaks the group."""

    def __init__(self, channel: GroupChannel) -> None:
        self._channel = channel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="group-watchdog", daemon=True)
        if channel.grouped:
            self._thread.start()

    def _watch(self) -> None:
        channel = self._channel
        period = min(max(channel.timeout / 20, 0.05), 1.0)
        while not self._stop.wait(period) and channel.failure is None:
            why = channel.overdue()
            if why is not None:
                channel.fail(why)
                return

    def stop(self) -> None:
        self._stop.set()


def join(backend: str, name: str, timeout: float) -> GroupChannel:
    """Joins the group `mlx.launch` started (MLX_RANK, MLX_HOSTFILE, ...) over `backend`.

    `name` is how the channel reports the backend (mlx.launch's name for it).
    """
    group = mx.distributed.init(strict=True, backend=backend)
    return GroupChannel(group, backend=name, timeout=timeout)
