"""Sampling on the tiny model: seeds, logprobs, prompt logprobs, penalties, bias."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from driver import drive, epoch_of
from mlx_lm import load

from mlx_worker_svc.client.execute_loop import run_prompts
from mlx_worker_svc.core.domain import SamplingParams
from mlx_worker_svc.engine.sampling import RequestSampler
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
PROMPTS = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 20, [42], [9, 8, 7, 6, 5, 4, 3, 2]]


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> object:
    loaded, _ = load(str(tiny_dir))
    return loaded


def _log_softmax(model: object, tokens: list[int]) -> np.ndarray:
    """Single-sequence reference: log-softmax of every position's logits."""
    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)  # type: ignore[operator]
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(out)


def _run(
    stub: Stub, prompts: list[list[int]], params: list[pb.SamplingParams], chunk: int | None = None
) -> list[list[pb.RequestOutput]]:
    """Drives the prompts together; returns every output message per request, in order."""
    ids = [f"s{i}" for i in range(len(prompts))]
    return run_prompts(
        stub.Execute, epoch_of(stub), prompts, params, req_ids=ids, chunk=chunk
    ).outputs


def _tokens(messages: list[pb.RequestOutput]) -> list[int]:
    return [t for m in messages for t in m.sampled_token_ids]


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_batch(tiny_stub: Stub) -> None:
    seeded = pb.SamplingParams(
        temperature=0.8, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True
    )
    alone = _tokens(_run(tiny_stub, [PROMPTS[0]], [seeded])[0])
    others = [
        pb.SamplingParams(temperature=t, seed=s, max_tokens=16 - i, ignore_eos=True, top_k=k)
        for i, (t, s, k) in enumerate(
            [
                (1.0, 1, 0),
                (0.5, 2, 50),
                (1.3, 3, 0),
                (0.0, 4, 0),
                (0.9, 5, 10),
                (1.0, 6, 0),
                (0.7, 7, 0),
            ]
        )
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(1, 8)]
    batch = _run(
        tiny_stub, [*prompts[:3], PROMPTS[0], *prompts[3:]], [*others[:3], seeded, *others[3:]]
    )
    assert _tokens(batch[3]) == alone
    again = _tokens(_run(tiny_stub, [PROMPTS[0]], [seeded])[0])
    assert again == alone
    other_seed = pb.SamplingParams(
        temperature=0.8, top_p=0.95, seed=99, max_tokens=16, ignore_eos=True
    )
    assert _tokens(_run(tiny_stub, [PROMPTS[0]], [other_seed])[0]) != alone


def _continued(
    stub: Stub, prompt: list[int], before: list[int], params: pb.SamplingParams
) -> list[int]:
    """What a request continued elsewhere samples: prompt + its tokens so far, the
    latter named as output (NewRequest.num_generated_tokens), as the fleet fails over."""
    epoch, whole = epoch_of(stub), prompt + before
    new = pb.NewRequest(req_id="cont", prompt_token_ids=whole, num_generated_tokens=len(before))
    new.sampling_params.CopyFrom(params)
    step = pb.ExecuteRequest(worker_epoch=epoch, new_requests=[new])
    step.num_scheduled_tokens["cont"] = len(whole)
    out = stub.Execute(step).outputs[0]
    tokens = list(out.sampled_token_ids)
    while not out.finish_reason:
        cached = pb.CachedRequest(req_id="cont", num_computed_tokens=len(whole) + len(tokens) - 1)
        step = pb.ExecuteRequest(worker_epoch=epoch, cached_requests=[cached])
        step.num_scheduled_tokens["cont"] = 1
        out = stub.Execute(step).outputs[0]
        tokens += out.sampled_token_ids
    stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, finished_req_ids=["cont"]))
    return tokens


PENALISED: dict[str, Any] = {"frequency_penalty": 2.0, "presence_penalty": 0.5}


@pytest.mark.parametrize(
    ("params", "prompt"),
    [
        (pb.SamplingParams(temperature=1.0, seed=77), PROMPTS[1]),
        (pb.SamplingParams(temperature=0.0, **PENALISED), PROMPTS[3]),
        (pb.SamplingParams(temperature=0.9, seed=5, **PENALISED), PROMPTS[1]),
    ],
    ids=["seeded", "greedy-penalised", "seeded-penalised"],
)
def test_a_request_continued_elsewhere_samples_what_it_would_have(
    tiny_stub: Stub, params: pb.SamplingParams, prompt: list[int]
) -> None:
    """Continued from its output so far (a failover), a request samples the tokens it
    would have sampled: a seed's key goes on from the tokens sampled before, and the
    presence and frequency penalties count those tokens as output."""
    whole = pb.SamplingParams(max_tokens=40, ignore_eos=True)
    whole.MergeFrom(params)
    alone = _tokens(_run(tiny_stub, [prompt], [whole])[0])
    for cut in (1, 9, 25):
        rest = pb.SamplingParams()
        rest.CopyFrom(whole)
        rest.max_tokens = 40 - cut
        assert _continued(tiny_stub, prompt, alone[:cut], rest) == alone[cut:], cut


def test_every_step_logprobs_match_a_single_sequence_reference(
    tiny_stub: Stub, model: object
) -> None:
    params = pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=20)
    runs = _run(tiny_stub, PROMPTS[:4], [params] * 4, chunk=3)
    for prompt, messages in zip(PROMPTS[:4], runs, strict=True):
        tokens = _tokens(messages)
        infos = [lp for m in messages for lp in m.logprobs]
        assert len(infos) == len(tokens) == 12
        reference = _log_softmax(model, prompt + tokens)
        for k, (token, info) in enumerate(zip(tokens, infos, strict=True)):
            row = reference[len(prompt) - 1 + k]
            assert info.token_id == token and info.rank == 1
            assert abs(info.logprob - row[token]) < 1e-4
            top_ids = [t.token_id for t in info.top]
            assert len(top_ids) == 20
            np.testing.assert_allclose([t.logprob for t in info.top], row[top_ids], atol=1e-4)
            assert sorted(row, reverse=True)[19] <= info.top[-1].logprob + 1e-4


def test_prompt_logprobs_score_every_prompt_token_once(tiny_stub: Stub, model: object) -> None:
    prompt = list(range(300, 317))
    params = pb.SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=5)
    messages = _run(tiny_stub, [prompt], [params], chunk=4)[0]
    scored = [lp for m in messages for lp in m.prompt_logprobs]
    assert [s.token_id for s in scored] == prompt[1:]
    reference = _log_softmax(model, prompt)
    for i, info in enumerate(scored):
        assert abs(info.logprob - reference[i][prompt[i + 1]]) < 1e-4
        assert info.rank == 1 + int((reference[i] > reference[i][prompt[i + 1]]).sum())
        assert len(info.top) == 5


def _reference_penalised(
    model: object,
    prompt: list[int],
    n: int,
    *,
    rep: float,
    pres: float,
    freq: float,
    bias: dict[int, float],
) -> list[int]:
    """Greedy with vLLM's penalty semantics, computed independently with numpy."""
    tokens = list(prompt)
    for _ in range(n):
        logits = np.array(model(mx.array(tokens)[None])[0, -1].astype(mx.float32))  # type: ignore[operator]
        for token, value in bias.items():
            logits[token] += value
        seen = sorted(set(tokens))
        logits[seen] = np.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
        counts = np.bincount(tokens[len(prompt) :], minlength=logits.shape[0]).astype(np.float32)
        logits -= freq * counts + pres * (counts > 0)
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt) :]


@pytest.mark.parametrize(
    ("rep", "pres", "freq"), [(1.3, 0.0, 0.0), (1.0, 1.5, 0.0), (1.0, 0.0, 2.0), (1.2, 0.5, 0.5)]
)
def test_penalties_and_bias_follow_vllm_semantics(
    tiny_stub: Stub, model: object, rep: float, pres: float, freq: float
) -> None:
    prompt = [7, 7, 7, 8, 9]
    bias = {11: 3.0, 12: -2.0}
    params = pb.SamplingParams(
        temperature=0.0,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=rep,
        presence_penalty=pres,
        frequency_penalty=freq,
        logit_bias=bias,
    )
    got = _tokens(_run(tiny_stub, [prompt], [params])[0])
    assert got == _reference_penalised(model, prompt, 10, rep=rep, pres=pres, freq=freq, bias=bias)


def test_top_k_one_is_greedy_and_samples_stay_in_the_vocabulary(tiny_stub: Stub) -> None:
    epoch = epoch_of(tiny_stub)
    greedy = drive(
        tiny_stub,
        epoch,
        [PROMPTS[1]],
        max_tokens=8,
        params=pb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )[0]
    top1 = _tokens(
        _run(
            tiny_stub,
            [PROMPTS[1]],
            [pb.SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True)],
        )[0]
    )
    assert top1 == greedy
    wild = _tokens(
        _run(
            tiny_stub,
            [PROMPTS[1]],
            [pb.SamplingParams(temperature=2.0, min_p=0.01, max_tokens=8, ignore_eos=True)],
        )[0]
    )
    assert len(wild) == 8 and all(0 <= t < 49152 for t in wild)


# ------------------------------------------------- the sampler alone (vLLM v1's)
def _sampler(vocab: int, **params: object) -> RequestSampler:
    return RequestSampler(SamplingParams(**params), eos_ids=frozenset(), vocab_size=vocab)  # type: ignore[arg-type]


def test_a_temperature_below_vllms_epsilon_is_greedy() -> None:
    logits = mx.array([1.0, 30.0, 29.5, -4.0])
    for temperature in (1e-6, 1e-30, 1e-38, 1e-44):  # 1/T overflowed float32 from ~1e-37
        sampler = _sampler(4, temperature=temperature, seed=3)
        assert sampler.params.greedy
        assert int(sampler.choose(sampler.process(logits, [], 0))) == 1, temperature
    # A huge (finite) bias at a small temperature samples the biased token, never NaN's pick.
    sampler = _sampler(4, temperature=0.01, seed=3, logit_bias={3: 1e37})
    assert {int(sampler.choose(sampler.process(logits, [], 0))) for _ in range(8)} == {3}


def test_a_penalty_that_overflows_a_logit_keeps_its_token_first() -> None:
    # A repetition penalty below 1 divides a huge (finite) biased logit past float32:
    # +inf made inf - inf NaN, and every seed sampled token 0, which nothing raised.
    logits = mx.array([1.0, 2.0, 3.0, 0.5])
    for params in (
        {"repetition_penalty": 0.5, "logit_bias": {2: 3e38}},
        {"repetition_penalty": 1e-39},  # alone: 3 / 1e-39 overflows
    ):
        for seed in range(8):
            sampler = _sampler(4, temperature=1.0, seed=seed, **params)
            assert int(sampler.choose(sampler.process(logits, [2], 1))) == 2, (params, seed)


def test_bias_and_penalties_apply_in_float32_on_a_bfloat16_model() -> None:
    # Two bfloat16 logits tie at 18.5, where bfloat16 steps by 0.125: +0.05 in bfloat16
    # rounds away; vLLM adds it in float32, and it decides the token.
    tie = mx.array([18.5, 18.5, 3.0], dtype=mx.bfloat16)
    for params, want in (
        ({"logit_bias": {1: 0.05}}, 1),
        ({"logit_bias": {0: -0.05}}, 1),
        ({"presence_penalty": 0.05}, 1),  # token 0 was output once
    ):
        sampler = _sampler(3, temperature=0.0, **params)
        assert int(sampler.choose(sampler.process(tie, [2, 0], 1))) == want, params


def test_min_p_comes_before_top_p_as_in_vllm_v1() -> None:
    # p = [.4, .3, .1, .1, .1]: min_p .3 keeps tokens 0 and 1 (renormalised .57 / .43),
    # then top_p .5 keeps token 0 alone. The old order (top_p first) also kept token 1.
    logits = mx.log(mx.array([0.4, 0.3, 0.1, 0.1, 0.1]))
    drawn = set()
    for seed in range(40):
        sampler = _sampler(5, temperature=1.0, top_p=0.5, min_p=0.3, seed=seed)
        drawn.add(int(sampler.choose(sampler.process(logits, [], 0))))
    assert drawn == {0}
