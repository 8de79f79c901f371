"""A stop signal before a command has installed its drain ends it at once, exit 0.

`serve`, `fleet` and `gateway` drain on SIGTERM or SIGINT once they are up;
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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_during_start_up_exits_0_quietly(tiny_dir: Path, signum: int) -> None:
    serve = [sys.executable, "-m", "mlx_worker_svc", "serve", "--model", str(tiny_dir)]
    proc = subprocess.Popen(
        [*serve, "--auto-init", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    time.sleep(0.5)  # the command runs; its modules still import
    proc.send_signal(signum)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
