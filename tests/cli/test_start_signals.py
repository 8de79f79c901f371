"""A stop signal before a command has installed its drain ends it at once, exit 0.

`serve`, `fleet` and `gateway` drain on SIGTERM, SIGINT or SIGHUP once they are up;
before that (the first second or so, while the engine's modules import) a
signal must not leave Python's exit 143 or a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _wait_for_handlers(pid: int) -> None:
    """Waits until the command has set its start-up handlers (Linux: /proc's SigCgt shows
    SIGTERM and SIGHUP caught, which Python itself never catches; it catches SIGINT from
    its own start), so that a busy machine's slow interpreter start does not meet the
    signal before the command runs; elsewhere, half a second."""
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        time.sleep(0.5)
        return
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        caught = next(
            (
                line.split()[1]
                for line in status.read_text().splitlines()
                if line.startswith("SigCgt:")
            ),
            "0",
        )
        if all(int(caught, 16) >> (s - 1) & 1 for s in (signal.SIGTERM, signal.SIGHUP)):
            return
        time.sleep(0.005)
    raise AssertionError("the command never set its start-up signal handlers")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_during_start_up_exits_0_quietly(tiny_dir: Path, signum: int) -> None:
    serve = [sys.executable, "-m", "mlx_worker_svc", "serve", "--model", str(tiny_dir)]
    proc = subprocess.Popen(
        [*serve, "--auto-init", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_for_handlers(proc.pid)  # the command runs; its modules still import
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
