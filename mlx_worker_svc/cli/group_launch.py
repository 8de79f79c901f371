"""`mlx-worker serve --world-size N`: a worker group started through `mlx.launch`.

The group's processes are started by MLX's own launcher, which gives each its
rank and the backend's addresses: `mlx.launch` runs this same command line
with `--group` added on every rank (N ranks on this machine, or the hosts of
`--hostfile`). Rank 0 serves gRPC; the other ranks follow it
(engine/group/replica.py). This process relays the group's output, passes SIGTERM
and SIGINT to rank 0 (whose drain stops every rank), and exits with rank 0's
exit status, which rank 0 prints as its last line (`EXIT_LINE`), or mlx.launch
for a rank 0 that could not (killed by signal N: 128 + N, as a shell). Ranks still
running `AFTER_RANK0_SECONDS` after that line (a follower that is stopped or
hung, which mlx.launch's SIGTERM cannot end) are killed with the launcher, so
the command a supervisor watches exits and the group can be restarted.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import IO

from mlx_worker_svc.cli.config_file import usage_error
from mlx_worker_svc.core.flag_values import listening_socket
from mlx_worker_svc.core.signals import STOP_SIGNALS

# Every rank prints RANK_LINE once it has joined the group; rank 0 prints
# EXIT_LINE just before it exits.
RANK_LINE = "mlx-worker group rank {rank} of {size} ({backend}) pid {pid} on {host}"
EXIT_LINE = "mlx-worker rank 0 exits with status {status}"
# The host ends at a space, the line's end, or the next rank's line: mlx.launch relays
# the ranks' output in chunks, so two ranks' lines may come joined on one line.
_RANK = re.compile(
    r"mlx-worker group rank (\d+) of \d+ \(\S+\) pid (\d+) on (\S+?)(?=\s|$|mlx-worker group)"
)
_EXIT = re.compile(r"mlx-worker rank 0 exits with status (-?\d+)")
# mlx.launch's line for a rank that ended without ours (killed by a signal: -N).
_LAUNCHER_EXIT = re.compile(r"Node with rank 0 exited with code (-?\d+)")
BACKENDS = ("ring", "jaccl", "jaccl-ring", "mpi", "nccl")
# More than a pipe buffer holds (64 KiB on Linux, at most that on macOS).
_STDIN_FILL = 256 << 10
# How long the other ranks may take to end once rank 0 has exited.
AFTER_RANK0_SECONDS = 10.0


def init_backend(backend: str) -> str:
    """The name `mx.distributed.init` knows a launcher backend by."""
    return "jaccl" if backend.startswith("jaccl") else backend


def launched_backend() -> str:
    """The backend mlx.launch started this process for, from what it set in the environment."""
    env = os.environ
    if "MLX_IBV_DEVICES" in env:
        return "jaccl-ring" if env.get("MLX_JACCL_RING") else "jaccl"
    if "NCCL_HOST_IP" in env:
        return "nccl"
    if any(name.startswith(("OMPI_COMM_WORLD", "PMI_")) for name in env):
        return "mpi"
    return "ring"


def hostfile_problem(hostfile: str, world_size: int, backend: str) -> str:
    """Why `hostfile` cannot start a group of `world_size` ("" if it can): mlx.launch's
    format (a JSON list of hosts, or an object whose `hosts` is one), one rank a host,
    and for the ring backend each host's `ips` (mlx.launch refuses host names there)."""
    try:
        data = json.loads(Path(hostfile).read_text(encoding="utf-8"))
    except OSError as exc:
        return f"--hostfile {hostfile}: cannot read it ({exc.strerror})"
    except ValueError as exc:
        return f"--hostfile {hostfile}: not JSON ({exc})"
    hosts = data.get("hosts") if isinstance(data, dict) else data
    if not (
        isinstance(hosts, list)
        and hosts
        and all(isinstance(h, dict) and isinstance(h.get("ssh"), str) for h in hosts)
    ):
        return (
            f"--hostfile {hostfile}: not an mlx.launch hostfile (a JSON list of hosts, or an "
            'object with one under "hosts", each {"ssh": NAME, "ips": [IP, ...]})'
        )
    if len(hosts) != world_size:
        return (
            f"--hostfile {hostfile} lists {len(hosts)} hosts, one rank each, but --world-size "
            f"is {world_size}"
        )
    if not backend and isinstance(data, dict):
        backend = str(data.get("backend") or "")
    for i, host in enumerate(hosts):
        ips = host.get("ips", [])
        if not isinstance(ips, list) or not all(_is_ip(ip) for ip in ips):
            return f"--hostfile {hostfile}: hosts[{i}].ips must be a list of IP addresses"
    # The ring connects every rank to addresses; JACCL rank 0's (mlx.launch's rules).
    backend = backend or "ring"
    needs = hosts if backend == "ring" else hosts[:1] if backend == "jaccl" else []
    if not all(h.get("ips") for h in needs):
        which = "each host" if backend == "ring" else "the first host (rank 0)"
        return (
            f'--hostfile {hostfile}: the {backend} backend needs "ips" for {which} (it '
            "connects to addresses, not host names)"
        )
    return ""


def _is_ip(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def group_backend(args: argparse.Namespace) -> str:
    """The backend a group of `args` starts with: --backend, else the hostfile's, else ring."""
    return str(args.backend or (args.hostfile and _hostfile_backend(args.hostfile)) or "ring")


def _hostfile_backend(hostfile: str) -> str:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return str(json.loads(Path(hostfile).read_text()).get("backend") or "")
    return ""


def free_ports(count: int) -> int:
    """A base port with `count` consecutive ports free on loopback (ring backend)."""
    for _ in range(64):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + count <= 65536 and not taken_ports(base, count):
            return base
    raise OSError("no free ports for the ring backend")


def taken_ports(base: int, count: int) -> list[int]:
    """The ports of `base` .. `base + count - 1` that a listener on loopback holds now
    (a port only lingering after a closed connection counts as free, as for the ring)."""
    taken = []
    for port in range(base, base + count):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                taken.append(port)
    return taken


def _mlx_launch() -> str | None:
    here = Path(sys.executable).parent / "mlx.launch"
    return str(here) if here.exists() else shutil.which("mlx.launch")


def launch_command(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """The `mlx.launch` command that starts the group `args` asks for."""
    launcher = _mlx_launch()
    if launcher is None:
        raise FileNotFoundError("mlx.launch is not installed (it comes with the mlx package)")
    backend = group_backend(args)
    command = [launcher, "--backend", backend]
    if args.hostfile:
        command += ["--hostfile", args.hostfile]
    else:
        command += ["--hosts", "127.0.0.1", "-n", str(args.world_size)]
    if backend == "ring":
        command += ["--starting-port", str(args.group_port or free_ports(args.world_size))]
    rank = [sys.executable, "-m", "mlx_worker_svc", *argv, "--backend", backend, "--group"]
    return [*command, "--", *rank]


def _quiet(stdin: IO[str] | None) -> None:
    """Keeps mlx.launch (0.32.4) from spinning a core for as long as the group lives.

    Its loop for each rank waits in `select` for the rank's output, or for room in
    the pipe to the rank's stdin, and that pipe always has room: the loop never
    sleeps. Filling it with blank lines (which our ranks never read) makes it wait.
    The pipe to mlx.launch itself stays open: at EOF its main loop spins instead.
    """
    with contextlib.suppress(OSError, ValueError):
        if stdin is not None:
            stdin.write("\n" * _STDIN_FILL)
            stdin.flush()


def backend_problem(args: argparse.Namespace) -> str:
    """Why the group `args` asks for cannot start on this machine ("" if it can).

    JACCL needs a hostfile (mlx.launch fails on the RDMA devices without one), MPI
    mpirun, and NCCL ranks on this machine a CUDA GPU each; without them MLX fails in
    every rank after the launch (`Cannot initialize nccl distributed backend`).
    The ranks of a --hostfile run elsewhere and are not checked here.
    """
    backend = group_backend(args)
    if backend.startswith("jaccl") and not args.hostfile:
        return (
            f"--backend {backend} needs --hostfile: the Macs' RDMA devices "
            "(mlx.distributed_config --backend jaccl writes one); or use --backend ring"
        )
    if backend == "mpi" and shutil.which("mpirun") is None:
        return "--backend mpi needs mpirun (Open MPI) on the PATH; or use --backend ring"
    if backend != "nccl" or args.hostfile:
        return ""
    from mlx_worker_svc.engine.memory.device import cuda_gpu_count

    gpus = cuda_gpu_count()
    if gpus >= args.world_size:
        return ""
    return (
        f"--backend nccl needs a CUDA GPU for each of the {args.world_size} ranks, and MLX "
        f"sees {gpus} on this machine (install mlx[cuda13] on an NVIDIA host, or use "
        "--backend ring)"
    )


def run_group(args: argparse.Namespace, argv: list[str]) -> int:
    """Starts the group, relays its output, returns rank 0's exit status."""
    problem = backend_problem(args)
    if problem:
        return usage_error(args, problem)
    if args.port and not args.hostfile:  # rank 0 serves here: try its port now, not once
        try:  # both ranks have started (its line then came among a broken group's)
            listening_socket(args.host, args.port).close()
        except OSError as exc:
            return usage_error(args, exc)
    try:
        command = launch_command(args, argv)
    except (FileNotFoundError, OSError) as exc:
        return usage_error(args, exc)
    group = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    if not args.hostfile:
        threading.Thread(target=_quiet, args=(group.stdin,), daemon=True).start()
    rank0: int | None = None
    status: int | None = None

    def forward(signum: int, _frame: FrameType | None) -> None:
        # Rank 0's drain stops every rank; without it yet, stop the launcher's session.
        with contextlib.suppress(ProcessLookupError):
            if rank0 is not None:
                os.kill(rank0, signum)
            else:
                os.killpg(group.pid, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        assert group.stdout is not None
        for line in group.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            rank0 = rank_zero_pid(line, socket.gethostname()) or rank0
            # Rank 0's own line or the launcher's, whichever comes first (either order
            # happens): the status, and the timer for the ranks left behind.
            died, ended = _LAUNCHER_EXIT.search(line), _EXIT.search(line)
            if (died or ended) and status is None:
                if ended:
                    status = int(ended.group(1))
                elif died:  # as a shell says it: 128 + the signal
                    code = int(died.group(1))
                    status = 128 - code if code < 0 else code
                stray = threading.Timer(AFTER_RANK0_SECONDS, _kill_session, (group,))
                stray.daemon = True
                stray.start()
        group.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for pipe in (group.stdin, group.stdout):
            if pipe is not None:
                pipe.close()
    return status if status is not None else 1


def rank_zero_pid(line: str, host: str) -> int | None:
    """The pid of rank 0 if `line` has its RANK_LINE and rank 0 runs on `host` (the line may
    hold other ranks' lines before or after it). Only then can a stop signal go to rank 0
    alone, whose drain stops every rank; without it the launcher's session is stopped, and
    the group with it, undrained."""
    for ranked in _RANK.finditer(line):
        if ranked.group(1) == "0" and ranked.group(3) == host:
            return int(ranked.group(2))
    return None


def _kill_session(group: subprocess.Popen[str]) -> None:
    """Kills mlx.launch and the ranks it started here (SIGKILL ends a stopped one too)."""
    if group.poll() is None:
        print(
            f"mlx-worker serve: ranks still running {AFTER_RANK0_SECONDS:g} s after rank 0 "
            "exited: killed",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pid, signal.SIGKILL)
