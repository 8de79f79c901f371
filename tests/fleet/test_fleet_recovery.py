"""A fleet losing a busy worker and getting it back: how long requests wait, measured.

A supervisor's restart (SIGKILL, then the same command 1 s or 3 s later) under a
steady load: every request completes, and none waits for a message longer than the
restarted worker's own time to SERVING plus a few steps. Once with
`serve --auto-init` workers (the fleet waits while the worker brings itself up) and
once with bare `serve` workers that `fleet --model` takes through the lifecycle on
the CPU. The README's own fleet example is timed the same way (SmolLM2). Each test
prints its figures; the README's Fleet section quotes them.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from google.protobuf import json_format
from processes import (
    STREAM_TIMEOUT,
    Fleet,
    Proc,
    Stream,
    WorkerPool,
    by_target,
    distinct_prompts,
    token_request,
)

from mlx_worker_svc.gen.mlx_worker.v1 import fleet_pb2
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

STEPS = 5.0
"""Seconds for "a few steps" on a loaded two-core machine (a step here takes milliseconds)."""
PROBE_SLACK = 5.0
"""A worker is up in the fleet within its own start-up plus about one probe interval."""
README = Path(__file__).resolve().parents[2] / "README.md"


class Load:
    """`clients` threads, each sending one greedy request after another until stopped."""

    def __init__(self, fleet: Fleet, clients: int, max_tokens: int, seed: int) -> None:
        self.fleet, self.max_tokens = fleet, max_tokens
        self.prompts = iter(distinct_prompts(2000, 8, seed=seed))
        self.streams: list[Stream] = []
        self._lock = threading.Lock()
        self._halt = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self) -> None:
        while not self._halt.is_set():
            with self._lock:
                stream = Stream(self.fleet.stub, token_request(next(self.prompts), self.max_tokens))
                self.streams.append(stream)
            stream.run()  # on this thread

    def stop(self) -> list[Stream]:
        self._halt.set()
        for thread in self._threads:
            thread.join(timeout=STREAM_TIMEOUT + 30)
            assert not thread.is_alive(), "a client never finished its request"
        return self.streams


def _restart_under_load(
    fleet: Fleet, workers: WorkerPool, serving_line: str | None
) -> Iterator[tuple[float, float, Proc]]:
    """Kills worker 0 while it runs requests and starts it again 1 s, then 3 s, later.

    Yields, per restart: the delay, the restarted worker's time to SERVING (to its
    `serving_line`, or to the fleet showing it up when the fleet brings it up) and
    its process, once the fleet has it back and it has finished a request.
    """
    victim = workers.targets[0]

    def victim_of(status: fleet_pb2.StatusResponse) -> fleet_pb2.WorkerStatus:
        return by_target(status)[victim]

    def back(status: fleet_pb2.StatusResponse, old_epoch: int) -> bool:
        return victim_of(status).up and victim_of(status).worker_epoch != old_epoch

    def worked(status: fleet_pb2.StatusResponse, finished: int) -> bool:
        return victim_of(status).num_finished > finished

    for delay in (1.0, 3.0):
        fleet.wait(lambda s: victim_of(s).num_running > 0, "requests on the victim")
        old_epoch = fleet.worker(victim).worker_epoch
        workers.kill(0)
        time.sleep(delay)
        proc = workers.respawn(0)
        up = fleet.wait(functools.partial(back, old_epoch=old_epoch), "it back up", timeout=120)
        seconds_up = time.monotonic() - proc.started
        serving = proc.seconds_to(serving_line) if serving_line else seconds_up
        finished = victim_of(up).num_finished
        fleet.wait(functools.partial(worked, finished=finished), "work on the restarted one")
        yield delay, serving, proc


def _check_and_report(
    what: str, streams: list[Stream], serving: list[float], max_tokens: int
) -> None:
    assert len(streams) > 10, "too little load to show anything"
    for stream in streams:
        assert stream.error is None, stream.error
        assert stream.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(stream.tokens) == max_tokens
    longest = max(stream.longest_wait() for stream in streams)
    print(
        f"{what}: {len(streams)} requests, all complete; restarted worker to SERVING "
        f"{', '.join(f'{s:.1f}' for s in serving)} s; longest wait for a message {longest:.2f} s"
    )
    assert longest <= min(serving) + STEPS, (longest, serving)


def test_a_busy_worker_restarted_with_auto_init_stalls_no_request(
    pool: WorkerPool, start_fleet: Callable[..., Fleet]
) -> None:
    fleet = start_fleet(pool.targets[:2], "--routing", "least-loaded")
    load = Load(fleet, clients=6, max_tokens=48, seed=21)
    serving: list[float] = []
    try:
        for delay, seconds, proc in _restart_under_load(fleet, pool, r"^ready:"):
            serving.append(seconds)
            ready = [line for line in proc.lines if line.startswith("ready:")]
            assert len(ready) == 1, proc.output
            print(f"restarted {delay:.0f} s after SIGKILL: ready: after {seconds:.1f} s")
    finally:
        streams = load.stop()
    _check_and_report("auto-init restart", streams, serving, 48)


def test_fleet_model_brings_up_bare_workers_and_a_restarted_one(
    fleet_model: Path, start_fleet: Callable[..., Fleet]
) -> None:
    bare = WorkerPool(fleet_model, size=2, auto_init=False)
    try:
        bare.start()
        started = time.monotonic()
        fleet = start_fleet(bare.targets, "--model", str(fleet_model), "--routing", "least-loaded")
        print(f"fleet --model over 2 bare workers: both up {time.monotonic() - started:.1f} s")
        load = Load(fleet, clients=6, max_tokens=48, seed=22)
        serving: list[float] = []
        try:
            for delay, seconds, proc in _restart_under_load(fleet, bare, None):
                serving.append(seconds)
                assert not any(line.startswith("ready:") for line in proc.lines)
                print(
                    f"restarted {delay:.0f} s after SIGKILL: up in the fleet after {seconds:.1f} s"
                )
        finally:
            streams = load.stop()
        _check_and_report("fleet --model restart", streams, serving, 48)
    finally:
        bare.reap()


def _readme_fleet_example() -> tuple[list[list[str]], list[str], dict[str, object]]:
    """The README's three `serve --auto-init` lines, its `fleet` line and Generate body."""
    text = README.read_text()
    block = text[text.index("Three workers and a fleet on one machine:") :]
    block = block[block.index("```sh") + 5 : block.index("```", block.index("```sh") + 5)]
    lines = block.replace("\\\n", " ").splitlines()
    serves = [shlex.split(line.rstrip("& ")) for line in lines if " serve " in line]
    [fleet] = [shlex.split(line.rstrip("& ")) for line in lines if " fleet " in line]
    [generate] = [line for line in lines if "FleetService/Generate" in line]
    body = json.loads(shlex.split(generate)[shlex.split(generate).index("-d") + 1])
    return [s[1:] for s in serves], fleet[1:], body


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.smollm
def test_the_readme_fleet_example_serves_within_the_workers_start_up() -> None:
    serves, fleet_args, body = _readme_fleet_example()
    assert len(serves) == 3 and all("--auto-init" in s for s in serves), serves
    # The README's ports, moved to free ones (other runs may hold 50050-50063).
    ports = {str(p): str(_free_port()) for p in range(50050, 50064)}
    moved = [[ports.get(a, a) for a in args] for args in serves]
    moved.append(
        [re.sub(r"(?<=:)500\d\d$", lambda m: ports[m[0]], ports.get(a, a)) for a in fleet_args]
    )
    procs = [Proc(args) for args in moved]  # all four at once, as the README starts them
    workers, start = procs[:3], procs[0].started
    fleet: Fleet | None = None
    try:
        fleet = Fleet(procs[-1], [])
        up: dict[str, float] = {}  # when the fleet first showed each worker up
        while len(up) < 3:
            assert time.monotonic() - start < 900, f"fleet: workers up {up} after 900 s"
            for worker in fleet.status().workers:
                if worker.up and worker.target not in up:
                    up[worker.target] = time.monotonic() - start
                    if len(up) == 1:  # the README's request, once a worker is up
                        request = json_format.ParseDict(body, pb.GenerateRequest())
                        answer = Stream(fleet.stub, request)
                        answer.start()
            time.sleep(0.1)
        answer.join(timeout=STREAM_TIMEOUT)
        assert answer.error is None and answer.arrived, answer.error
        first = answer.arrived[0] - start
        ready = {  # each worker's own start-up: to its ready: line
            f"127.0.0.1:{args[args.index('--port') + 1]}": proc.seconds_to(r"^ready:")
            for args, proc in zip(moved, workers, strict=False)
        }
        text = "".join(m.text for m in answer.messages)
        print(
            "README fleet example: "
            + "; ".join(f"{t} ready: {ready[t]:.1f} s, up in the fleet {up[t]:.1f} s" for t in up)
            + f"; the first request's first token {first:.1f} s after the start: {text!r}"
        )
        assert "Paris" in text
        for target, seconds in up.items():
            assert seconds <= ready[target] + PROBE_SLACK, (up, ready)
    finally:
        if fleet is not None:
            fleet.channel.close()
        for proc in procs:
            proc.reap()
