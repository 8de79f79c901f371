"""The signals that stop a process, and an operator's second one told from a duplicate.

SIGTERM, SIGINT and SIGHUP (`STOP_SIGNALS`) each start the same drain: SIGHUP
is what a closed terminal sends, and what an operator used to daemons that
reload on it sends; these processes have nothing to reload, so it drains
rather than kill the process with its requests in flight.

The first signal starts a drain; a second cuts its grace period short. Some
senders deliver one signal twice (GNU `timeout` sends it to the command and to
its process group), so a repeat within `SAME_SIGNAL_SECONDS` of the first is
the same signal, not a second one.
"""

from __future__ import annotations

import signal
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SAME_SIGNAL_SECONDS = 1.0


class Signals:
    """Counts the stop signals a process receives (call `arrived()` in each handler)."""

    def __init__(self) -> None:
        self._first: float | None = None

    def arrived(self) -> str:
        """ "first", "again" (an operator's second) or "same" (a duplicate delivery)."""
        now = time.monotonic()
        if self._first is None:
            self._first = now
            return "first"
        return "again" if now - self._first >= SAME_SIGNAL_SECONDS else "same"
