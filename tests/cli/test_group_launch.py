"""`serve --world-size N`: a group that cannot start on this machine is refused before launch."""

from __future__ import annotations

import argparse
import subprocess
import sys
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
