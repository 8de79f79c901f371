"""`serve --world-size N`: a group that cannot start on this machine is refused before
launch, and the command exits with rank 0 even when another rank cannot be stopped."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_worker_svc.cli import group_launch
from mlx_worker_svc.engine.memory import device


def _args(**fields: object) -> argparse.Namespace:
    values: dict[str, object] = {"backend": "nccl", "hostfile": None, "world_size": 2}
    values.update(fields)
    return argparse.Namespace(**values)


def test_nccl_needs_a_cuda_gpu_per_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "cuda_gpu_count", lambda: 1)
    assert group_launch.backend_problem(_args()) == (
        "--backend nccl needs a CUDA GPU for each of the 2 ranks, and MLX sees 1 on this "
        "machine (install mlx[cuda13] on an NVIDIA host, or use --backend ring)"
    )
    monkeypatch.setattr(device, "cuda_gpu_count", lambda: 2)
    assert group_launch.backend_problem(_args()) == ""
    monkeypatch.setattr(device, "cuda_gpu_count", lambda: 0)
    assert group_launch.backend_problem(_args(backend="ring")) == ""
    assert group_launch.backend_problem(_args(hostfile="hosts.json")) == ""  # ranks elsewhere


@pytest.mark.skipif(device.cuda_gpu_count() >= 2, reason="this machine can run an NCCL group")
def test_serve_over_nccl_without_gpus_fails_at_once_with_one_line(tiny_dir: Path) -> None:
    command = [sys.executable, "-m", "mlx_worker_svc", "serve", "--world-size", "2"]
    command += ["--backend", "nccl", "--model", str(tiny_dir), "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert done.stdout == ""  # no rank was launched
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlx-worker serve: --backend nccl needs")
    assert f"MLX sees {device.cuda_gpu_count()} on this machine" in lines[0]


# Stands in for mlx.launch: starts a "rank" that SIGTERM cannot end (as a stopped one),
# prints rank 0's lines as a group's rank 0 does, and waits for the rank, as the
# launcher waits for its ranks.
_LAUNCHER = """
import os, signal, subprocess, sys
stuck = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(sys.argv[1].format(rank=0, size=2, backend="ring", pid=os.getpid(), host=sys.argv[2]))
print(sys.argv[3].format(status=3), flush=True)
stuck.wait()
"""


def test_the_command_exits_with_rank_0_when_another_rank_will_not_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(group_launch, "AFTER_RANK0_SECONDS", 0.5)
    launcher = [sys.executable, "-c", _LAUNCHER, group_launch.RANK_LINE, socket.gethostname()]
    launcher.append(group_launch.EXIT_LINE)
    monkeypatch.setattr(group_launch, "launch_command", lambda _args, _argv: launcher)
    began = time.monotonic()
    status = group_launch.run_group(_args(backend="ring", hostfile="hosts.json"), [])
    assert status == 3
    assert time.monotonic() - began < 30  # not the stuck rank's 600 s
