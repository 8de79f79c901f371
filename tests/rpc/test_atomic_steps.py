"""Fuzz-style: a step with one bad field among good requests changes nothing.

A clean run drives three requests to completion. The same run is repeated, but
before every valid step the test sends a copy of it with one field broken
(chosen at random from a table of corruptions, on a random request). Each bad
step must be refused, and the final tokens must equal the clean run's: a
refused step left no trace.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import grpc
import pytest
from driver import code_of, drive

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 200, 300], [42, 43]]
MAX_TOKENS = 10
REFUSED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
}


def _break_new(rng: random.Random, step: pb.ExecuteRequest) -> bool:
    if not step.new_requests:
        return False
    target = rng.choice(list(step.new_requests))
    how = rng.randrange(6)
    if how == 0:
        target.prompt_token_ids.append(10**6)
    elif how == 1:
        target.sampling_params.temperature = math.nan
    elif how == 2:
        target.sampling_params.top_p = 0.0
    elif how == 3:
        target.sampling_params.stop_token_ids.append(49152)
    elif how == 4:
        step.new_requests.append(pb.NewRequest(req_id=target.req_id, prompt_token_ids=[1]))
    else:
        del target.prompt_token_ids[:]
    return True


def _break_cached(rng: random.Random, step: pb.ExecuteRequest) -> bool:
    if not step.cached_requests:
        return False
    target = rng.choice(list(step.cached_requests))
    how = rng.randrange(4)
    if how == 0:
        target.num_computed_tokens += 1
    elif how == 1:
        target.req_id = "nobody"
    elif how == 2:
        target.new_token_ids.append(123456)
    else:
        target.resumed_from_preemption = True
    return True


def _break_step(rng: random.Random, step: pb.ExecuteRequest) -> bool:
    how = rng.randrange(5)
    ids = list(step.num_scheduled_tokens)
    if how == 0 and ids:
        step.num_scheduled_tokens[rng.choice(ids)] += 50
    elif how == 1:
        step.worker_epoch += 1
    elif how == 2:
        step.finished_req_ids.append("never-seen")
    elif how == 3 and ids:
        step.num_scheduled_tokens[rng.choice(ids)] = 0
    else:
        step.preempted_req_ids.append("never-seen")
    return True


CORRUPTIONS: list[Callable[[random.Random, pb.ExecuteRequest], bool]] = [
    _break_new,
    _break_cached,
    _break_step,
]


@pytest.mark.parametrize("seed", range(6))
def test_bad_steps_leave_no_trace(tiny_stub: Stub, seed: int) -> None:
    epoch = int(tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
    clean = drive(tiny_stub, epoch, PROMPTS, max_tokens=MAX_TOKENS, chunk=4)
    rng = random.Random(seed)
    refused = 0

    def before_each(step: pb.ExecuteRequest) -> None:
        nonlocal refused
        bad = pb.ExecuteRequest()
        bad.CopyFrom(step)
        broken = False
        while not broken:
            broken = rng.choice(CORRUPTIONS)(rng, bad)
        with pytest.raises(grpc.RpcError) as info:
            tiny_stub.Execute(bad)
        assert code_of(info.value) in REFUSED
        refused += 1

    fuzzed = drive(
        tiny_stub, epoch, PROMPTS, max_tokens=MAX_TOKENS, chunk=4, before_step=before_each
    )
    assert fuzzed == clean
    assert refused >= MAX_TOKENS
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_running_requests == 0 and health.kv.used_blocks == 0
