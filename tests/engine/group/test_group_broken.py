"""Worker groups broken on purpose: a killed follower, and a hung one only the watchdog sees.

Each group here has its ranks started directly (`start_group`) with a short
`--collective-timeout`; every open call must end UNAVAILABLE naming rank 1, health turn
NOT_SERVING, and rank 0 exit with status 3.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from driver import code_of, details_of, drive, epoch_of, greedy, live_server
from engine.group.ranks import MAX_TOKENS, WATCHDOG, Group, HealthWatch, Single
from processes import Stream, distinct_prompts, token_request

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc


# ------------------------------------------------------------ broken groups
def _in_flight(stub: pb_grpc.WorkerServiceStub, prompts: list[list[int]]) -> list[object]:
    """Starts long Generate streams and an Execute loop; returns them once all produce."""
    calls = [Stream(stub, token_request(p, 400)) for p in prompts[:2]]
    for call in calls:
        call.start()
    execute = ExecuteLoop(stub, prompts[2])
    for call in calls:
        assert call.first_token.wait(60), "a Generate stream produced nothing"
    assert execute.stepped.wait(60), "Execute made no step"
    return [*calls, execute]


class ExecuteLoop(threading.Thread):
    """Drives one long request through Execute until a step fails."""

    def __init__(self, stub: pb_grpc.WorkerServiceStub, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.stub, self.prompt = stub, prompt
        self.error: grpc.RpcError | None = None
        self.stepped = threading.Event()
        self.elapsed = 0.0
        self.start()

    def run(self) -> None:
        start = time.monotonic()
        try:
            drive(
                self.stub,
                epoch_of(self.stub),
                [self.prompt],
                max_tokens=400,
                params=greedy(400, ignore_eos=True),
                before_step=lambda request: self.stepped.set() if request.step_id else None,
            )
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - start


def _wait_all_unavailable(calls: list[object], since: float) -> float:
    """Waits for every call to end; each with UNAVAILABLE naming rank 1. Returns the last end."""
    for call in calls:
        assert isinstance(call, threading.Thread)
        call.join(timeout=WATCHDOG + 30)
        assert not call.is_alive(), "a call hung"
        error = getattr(call, "error", None)
        assert error is not None and code_of(error) == grpc.StatusCode.UNAVAILABLE, error
        assert "rank 1 did not answer" in details_of(error), details_of(error)
    return time.monotonic() - since


def _break_follower(group: Group, signum: int, seed: int) -> tuple[float, list[object]]:
    """Sends `signum` to rank 1 while calls run: every call must end UNAVAILABLE naming
    rank 1, and health turn NOT_SERVING. Returns the seconds until the last call ended."""
    health = HealthWatch(group.port)
    try:
        calls = _in_flight(group.stub, distinct_prompts(3, 6, seed=seed))
        since = time.monotonic()
        group.signal_rank(1, signum)
        took = _wait_all_unavailable(calls, since)
        assert health.not_serving.wait(10), health.statuses
    finally:
        health.close()
    return took, calls


def test_killing_the_follower_ends_every_call_unavailable(
    start_group: Callable[..., Group],
) -> None:
    group = start_group("--collective-timeout", str(WATCHDOG), "--death-exit-seconds", "2")
    took, _ = _break_follower(group, signal.SIGKILL, seed=41)
    print(f"follower killed: every call ended UNAVAILABLE within {took:.2f} s")
    assert took <= WATCHDOG + 2.0
    assert group.exit_status() == 3


def test_a_hung_follower_trips_the_watchdog(
    start_group: Callable[..., Group], pipeline_dir: Path
) -> None:
    group = start_group(
        "--collective-timeout", str(WATCHDOG), "--death-exit-seconds", "2", model=pipeline_dir
    )
    # This group is a pipeline: rank 1 runs the first layer, rank 0 the second.
    assert group.stub.GetInfo(pb.GetInfoRequest()).model.parallelism == pb.PARALLELISM_PIPELINE
    prompts = distinct_prompts(4, 6, seed=61)
    params = greedy(MAX_TOKENS, ignore_eos=True)
    with live_server() as (server, stub):
        expected = Single(server, stub, pipeline_dir).tokens(prompts, params)
    assert drive(
        group.stub, epoch_of(group.stub), prompts, max_tokens=MAX_TOKENS, params=params
    ) == (expected)
    took, calls = _break_follower(group, signal.SIGSTOP, seed=51)
    print(f"follower stopped: every call ended UNAVAILABLE after {took:.2f} s")
    assert WATCHDOG - 0.5 <= took <= WATCHDOG + 2.0
    message = details_of(calls[0].error)  # type: ignore[attr-defined]
    assert f"did not finish within {WATCHDOG:.1f} s" in message, message
    assert group.exit_status() == 3
