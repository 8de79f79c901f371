"""`serve --world-size N`: a group that cannot start on this machine is refused before
launch, and the command exits with rank 0 even when another rank cannot be stopped."""

from __future__ import annotations

import argparse
import json
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
    values |= {"host": "127.0.0.1", "port": 0, "command": "serve"}  # serve's: any port
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


HOSTS = [{"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]


@pytest.mark.parametrize(
    ("text", "world_size", "says"),
    [
        (None, 2, "cannot read it (No such file or directory)"),
        ("export A=1", 2, "not JSON (Expecting value"),
        ('{"hosts": "mac1"}', 2, "not an mlx.launch hostfile"),
        ('[{"ips": ["10.0.0.1"]}]', 1, "not an mlx.launch hostfile"),
        (json.dumps(HOSTS), 3, "lists 2 hosts, one rank each, but --world-size is 3"),
        (json.dumps([{"ssh": "mac1"}, {"ssh": "mac2"}]), 2, 'ring backend needs "ips" for each'),
        (json.dumps([{"ssh": "a", "ips": "10.0.0.1"}, HOSTS[1]]), 2, "hosts[0].ips must be a list"),
        (json.dumps([HOSTS[0], {"ssh": "b", "ips": [5]}]), 2, "hosts[1].ips must be a list of IP"),
        (json.dumps([HOSTS[0], {"ssh": "b", "ips": ["mac2"]}]), 2, "hosts[1].ips must be a list"),
        (
            json.dumps({"backend": "jaccl", "hosts": [{"ssh": "a"}, {"ssh": "b"}]}),
            2,
            'the jaccl backend needs "ips" for the first host (rank 0)',
        ),
        (json.dumps({"backend": "jaccl", "hosts": [HOSTS[0], {"ssh": "b"}]}), 2, ""),
        (json.dumps(HOSTS), 2, ""),
        (json.dumps({"hosts": HOSTS}), 2, ""),
    ],
)
def test_a_hostfile_is_checked_before_launch(
    tmp_path: Path, text: str | None, world_size: int, says: str
) -> None:
    hostfile = tmp_path / "hosts.json"
    if text is not None:
        hostfile.write_text(text)
    problem = group_launch.hostfile_problem(str(hostfile), world_size, "")
    assert (says in problem) if says else problem == "", problem
    assert problem == "" or problem.startswith(f"--hostfile {hostfile}")


def test_serve_with_a_bad_hostfile_exits_2_on_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    command = [sys.executable, "-m", "mlx_worker_svc", "serve", "--world-size", "2"]
    command += ["--hostfile", str(missing), "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == [
        f"mlx-worker serve: --hostfile {missing}: cannot read it (No such file or directory)"
    ]


# Stands in for mlx.launch: starts a "rank" that SIGTERM cannot end (as a stopped one),
# prints rank 0's lines as a group's rank 0 does, and waits for the rank, as the
# launcher waits for its ranks.
_LAUNCHER = """
import os, signal, subprocess, sys
stuck = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(sys.argv[1].format(rank=0, size=2, backend="ring", pid=os.getpid(), host=sys.argv[2]))
for line in sys.argv[3:]:
    print(line.format(status=3), flush=True)
stuck.wait()
"""


@pytest.mark.parametrize(
    "exits",
    [
        [group_launch.EXIT_LINE],
        # mlx.launch's own line may come first (seen once in three runs): the same.
        ["[WARN] Node with rank 0 exited with code {status}", group_launch.EXIT_LINE],
    ],
    ids=["rank-0-first", "launcher-first"],
)
def test_the_command_exits_with_rank_0_when_another_rank_will_not_end(
    monkeypatch: pytest.MonkeyPatch, exits: list[str]
) -> None:
    monkeypatch.setattr(group_launch, "AFTER_RANK0_SECONDS", 0.5)
    launcher = [sys.executable, "-c", _LAUNCHER, group_launch.RANK_LINE, socket.gethostname()]
    launcher += exits
    monkeypatch.setattr(group_launch, "launch_command", lambda _args, _argv: launcher)
    began = time.monotonic()
    status = group_launch.run_group(_args(backend="ring", hostfile="hosts.json"), [])
    assert status == 3
    assert time.monotonic() - began < 30  # not the stuck rank's 600 s


def test_rank_0_is_found_in_a_line_it_shares_with_another_ranks() -> None:
    """mlx.launch relays the ranks' output in chunks: two ranks' lines came joined on one
    line, rank 0's second. Unseen, rank 0 got no SIGTERM: the launcher's session was
    stopped, and the group broke instead of draining."""
    one = group_launch.RANK_LINE.format(rank=1, size=2, backend="ring", pid=30050, host="h")
    zero = group_launch.RANK_LINE.format(rank=0, size=2, backend="ring", pid=30049, host="h")
    for line in (zero + "\n", one + zero + "\n", zero + one, f"[x] {one} {zero}"):
        assert group_launch.rank_zero_pid(line, "h") == 30049, line
    assert group_launch.rank_zero_pid(one + "\n", "h") is None
    assert group_launch.rank_zero_pid(zero, "other-host") is None  # rank 0 runs elsewhere


def test_a_local_groups_port_in_use_is_one_line_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 found the port taken only once both ranks had started: its line came among
    the ring's and a "group is broken" line. The launcher tries the port first."""
    monkeypatch.setattr(group_launch, "launch_command", lambda *_: pytest.fail("launched"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = int(held.getsockname()[1])
        args = _args(backend="ring", host="127.0.0.1", port=port, command="serve")
        assert group_launch.run_group(args, []) == 2
    assert capsys.readouterr().err == (
        f"mlx-worker serve: --host 127.0.0.1 --port {port}: cannot listen there "
        "(Address already in use)\n"
    )
