"""The prefix cache: shared prompt prefixes are reused, outputs never change."""

from __future__ import annotations

from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from driver import code_of, drive, fresh_stub, greedy
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
SYSTEM = [(i * 37) % 3000 + 200 for i in range(100)]  # a 100-token shared prefix


def _up(stub: Stub, model: Path, *, prefix: bool, num_blocks: int = 512) -> int:
    stub.InitDevice(pb.InitDeviceRequest())
    epoch = int(stub.LoadModel(pb.LoadModelRequest(model=str(model))).worker_epoch)
    stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=64, block_size=16))
    answer = stub.InitCache(
        pb.InitCacheRequest(num_blocks=num_blocks, block_size=16, enable_prefix_caching=prefix)
    )
    assert answer.prefix_caching is prefix
    return epoch


def _one(
    stub: Stub,
    epoch: int,
    req_id: str,
    prompt: list[int],
    *,
    chunk: int | None = None,
    max_tokens: int = 8,
    params: pb.SamplingParams | None = None,
) -> tuple[list[int], int, list[pb.ExecuteResponse]]:
    """Runs one request alone; returns (tokens, cached prompt tokens, responses)."""
    sampling = params or greedy(max_tokens)
    computed, cached, step = 0, 0, 0
    tokens: list[int] = []
    responses: list[pb.ExecuteResponse] = []
    new = [pb.NewRequest(req_id=req_id, prompt_token_ids=prompt, sampling_params=sampling)]
    while True:
        left = len(prompt) + len(tokens) - computed
        response = stub.Execute(
            pb.ExecuteRequest(
                step_id=step,
                worker_epoch=epoch,
                new_requests=new,
                cached_requests=[]
                if new
                else [pb.CachedRequest(req_id=req_id, num_computed_tokens=computed)],
                num_scheduled_tokens={req_id: left if chunk is None else min(left, chunk)},
            )
        )
        new, step = [], step + 1
        responses.append(response)
        (out,) = response.outputs
        cached += out.num_cached_prompt_tokens
        tokens += out.sampled_token_ids
        computed = out.num_computed_tokens
        if out.finish_reason:
            return tokens, cached, responses


def test_a_shared_prefix_is_reused_and_outputs_match_without_it(stub: Stub, tiny_dir: Path) -> None:
    epoch = _up(stub, tiny_dir, prefix=True)
    prompts = [[*SYSTEM, 300 + i, 301 + i, 302 + i] for i in range(3)]
    first, cached_first, _ = _one(stub, epoch, "a", prompts[0])
    second, cached_second, responses = _one(stub, epoch, "b", prompts[1])
    assert cached_first == 0
    # 100 shared tokens hold 6 whole blocks of 16.
    assert cached_second == 96
    assert responses[0].outputs[0].num_computed_tokens == len(prompts[1])
    assert responses[0].timings.num_tokens == len(prompts[1]) - 96
    assert stub.CheckHealth(pb.CheckHealthRequest()).kv.prefix_cache_blocks > 0
    # A chunked request starts after its hit and computes its chunk beyond it.
    third, cached_third, chunked = _one(stub, epoch, "c", prompts[2], chunk=2)
    assert cached_third == 96 and chunked[0].outputs[0].num_computed_tokens == 98
    assert len(first) == len(second) == len(third) == 8


def test_a_hit_takes_the_shared_head_of_the_next_cached_block(stub: Stub, tiny_dir: Path) -> None:
    epoch = _up(stub, tiny_dir, prefix=True)
    _one(stub, epoch, "a", [*SYSTEM, *range(300, 316)])  # 7 whole blocks cached
    # 103 tokens shared: 6 whole blocks, then 7 tokens of the 7th.
    shared = [*SYSTEM, 300, 301, 302, 7000, 7001]
    tokens, cached, responses = _one(stub, epoch, "b", shared)
    assert cached == 103
    assert responses[0].timings.num_tokens == len(shared) - 103
    assert [tokens] == _cold_tokens(tiny_dir, [shared])


def test_greedy_outputs_are_identical_with_and_without_the_prefix_cache(
    tiny_dir: Path, stub: Stub
) -> None:
    prompts = [[*SYSTEM, 300 + i, 301 + i, 302 + i] for i in range(4)]
    epoch = _up(stub, tiny_dir, prefix=True)
    warm = [
        _one(stub, epoch, f"w{i}", p, chunk=16 if i % 2 else None) for i, p in enumerate(prompts)
    ]
    assert [w[1] for w in warm] == [0, 96, 96, 96]
    together = drive(stub, epoch, prompts, max_tokens=8)
    reference = _cold_tokens(tiny_dir, prompts)
    assert [w[0] for w in warm] == reference
    assert together == reference


def _cold_tokens(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of `prompts`, one at a time, on a fresh worker without the cache."""
    with fresh_stub() as stub:
        epoch = _up(stub, model, prefix=False)
        outs = [_one(stub, epoch, f"r{i}", p) for i, p in enumerate(prompts)]
    assert all(cached == 0 for _, cached, _ in outs)
    return [tokens for tokens, _, _ in outs]


def test_smollm_with_a_cached_prefix_matches_mlx_lm(stub: Stub, smollm_f32_dir: Path) -> None:
    # SmolLM2's weights expanded to float32: what the cache holds and copies is the same
    # float32 KV as the 4-bit model's, and BLAS runs it in seconds on a CPU.
    smollm_dir = smollm_f32_dir
    model, tokenizer = load(str(smollm_dir))
    system = tokenizer.encode("You are a helpful assistant who answers in one short sentence. " * 4)
    prompts = [system + tokenizer.encode(q, add_special_tokens=False) for q in (" Hi!", " Why?")]
    expected = []
    for prompt in prompts:
        steps = generate_step(mx.array(prompt), model, max_tokens=6)
        expected.append([int(token) for token, _ in steps])
    del model
    epoch = _up(stub, smollm_dir, prefix=True)
    got = [_one(stub, epoch, f"s{i}", p, max_tokens=6) for i, p in enumerate(prompts)]
    assert got[0][1] == 0 and got[1][1] == (len(system) // 16) * 16 > 0
    eos = set(tokenizer.eos_token_ids)
    for (tokens, _, _), want in zip(got, expected, strict=True):
        cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        assert tokens == want[:cut]


def test_a_finished_conversation_is_reused_by_its_next_turn(stub: Stub, tiny_dir: Path) -> None:
    epoch = _up(stub, tiny_dir, prefix=True)
    turn1 = [*SYSTEM, 401, 402, 403]
    reply, _, _ = _one(stub, epoch, "t1", turn1, max_tokens=40)
    turn2 = turn1 + reply + [404, 405]
    _, cached, _ = _one(stub, epoch, "t2", turn2)
    # The KV of prompt and reply went to the cache when turn 1 finished.
    assert cached == ((len(turn1) + len(reply) - 1) // 16) * 16
    assert cached > 96


def test_prompt_logprobs_requests_and_reset_bypass_the_cache(stub: Stub, tiny_dir: Path) -> None:
    epoch = _up(stub, tiny_dir, prefix=True)
    prompt = [*SYSTEM, 500]
    _one(stub, epoch, "x", prompt)
    _, cached, responses = _one(stub, epoch, "y", prompt, params=greedy(2, prompt_logprobs=1))
    assert cached == 0 and len(responses[0].outputs[0].prompt_logprobs) == len(prompt) - 1
    freed = stub.ResetPrefixCache(pb.ResetPrefixCacheRequest()).freed_blocks
    assert freed > 0
    assert stub.CheckHealth(pb.CheckHealthRequest()).kv.prefix_cache_blocks == 0
    _, cached, _ = _one(stub, epoch, "z", prompt)
    assert cached == 0


def _preempted_and_resumed(
    stub: Stub,
    epoch: int,
    prompt: list[int],
    sampling: pb.SamplingParams,
    kv_between: list[pb.KVUsage] | None = None,
) -> tuple[pb.RequestOutput, pb.RequestOutput]:
    """A request prefilled whole (step 1), preempted (step 2), then resumed with all its
    tokens (step 3): the outputs of steps 1 and 3 (`kv_between` gets the KV in between)."""
    first = stub.Execute(
        pb.ExecuteRequest(
            step_id=1,
            worker_epoch=epoch,
            new_requests=[
                pb.NewRequest(req_id="p", prompt_token_ids=prompt, sampling_params=sampling)
            ],
            num_scheduled_tokens={"p": len(prompt)},
        )
    ).outputs[0]
    stub.Execute(pb.ExecuteRequest(step_id=2, worker_epoch=epoch, preempted_req_ids=["p"]))
    if kv_between is not None:
        kv_between.append(stub.CheckHealth(pb.CheckHealthRequest()).kv)
    resumed = stub.Execute(
        pb.ExecuteRequest(
            step_id=3,
            worker_epoch=epoch,
            cached_requests=[
                pb.CachedRequest(req_id="p", num_computed_tokens=0, resumed_from_preemption=True)
            ],
            num_scheduled_tokens={"p": len(prompt) + len(first.sampled_token_ids)},
        )
    ).outputs[0]
    return first, resumed


def test_a_resumed_request_restarts_from_its_cached_prefix(stub: Stub, tiny_dir: Path) -> None:
    epoch = _up(stub, tiny_dir, prefix=True)
    prompt = [*SYSTEM, 600, 601]
    reference, _, _ = _one(stub, epoch, "ref", prompt, max_tokens=10)
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    out, resumed = _preempted_and_resumed(stub, epoch, prompt, greedy(10))
    tokens = list(out.sampled_token_ids)
    # Preempting gave its blocks to the prefix cache; resuming takes them back.
    assert resumed.num_cached_prompt_tokens == 96
    tokens += resumed.sampled_token_ids
    computed, step = resumed.num_computed_tokens, 4
    while len(tokens) < 10:
        out = stub.Execute(
            pb.ExecuteRequest(
                step_id=step,
                worker_epoch=epoch,
                cached_requests=[pb.CachedRequest(req_id="p", num_computed_tokens=computed)],
                num_scheduled_tokens={"p": 1},
            )
        ).outputs[0]
        tokens += out.sampled_token_ids
        computed, step = out.num_computed_tokens, step + 1
    assert tokens == reference


def test_requests_evict_the_prefix_cache_when_they_need_the_room(
    stub: Stub, tiny_dir: Path
) -> None:
    epoch = _up(stub, tiny_dir, prefix=True, num_blocks=16)
    fills = [[700 + i * 150 + j for j in range(112)] for i in range(3)]
    for i, prompt in enumerate(fills):
        _one(stub, epoch, f"fill{i}", prompt, max_tokens=2)
    kv = stub.CheckHealth(pb.CheckHealthRequest()).kv
    assert kv.used_blocks == 0 and 7 <= kv.prefix_cache_blocks <= 16
    # Least recently used first: the newest prompt is still cached (all but its last
    # token: 6 whole blocks and 15 tokens of the 7th), the oldest is not.
    assert _one(stub, epoch, "again2", fills[2], max_tokens=1)[1] == 111
    assert _one(stub, epoch, "again0", fills[0], max_tokens=1)[1] == 0
    big = [900 + j for j in range(200)]
    tokens, cached, _ = _one(stub, epoch, "big", big, max_tokens=4)
    assert cached == 0 and len(tokens) == 4
    kv = stub.CheckHealth(pb.CheckHealthRequest()).kv
    assert kv.used_blocks == 0 and 0 < kv.prefix_cache_blocks <= 16
    with pytest.raises(grpc.RpcError) as info:
        _one(stub, epoch, "too-big", [900 + j for j in range(300)], max_tokens=1)
    assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_request_leaving_a_full_budget_keeps_its_blocks_in_the_cache(
    stub: Stub, tiny_dir: Path
) -> None:
    """Finished or preempted, a request's whole blocks go to the prefix cache even when
    it held most of the budget: its own blocks are free once it leaves."""
    epoch = _up(stub, tiny_dir, prefix=True, num_blocks=8)
    prompt = [300 + j for j in range(80)]  # 5 blocks of 16 in a budget of 8
    reference, _, _ = _one(stub, epoch, "first", prompt, max_tokens=4)
    kv = stub.CheckHealth(pb.CheckHealthRequest()).kv
    assert (kv.used_blocks, kv.prefix_cache_blocks) == (0, 5)  # 83 tokens computed
    # Its own 5 blocks and 3 of the 5 cached ones fill the budget of 8: 48 tokens hit.
    assert _one(stub, epoch, "again", prompt, max_tokens=4)[:2] == (reference, 48)
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    kv_after: list[pb.KVUsage] = []
    first, resumed = _preempted_and_resumed(stub, epoch, prompt, greedy(4), kv_after)
    assert (kv_after[0].used_blocks, kv_after[0].prefix_cache_blocks) == (0, 5)
    # Its 6 blocks (81 tokens) leave room for 2 of the 5 cached: a hit copies them.
    assert resumed.num_cached_prompt_tokens == 32
    assert [*first.sampled_token_ids, *resumed.sampled_token_ids] == reference[:2]
