"""The worker groups the group tests start: a 2-rank group, its health, a single worker.

`Group` starts `mlx-worker serve --world-size 2` (or its two ranks directly) and reaps
every process it started; `HealthWatch` records `grpc.health.v1` Watch statuses; `Single`
is the in-process single worker the group's tokens are compared with.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
from pathlib import Path

import grpc
from driver import bring_up, drive
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpcurl_cli import SERVICE
from processes import Proc

from mlx_worker_svc.cli.group_launch import free_ports
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import WorkerServer

WATCHDOG = 5.0  # --collective-timeout of the groups broken on purpose
MAX_TOKENS = 8


class Group:
    """A 2-rank group on the tiny model, and a stub to rank 0.

    By default started as a user would, `mlx-worker serve --world-size 2`, which runs
    mlx.launch. `direct` starts the two ranks itself with the two variables mlx.launch
    gives each rank of a ring on loopback (MLX_RANK, MLX_HOSTFILE): the same processes
    without mlx.launch, whose I/O loop keeps a core busy (and which SIGTERMs rank 0 when
    a rank dies), for the tests that break a group on purpose.
    """

    def __init__(self, model: Path, *options: str, hostfile: Path | None = None) -> None:
        args = ["serve", "--model", str(model), "--auto-init", "--port", "0"]
        args += ["--grace-seconds", "2", *options]
        if hostfile is None:
            self.procs = [Proc([*args, "--world-size", "2"])]
        else:
            base = free_ports(2)
            hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(2)]))
            env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
            self.procs = [Proc([*args, "--group"], {**env, "MLX_RANK": str(r)}) for r in range(2)]
        self.lead = self.procs[0]
        try:
            self.port = int(self.lead.wait_for(r"listening on [\d.]+:(\d+)").group(1))
            self.lead.wait_for(r"^ready:")
        except BaseException:
            self.reap()
            raise
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.WorkerServiceStub(self.channel)

    @property
    def output(self) -> str:
        return "".join(proc.output for proc in self.procs)

    @property
    def pids(self) -> dict[int, int]:
        """Rank -> pid, from the line each rank prints when it joins."""
        found = re.findall(r"group rank (\d) of 2 \(ring\) pid (\d+)", self.output)
        return {int(rank): int(pid) for rank, pid in found}

    def signal_rank(self, rank: int, signum: int) -> None:
        os.kill(self.pids[rank], signum)

    def exit_status(self, timeout: float = 60.0) -> int:
        """The exit status of rank 0 (through the launcher, when there is one)."""
        return self.lead.proc.wait(timeout=timeout)

    def reap(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            proc.reap()


class HealthWatch(threading.Thread):
    """Records every status `grpc.health.v1.Health/Watch` reports for the worker service."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.statuses: list[int] = []
        self.serving = threading.Event()
        self.not_serving = threading.Event()
        self.start()
        assert self.serving.wait(30), "health never reported SERVING"

    def run(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        watch = health_pb2.HealthCheckRequest(service=SERVICE)
        try:
            for answer in stub.Watch(watch, timeout=120):
                self.statuses.append(answer.status)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    self.serving.set()
                else:
                    self.not_serving.set()
        except grpc.RpcError:
            pass  # the server went away

    def close(self) -> None:
        self.channel.close()
        self.join(timeout=10)


class Single:
    """An in-process single worker on the same model: the reference, and a fleet member."""

    def __init__(self, server: WorkerServer, stub: pb_grpc.WorkerServiceStub, model: Path):
        self.port, self.stub = server.port, stub
        self.epoch = bring_up(stub, model)

    def tokens(self, prompts: list[list[int]], params: pb.SamplingParams) -> list[list[int]]:
        return drive(self.stub, self.epoch, prompts, max_tokens=params.max_tokens, params=params)
