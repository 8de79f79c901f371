"""The fleet and workers whose whole KV budget holds less than the model's context.

A worker of 8 KV blocks (128 tokens) beside the pool's (whose budgets hold the
context): a request goes only where its prompt fits, and where its whole answer
(max_tokens) fits when a worker's budget holds that; one nowhere held is refused
at once, one that outgrows its worker alone says so, and one moving off a lost
worker that only that worker held waits for it to come back. Requests that
outnumber a worker's KV many times over all end, whole, with steps run ahead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from driver import code_of, details_of
from processes import (
    Fleet,
    Proc,
    WorkerPool,
    by_target,
    distinct_prompts,
    run_streams,
    token_request,
    tokens_of,
)


@pytest.fixture(scope="module")
def small(fleet_model: object) -> Iterator[str]:
    """The target of a worker of 8 KV blocks of 16 tokens, on the pool's model."""
    proc = Proc(["serve", "--model", str(fleet_model), "--auto-init", "--num-blocks", "8",
                 "--port", "0", "--grace-seconds", "1"])  # fmt: skip
    try:
        port = proc.wait_for(r"listening on [\d.]+:(\d+)").group(1)
        proc.wait_for(r"^ready:")
        yield f"127.0.0.1:{port}"
    finally:
        proc.reap()


def test_a_request_goes_only_to_a_worker_whose_kv_budget_holds_it(
    pool: WorkerPool, small: str, start_fleet: Callable[..., Fleet]
) -> None:
    """The small worker never gets a request it cannot hold alone (it waited there for
    good, holding up the requests behind it), nor one whose answer outgrows it while
    another worker holds that; with no worker that can, the request is refused at
    once, naming why."""
    [long] = distinct_prompts(1, 200, seed=31)
    [medium] = distinct_prompts(1, 100, seed=33)
    fleet = start_fleet([small, pool.targets[1]], "--routing", "least-loaded")
    for _ in range(3):  # least-loaded would take turns: the small worker is passed over
        assert len(tokens_of(fleet.generate(token_request(long, 8)))) == 8
        assert len(tokens_of(fleet.generate(token_request(medium, 60)))) == 60
    assert by_target(fleet.status())[small].num_finished == 0
    alone = start_fleet([small])
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        alone.generate(token_request(long, 8))
    assert time.monotonic() - began < 10
    assert code_of(refused.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(refused.value) == (
        "prompt_token_ids: the prompt has 200 tokens; the largest KV budget of a worker "
        "of the model holds 128 tokens (8 blocks of 16), less than its context"
    )
    [short] = distinct_prompts(1, 20, seed=32)
    assert len(tokens_of(alone.generate(token_request(short, 8)))) == 8
    # A prompt it holds, an answer that outgrows it: the tokens that fit, then why.
    request = token_request(medium, 60)
    request.request_id = "grows"
    [grown] = run_streams(alone.stub, [request])
    assert grown.error is not None and 20 <= len(grown.tokens) < 60
    assert code_of(grown.error) == grpc.StatusCode.RESOURCE_EXHAUSTED
    said = details_of(grown.error)
    assert said.startswith("the request outgrew the KV budget of its worker, which it had"), said
    assert "'grows'" in said and "#" not in said, said


def test_a_request_only_its_lost_worker_held_waits_for_it_and_goes_on(
    pool: WorkerPool, small: str, start_fleet: Callable[..., Fleet]
) -> None:
    """Past 28 generated tokens a 100-token prompt's sequence outgrows the small worker:
    when its own worker dies, the request waits for it (it was INVALID_ARGUMENT, its
    generated tokens counted as prompt) and, once it is back, goes on there: the same
    greedy tokens as alone."""
    [medium] = distinct_prompts(1, 100, seed=34)
    fleet = start_fleet([pool.targets[1], small], "--routing", "least-loaded")
    request = token_request(medium, 300)
    expected = tokens_of(fleet.generate(request))
    got: list[int] = []
    killed = False
    for message in fleet.stub.Generate(request, timeout=120):
        got.extend(message.token_ids)
        if len(got) >= 40 and not killed:
            killed = True
            pool.kill(1)
            pool.respawn(1)  # comes up on the same port, with a new epoch
    assert got == expected
    workers = by_target(fleet.status())
    assert workers[pool.targets[1]].num_failed_over == 1
    assert workers[small].num_finished == 0


def test_requests_that_outnumber_a_workers_kv_all_end_when_steps_run_ahead(
    fleet_model: object, start_fleet: Callable[..., Fleet]
) -> None:
    """Twenty answers of 70 tokens at once on a worker of 24 KV blocks (four fit), steps
    ahead: each step the worker refuses for KV preempts a request it holds, so every
    request ends, whole. (A refused step preempted a request a later step in flight had
    just started, which freed nothing: the same step was planned and refused again,
    and the worker's requests got no token until one was cancelled.)"""
    proc = Proc(["serve", "--model", str(fleet_model), "--auto-init", "--num-blocks", "24",
                 "--port", "0", "--grace-seconds", "1"])  # fmt: skip
    try:
        port = proc.wait_for(r"listening on [\d.]+:(\d+)").group(1)
        target = f"127.0.0.1:{port}"
        proc.wait_for(r"^ready:")
        fleet = start_fleet([target], "--steps-ahead", "2", "--decode-steps", "4")
        request = token_request([400, 500, 600] * 10, 40)
        alone = tokens_of(fleet.generate(request))
        for _ in range(3):
            calls = [fleet.stub.Generate(request, timeout=60) for _ in range(20)]
            with ThreadPoolExecutor(len(calls)) as pool:
                answers = list(pool.map(lambda call: tokens_of(list(call)), calls))
            assert answers == [alone] * len(calls)
        assert fleet.worker(target).num_running == 0
    finally:
        proc.reap()
