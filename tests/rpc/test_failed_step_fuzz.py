"""A seeded fuzz of steps that fail while they run: the tokens are those of a run without.

Each round drives six greedy requests through Execute on a random schedule
(prompt chunks, requests left out of steps, preemption and resume, prefix
cache on), twice: once clean, once with a request past the grammar engine's
limits (a choice of 2,001 strings) added to about a third of the steps. Such a
step fails while it runs (INVALID_ARGUMENT); the scheduler then sends the same
step again without it, finishing it as worker.proto says. Every request must
end with the clean run's tokens, no KV block may stay held, and the worker must
stay SERVING: a failed step is undone (engine/recovery.py), and the KV it wrote
is rebuilt from the requests' tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from driver import bring_up, code_of, live_server

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

ROUNDS = 10
PAST_LIMIT = pb.StructuredOutputs(
    choice=pb.StructuredChoice(choices=[f"city{i}" for i in range(2001)])
)


@dataclass
class _Req:
    prompt: list[int]
    params: pb.SamplingParams
    out: list[int] = field(default_factory=list)
    computed: int = 0
    started: bool = False
    preempted: bool = False
    done: bool = False


def _schedule(rng: random.Random, reqs: dict[str, _Req], epoch: int) -> pb.ExecuteRequest:
    """One random step over the requests not done (possibly empty)."""
    step = pb.ExecuteRequest(worker_epoch=epoch)
    for req_id, r in reqs.items():
        if r.done:
            continue
        if not r.started:
            if rng.random() < 0.6:
                new = pb.NewRequest(req_id=req_id, prompt_token_ids=r.prompt)
                new.sampling_params.CopyFrom(r.params)
                step.new_requests.append(new)
                step.num_scheduled_tokens[req_id] = rng.randrange(1, len(r.prompt) + 1)
        elif not r.preempted and rng.random() < 0.07:
            step.preempted_req_ids.append(req_id)
        elif rng.random() < 0.7:
            left = len(r.prompt) + len(r.out) - r.computed
            step.cached_requests.append(
                pb.CachedRequest(
                    req_id=req_id,
                    num_computed_tokens=r.computed,
                    resumed_from_preemption=r.preempted,
                )
            )
            step.num_scheduled_tokens[req_id] = rng.randrange(1, left + 1)
    return step


def _apply(reqs: dict[str, _Req], step: pb.ExecuteRequest, response: pb.ExecuteResponse) -> None:
    for req_id in step.preempted_req_ids:
        reqs[req_id].preempted, reqs[req_id].computed = True, 0
    for new in step.new_requests:
        reqs[new.req_id].started = True
    for out in response.outputs:
        r = reqs[out.req_id]
        r.out += out.sampled_token_ids
        r.computed = out.num_computed_tokens
        r.preempted = False
        r.done = r.done or bool(out.finish_reason)


def _round(
    stub: pb_grpc.WorkerServiceStub, epoch: int, seed: int, fail: bool
) -> tuple[dict[str, list[int]], int]:
    """The requests' tokens, and how many steps failed."""
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    rng, faults = random.Random(seed), random.Random(seed + 1000)
    reqs = {
        f"r{i}": _Req(
            prompt=[rng.randrange(100, 40000) for _ in range(rng.randrange(3, 40))],
            params=pb.SamplingParams(
                temperature=0, max_tokens=rng.randrange(3, 12), ignore_eos=True
            ),
        )
        for i in range(6)
    }
    failed = 0
    while not all(r.done for r in reqs.values()):
        step = _schedule(rng, reqs, epoch)
        if not step.num_scheduled_tokens and not step.preempted_req_ids:
            continue
        if fail and faults.random() < 0.3:
            bad_id = f"bad{failed}"
            bad = pb.ExecuteRequest()
            bad.CopyFrom(step)
            bad.new_requests.append(pb.NewRequest(req_id=bad_id, prompt_token_ids=[5, 6]))
            bad.new_requests[-1].sampling_params.structured_outputs.CopyFrom(PAST_LIMIT)
            bad.num_scheduled_tokens[bad_id] = 2
            try:
                stub.Execute(bad)
            except grpc.RpcError as exc:
                assert code_of(exc) == grpc.StatusCode.INVALID_ARGUMENT, exc
                failed += 1
            else:
                raise AssertionError("a step past the grammar engine's limits ran")
            step.finished_req_ids.append(bad_id)
        _apply(reqs, step, stub.Execute(step))
    health = stub.CheckHealth(pb.CheckHealthRequest())
    assert health.state == pb.WORKER_STATE_SERVING and health.kv.used_blocks == 0, health
    return {req_id: r.out for req_id, r in reqs.items()}, failed


def test_failed_steps_leave_every_request_its_tokens(tiny_dir: Path) -> None:
    failed = 0
    with live_server() as (_, stub):
        epoch = bring_up(stub, tiny_dir)
        for seed in range(ROUNDS):
            clean, _ = _round(stub, epoch, seed, fail=False)
            faulty, count = _round(stub, epoch, seed, fail=True)
            assert faulty == clean, seed
            failed += count
    print(f"{ROUNDS} rounds, {failed} steps failed while they ran")
    assert failed >= ROUNDS
