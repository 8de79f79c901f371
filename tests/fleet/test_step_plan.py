"""A step's plan counts the KV its new requests may hold once the worker has run it."""

from __future__ import annotations

from mlx_worker_svc.fleet.request import FleetRequest, Phase
from mlx_worker_svc.fleet.step_plan import KVRoom, plan_step
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


def _request(name: str, length: int) -> FleetRequest:
    return FleetRequest(
        request_id=name, prompt=list(range(5, 5 + length)), params=pb.SamplingParams()
    )


def test_a_new_request_counts_the_kv_of_its_whole_prompt() -> None:
    """A prefix-cache hit, which only the worker knows, comes on top of the tokens the step
    schedules: five prompts of 120 tokens (8 blocks each) beside a decoding request of 3
    blocks fill a budget of 40 blocks with four of them, though the step's token budget
    would leave the fifth only 31 tokens (2 blocks). Counting those 2, the worker (its
    prefix cache holding the five prompts) refused the step, and the same step was
    planned again, for good."""
    running = {"x#1": _request("x", 33)}
    running["x#1"].attempt, running["x#1"].phase = 1, Phase.RUNNING
    waiting = [_request(f"p{i}", 120) for i in range(5)]
    step = pb.ExecuteRequest(step_id=1)
    started, used = plan_step(
        step,
        {"x#1": (33, 34)},
        waiting,
        running,
        budget=512,
        used=3,
        max_seqs=64,
        kv=KVRoom(num_blocks=40, block_size=16),
    )
    assert [r.request_id for r in started] == ["p0", "p1", "p2", "p3"]
    assert used == 3 + 4 * 8 <= 40 and [r.request_id for r in waiting] == ["p4"]
    assert step.num_scheduled_tokens["x#1"] == 1
    assert all(step.num_scheduled_tokens[r.worker_id] == 120 for r in started)
