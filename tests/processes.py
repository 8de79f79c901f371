"""Worker and fleet processes for the end-to-end tests, and the requests they stream.

`Proc` runs one `mlx-worker` subprocess, keeps its output lines with the time each
arrived, and reaps it whatever happens; `WorkerPool` keeps workers (`serve
--auto-init`, or bare `serve` for a scheduler to bring up) that a test may kill and
start again on the same port; `Fleet` is a `mlx-worker fleet` process with its
FleetService stub; `Stream` reads one Generate stream on its own thread and times
every message.
"""

from __future__ import annotations

import itertools
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
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line arrived (time.monotonic)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.times.append(time.monotonic())
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

    def seconds_to(self, pattern: str, timeout: float = READY_TIMEOUT) -> float:
        """Seconds from the start to the first output line matching `pattern` (waits for it)."""
        self.wait_for(pattern, timeout)
        index = next(i for i, line in enumerate(self.lines) if re.search(pattern, line))
        return self.times[index] - self.started

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
    """Worker processes; a dead one can be started again on its port.

    `auto_init` workers run `serve --model M --auto-init` and are ready at their
    `ready:` line; bare ones run plain `serve` and wait for a scheduler to take
    them through the lifecycle (`fleet --model M`).
    """

    def __init__(self, model: Path, size: int = POOL_SIZE, *, auto_init: bool = True) -> None:
        self.model, self.size, self.auto_init = model, size, auto_init
        self.everything: list[Proc] = []  # every process started, to reap
        self.procs: list[Proc] = []
        self.ports: list[int] = []

    def start(self) -> None:
        """Starts the workers side by side; returns when all are ready."""
        starting = [self._spawn(0) for _ in range(self.size)]
        for proc in starting:
            self.ports.append(self._ready(proc))
            self.procs.append(proc)

    def _spawn(self, port: int) -> Proc:
        args = ["serve", "--model", str(self.model), "--auto-init"] if self.auto_init else ["serve"]
        proc = Proc([*args, "--port", str(port), "--grace-seconds", "1"])
        self.everything.append(proc)
        return proc

    def _ready(self, proc: Proc) -> int:
        port = int(proc.wait_for(r"listening on [\d.]+:(\d+)").group(1))
        if self.auto_init:
            proc.wait_for(r"^ready:")
        return port

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def kill(self, index: int) -> None:
        self.procs[index].kill()

    def respawn(self, index: int) -> Proc:
        """Starts a new process on the port of `index` (its old one dead); does not wait."""
        assert not self.procs[index].alive()
        self.procs[index] = self._spawn(self.ports[index])
        return self.procs[index]

    def restart(self, *indexes: int) -> None:
        """Starts new worker processes on the ports of `indexes` and waits until ready."""
        for index in indexes:
            self.respawn(index)
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
        self.began = 0.0
        self.arrived: list[float] = []  # when each message came (time.monotonic)
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.first_token = threading.Event()
        self.elapsed = 0.0

    def run(self) -> None:
        self.began = start = time.monotonic()
        try:
            for message in self.stub.Generate(self.request, timeout=STREAM_TIMEOUT):
                self.messages.append(message)
                self.arrived.append(time.monotonic())
                self.tokens.extend(message.token_ids)
                if self.tokens:
                    self.first_token.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - start
            self.first_token.set()

    def longest_wait(self) -> float:
        """The longest time without a message, from the call's start to its last message."""
        marks = [self.began, *self.arrived]
        return max((b - a for a, b in itertools.pairwise(marks)), default=0.0)

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


def tokens_of(messages: list[pb.GenerateResponse]) -> list[int]:
    """The token ids of a Generate stream's messages, in order."""
    return [token for message in messages for token in message.token_ids]


def text_of(messages: list[pb.GenerateResponse]) -> str:
    """The text of a Generate stream's messages, joined."""
    return "".join(message.text for message in messages)


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


def by_target(status: fleet_pb2.StatusResponse) -> dict[str, fleet_pb2.WorkerStatus]:
    return {w.target: w for w in status.workers}
