"""A request's precomputed stop checks agree with its full stopping rules."""

from __future__ import annotations

import itertools

import pytest

from mlx_worker_svc.core.domain import FinishReason, Origin, SamplingParams
from mlx_worker_svc.engine.sampling import RequestSampler
from mlx_worker_svc.engine.sequence import Sequence

EOS = frozenset({2})
CONTEXT = 12
PROMPT = (5, 6, 7)


def start(params: SamplingParams, prompt: tuple[int, ...] = PROMPT) -> Sequence:
    sampler = RequestSampler(params, eos_ids=EOS, vocab_size=16)
    return Sequence.start((Origin.EXECUTE, "r"), prompt, params, sampler, max_context=CONTEXT)


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)  # type: ignore[arg-type]
    for max_tokens, extra in itertools.product(
        [None, 1, 4, 20],
        [
            {},
            {"ignore_eos": True},
            {"stop_token_ids": (3, 9)},
            {"min_tokens": 3, "stop_token_ids": (3,)},
            {"min_tokens": 2, "ignore_eos": True, "stop_token_ids": (2,)},
        ],
    )
]


@pytest.mark.parametrize("prompt", [PROMPT, (5,) * 9])  # the second meets the context
@pytest.mark.parametrize("params", PARAMS)
def test_the_quick_checks_never_miss_a_stop(
    params: SamplingParams, prompt: tuple[int, ...]
) -> None:
    # Every token sequence over a few ids: whenever the full rules end the
    # request, the quick check says it may; the last-token forecast holds
    # exactly when a length limit ends the next token.
    for output in itertools.product([1, 2, 3, 9], repeat=4):
        seq = start(params, prompt)
        for token in output:
            ending_next = seq.at_last_token()
            seq.tokens.append(token)
            reason = seq.finish_reason(EOS, CONTEXT)
            if reason is not None:
                assert seq.may_finish(), (params, seq.tokens, reason)
            length_reason = reason in (FinishReason.LENGTH, FinishReason.CONTEXT_LENGTH)
            if ending_next:
                assert reason is not None
            if length_reason:
                assert ending_next
            if reason is not None:
                break


def test_the_limits_are_what_they_say() -> None:
    seq = start(SamplingParams(max_tokens=4, stop_token_ids=(3,)))
    assert seq.stops == {2, 3}
    assert seq.length_limit == len(PROMPT) + 4
    assert start(SamplingParams(max_tokens=100)).length_limit == CONTEXT
    assert start(SamplingParams(ignore_eos=True)).stops == frozenset()
    assert start(SamplingParams()).tokens == list(PROMPT)
