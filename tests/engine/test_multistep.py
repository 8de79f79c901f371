"""Multi-step Execute (ExecuteRequest.num_decode_steps): n decode steps per call.

The tokens are the single-step tokens (mlx-lm's greedy tokens), stopping rules
fire inside the call, and the KV budget counts the extra steps before anything
changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from driver import (
    bring_up,
    code_of,
    details_of,
    drive,
    epoch_of,
    greedy,
    mlx_lm_tokens,
    wait_until_idle,
)

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 20, [42], list(range(500, 537))]
TOKENS = 24


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> list[list[int]]:
    """mlx-lm's greedy tokens for PROMPTS (EOS ignored)."""
    return mlx_lm_tokens(tiny_dir, PROMPTS, TOKENS)


@pytest.mark.parametrize("steps", [5, 24])
def test_multi_step_calls_give_mlx_lm_tokens_in_fewer_calls(
    tiny_stub: Stub, reference: list[list[int]], steps: int
) -> None:
    calls: list[pb.ExecuteRequest] = []
    got = drive(
        tiny_stub,
        epoch_of(tiny_stub),
        PROMPTS,
        max_tokens=TOKENS,
        params=greedy(TOKENS, ignore_eos=True),
        before_step=calls.append,
        decode_steps=steps,
    )
    assert got == reference
    assert len(calls) == -(-TOKENS // steps)  # the prefill step samples too
    assert wait_until_idle(tiny_stub, 10).kv.used_blocks == 0


def test_stopping_rules_fire_inside_a_call(tiny_stub: Stub, reference: list[list[int]]) -> None:
    epoch = epoch_of(tiny_stub)
    stop_on = reference[0][2]
    new = [
        pb.NewRequest(req_id="len", prompt_token_ids=PROMPTS[0], sampling_params=greedy(3)),
        pb.NewRequest(
            req_id="stop",
            prompt_token_ids=PROMPTS[0],
            sampling_params=greedy(20, stop_token_ids=[stop_on]),
        ),
        pb.NewRequest(
            req_id="runs",
            prompt_token_ids=PROMPTS[1],
            sampling_params=greedy(20, ignore_eos=True),
        ),
    ]
    answer = tiny_stub.Execute(
        pb.ExecuteRequest(
            step_id=1,
            worker_epoch=epoch,
            new_requests=new,
            num_scheduled_tokens={"len": 5, "stop": 5, "runs": 3},
            num_decode_steps=8,
        )
    )
    out = {o.req_id: o for o in answer.outputs}
    assert list(out["len"].sampled_token_ids) == reference[0][:3]
    assert out["len"].finish_reason == pb.FINISH_REASON_LENGTH
    assert list(out["stop"].sampled_token_ids) == reference[0][:3]
    assert out["stop"].finish_reason == pb.FINISH_REASON_STOP_TOKEN
    assert list(out["runs"].sampled_token_ids) == reference[1][:8]
    assert out["runs"].finish_reason == pb.FINISH_REASON_UNSPECIFIED
    # The KV of "runs" holds the prompt and the first 7 sampled tokens.
    assert out["runs"].num_computed_tokens == 3 + 7
    assert answer.timings.num_tokens == (5 + 5 + 3) + 2 * 3 + 5
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_running_requests == 1
    tiny_stub.Execute(pb.ExecuteRequest(step_id=2, worker_epoch=epoch, finished_req_ids=["runs"]))
    assert wait_until_idle(tiny_stub, 10).num_running_requests == 0


@pytest.mark.parametrize("bad", [65, 1000])
def test_too_many_decode_steps_are_refused_whole(tiny_stub: Stub, bad: int) -> None:
    request = pb.ExecuteRequest(
        step_id=1,
        worker_epoch=epoch_of(tiny_stub),
        new_requests=[
            pb.NewRequest(req_id="a", prompt_token_ids=[1, 2], sampling_params=greedy(4))
        ],
        num_scheduled_tokens={"a": 2},
        num_decode_steps=bad,
    )
    with pytest.raises(grpc.RpcError) as info:
        tiny_stub.Execute(request)
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(info.value) == f"num_decode_steps must be in [0, 64], got {bad}"
    assert tiny_stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 0


def test_the_kv_budget_counts_the_extra_steps(stub: Stub, tiny_dir: Path) -> None:
    epoch = bring_up(stub, tiny_dir, num_blocks=2)  # 32 tokens of KV

    def start(steps: int) -> pb.ExecuteResponse:
        request = pb.NewRequest(req_id="a", prompt_token_ids=[1] * 30, sampling_params=greedy(9))
        answer: pb.ExecuteResponse = stub.Execute(
            pb.ExecuteRequest(
                step_id=steps,
                worker_epoch=epoch,
                new_requests=[request],
                num_scheduled_tokens={"a": 30},
                num_decode_steps=steps,
            )
        )
        return answer

    # 30 prompt tokens + 3 more decode steps = 33 tokens of KV: refused, nothing added.
    with pytest.raises(grpc.RpcError) as info:
        start(4)
    assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV blocks" in details_of(info.value)
    assert stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 0
    out = start(3).outputs[0]  # 32 tokens: fits
    assert len(out.sampled_token_ids) == 3 and out.num_computed_tokens == 32


def test_generate_streams_ride_along_a_multi_step_call(
    tiny_stub: Stub, reference: list[list[int]]
) -> None:
    stream = tiny_stub.Generate(
        pb.GenerateRequest(
            prompt_token_ids=PROMPTS[2], sampling_params=greedy(TOKENS, ignore_eos=True)
        )
    )
    first = next(stream)
    got = drive(
        tiny_stub,
        epoch_of(tiny_stub),
        PROMPTS[:2],
        max_tokens=TOKENS,
        params=greedy(TOKENS, ignore_eos=True),
        decode_steps=6,
    )
    tokens = list(first.token_ids)
    for message in stream:
        tokens += message.token_ids
    assert got == reference[:2]
    assert tokens == reference[2]


def test_the_fleet_scheduler_decodes_several_steps_a_call_once_all_decode(
    tiny_stub: Stub, server: Any, reference: list[list[int]]
) -> None:
    import asyncio

    from mlx_worker_svc.fleet import FleetConfig, FleetScheduler, LinkConfig

    steps_asked: list[int] = []
    execute = server.worker.execute

    def recording(plan: Any, **kwargs: Any) -> Any:
        steps_asked.append(plan.num_decode_steps)
        return execute(plan, **kwargs)

    server.worker.execute = recording

    async def main() -> list[list[int]]:
        # Unary Execute calls (steps_ahead=0): the stream's steps are one each.
        config = FleetConfig(link=LinkConfig(decode_steps=6, steps_ahead=0))
        fleet = FleetScheduler([f"127.0.0.1:{server.port}"], config)
        await fleet.start()
        await fleet.wait_ready()

        async def one(prompt: list[int]) -> list[int]:
            request = pb.GenerateRequest(
                prompt_token_ids=prompt, sampling_params=greedy(TOKENS, ignore_eos=True)
            )
            return [t async for m in fleet.generate(request) for t in m.token_ids]

        try:
            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
        finally:
            await fleet.stop()

    assert asyncio.run(main()) == reference
    # Calls that start requests run one step; once all decode, six steps a call.
    assert steps_asked[0] == 1 and steps_asked.count(6) >= 2
    assert set(steps_asked) == {1, 6} and len(steps_asked) < TOKENS // 2
