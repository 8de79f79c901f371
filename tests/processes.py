"""Worker and fleet processes for the end-to-end tests, and the requests they stream.

`Proc` runs one `mlx-worker` subprocess and reaps it whatever happens; `WorkerPool`
keeps `POOL_SIZE` workers that a test may kill and start again on the same port;
`Fleet` is a `mlx-worker fleet` process with its FleetService stub.
"""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2, fleet_pb2_grpc
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

FLEET = "mlx_worker.v1.FleetService"
POOL_SIZE = 3
READY_TIMEOUT = 120.0
STREAM_TIMEOUT = 240.0


# ---------------------------------------------------------------- processes
class Proc:
    """A `python -m mlx_worker_svc ...` subprocess; a thread keeps its output."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_worker_svc", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = READY_TIMEOUT) -> re.Match[str]:
        """Waits for an output line matching `pattern`; fails if the process exits first."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for line in self.lines[seen:]:
                match = re.search(pattern, line)
                if match:
                    return match
                seen += 1
            if self.proc.poll() is not None:
                self._reader.join(timeout=10)
                # The last lines may have arrived with the exit.
                for line in self.lines[seen:]:
                    match = re.search(pattern, line)
                    if match:
                        return match
                pytest.fail(f"{self.args[0]} exited {self.proc.returncode}:\n{self.output}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.args[0]} printed no {pattern!r}:\n{self.output}")
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (no drain, no goodbye), then reap."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def reap(self) -> None:
        self.kill()
        self._reader.join(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


class WorkerPool:
    """`POOL_SIZE` worker processes; a dead one can be started again on its port."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.everything: list[Proc] = []  # every process started, to reap
        self.procs: list[Proc] = []
        self.ports: list[int] = []

    def start(self) -> None:
        """Starts the workers side by side; returns when all are ready."""
        starting = [self._spawn(0) for _ in range(POOL_SIZE)]
        for proc in starting:
            self.ports.append(self._ready(proc))
            self.procs.append(proc)

    def _spawn(self, port: int) -> Proc:
        proc = Proc(
            [
                "serve",
                "--model",
                str(self.model),
                "--auto-init",
                "--port",
                str(port),
                "--grace-seconds",
                "1",
            ]
        )
        self.everything.append(proc)
        return proc

    @staticmethod
    def _ready(proc: Proc) -> int:
        port = int(proc.wait_for(r"listening on [\d.]+:(\d+)").group(1))
        proc.wait_for(r"^ready:")
        return port

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def kill(self, index: int) -> None:
        self.procs[index].kill()

    def restart(self, *indexes: int) -> None:
        """Starts new worker processes on the ports of `indexes` (their old ones dead)."""
        for index in indexes:
            assert not self.procs[index].alive()
            self.procs[index] = self._spawn(self.ports[index])
        for index in indexes:
            assert self._ready(self.procs[index]) == self.ports[index]

    def heal(self) -> None:
        self.restart(*(i for i, proc in enumerate(self.procs) if not proc.alive()))

    def reap(self) -> None:
        for proc in self.everything:
            proc.reap()


class Fleet:
    """A `mlx-worker fleet` process in front of some workers, and a stub to it."""

    def __init__(self, proc: Proc, targets: list[str]) -> None:
        self.proc, self.targets = proc, targets
        self.port = int(self.proc.wait_for(r"fleet listening on [\d.]+:(\d+)").group(1))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = fleet_pb2_grpc.FleetServiceStub(self.channel)

    def status(self) -> fleet_pb2.StatusResponse:
        return self.stub.Status(fleet_pb2.StatusRequest(), timeout=30)

    def worker(self, target: str) -> fleet_pb2.WorkerStatus:
        [found] = [w for w in self.status().workers if w.target == target]
        return found

    def wait(
        self,
        condition: Callable[[fleet_pb2.StatusResponse], bool],
        what: str,
        timeout: float = 60.0,
    ) -> fleet_pb2.StatusResponse:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if condition(status):
                return status
            assert time.monotonic() < deadline, f"fleet: no {what} in {timeout:.0f} s\n{status}"
            time.sleep(0.1)

    def generate(self, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(request, timeout=STREAM_TIMEOUT))


class Stream(threading.Thread):
    """One Generate stream read on its own thread; keeps messages, timing, the error."""

    def __init__(self, stub: Any, request: pb.GenerateRequest) -> None:
        super().__init__(daemon=True)
        self.stub, self.request = stub, request
        self.messages: list[pb.GenerateResponse] = []
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.first_token = threading.Event()
        self.elapsed = 0.0

    def run(self) -> None:
        start = time.monotonic()
        try:
            for message in self.stub.Generate(self.request, timeout=STREAM_TIMEOUT):
                self.messages.append(message)
                self.tokens.extend(message.token_ids)
                if self.tokens:
                    self.first_token.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - start
            self.first_token.set()

    @property
    def finish_reason(self) -> int:
        return self.messages[-1].finish_reason if self.messages else pb.FINISH_REASON_UNSPECIFIED


def run_streams(stub: Any, requests: list[pb.GenerateRequest]) -> list[Stream]:
    streams = [Stream(stub, request) for request in requests]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.join(timeout=STREAM_TIMEOUT + 30)
        assert not stream.is_alive(), "a Generate stream never ended"
    return streams


# ---------------------------------------------------------------- fixtures
# ---------------------------------------------------------------- requests
def token_request(prompt: list[int], max_tokens: int, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling_params=pb.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling
        ),
    )


def distinct_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    while len(prompts) < count:
        prompt = [rng.randrange(1000, 40000) for _ in range(length)]
        if prompt not in prompts:
            prompts.append(prompt)
    return prompts
