"""ExecuteRequest.grammar_bitmask: a scheduler that runs its own grammar engine.

The test's scheduler compiles the same schemas with llguidance on its side,
sends each step's packed mask (vLLM's layout) and gets exactly the tokens the
worker's own grammar gives; bad masks are refused whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
from driver import bring_up, code_of, details_of, epoch_of, live_server, wait_until_idle
from mlx_lm.tokenizer_utils import load as load_tokenizer
from structured_driver import SCHEMA_TEXTS, SCHEMAS, constrained, run_requests

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
VOCAB = 49152
WORDS = VOCAB // 32
MAX_TOKENS = 160


class GrammarScheduler:
    """The scheduler's side: one llguidance matcher per request, a mask per step."""

    def __init__(self, tiny_dir: Path, eos: list[int]) -> None:
        hf = load_tokenizer(tiny_dir)._tokenizer
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB, eos_token=eos)
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self.fed: dict[str, int] = {}

    def add(self, req_id: str, schema: str) -> None:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False}
        )
        self.matchers[req_id] = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        self.fed[req_id] = 0

    def mask(self, req_id: str, output: list[int]) -> bytes | None:
        """The next token's mask; None once the grammar is complete (the request ends)."""
        matcher = self.matchers[req_id]
        assert matcher.consume_tokens(output[self.fed[req_id] :])
        self.fed[req_id] = len(output)
        if matcher.is_stopped():
            return None
        words = llguidance.numpy.allocate_token_bitmask(1, VOCAB)
        llguidance.numpy.fill_next_token_bitmask(matcher, words)
        return words.astype("<i4").tobytes()


def _prompts(count: int) -> list[list[int]]:
    return [[1000 + 7 * i + j for j in range(3 + i % 5)] for i in range(count)]


def test_scheduler_masks_give_the_workers_own_tokens(tiny_stub: Stub, tiny_dir: Path) -> None:
    epoch = epoch_of(tiny_stub)
    eos = list(tiny_stub.GetInfo(pb.GetInfoRequest()).model.eos_token_ids)
    prompts = _prompts(10)
    schemas = [SCHEMA_TEXTS[i] for i in range(len(prompts))]
    own = run_requests(
        tiny_stub,
        epoch,
        [
            (p, constrained(MAX_TOKENS, json_schema=s, disable_any_whitespace=True))
            for p, s in zip(prompts, schemas, strict=True)
        ],
    )
    scheduler = GrammarScheduler(tiny_dir, eos)
    for i, schema in enumerate(schemas):
        scheduler.add(f"r{i}", schema)
    free = pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    theirs = run_requests(
        tiny_stub, epoch, [(p, free) for p in prompts], bitmask=scheduler.mask, end_on_none=True
    )
    assert [r.tokens for r in theirs] == [r.tokens for r in own]
    for i, r in enumerate(own):
        assert r.reason == pb.FINISH_REASON_GRAMMAR_COMPLETE
        text = tiny_stub.Detokenize(pb.DetokenizeRequest(token_ids=r.tokens)).text
        jsonschema.validate(json.loads(text), SCHEMAS[i])
    assert wait_until_idle(tiny_stub, 10).kv.used_blocks == 0


def test_a_mask_allowing_one_token_gives_that_token(tiny_stub: Stub) -> None:
    words = np.zeros(WORDS, dtype="<u4")
    words[12345 // 32] = 1 << (12345 % 32)
    step = pb.ExecuteRequest(
        worker_epoch=epoch_of(tiny_stub),
        new_requests=[
            pb.NewRequest(
                req_id="a",
                prompt_token_ids=[1, 2, 3],
                sampling_params=pb.SamplingParams(temperature=1.0, max_tokens=4, logprobs=0),
            )
        ],
        num_scheduled_tokens={"a": 3},
        grammar_bitmask={"a": words.tobytes()},
    )
    [out] = tiny_stub.Execute(step).outputs
    assert list(out.sampled_token_ids) == [12345]
    assert out.logprobs[0].logprob < 0  # the raw model's, not the mask's certainty
    # Under min_tokens, EOS (2) allowed beside it is held back: the other token comes.
    words[0] |= np.uint32(1 << 2)
    held_back = pb.SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2)
    step = pb.ExecuteRequest(
        worker_epoch=epoch_of(tiny_stub),
        new_requests=[
            pb.NewRequest(req_id="b", prompt_token_ids=[1, 2], sampling_params=held_back)
        ],
        num_scheduled_tokens={"b": 2},
        grammar_bitmask={"b": words.tobytes()},
    )
    [out] = tiny_stub.Execute(step).outputs
    assert list(out.sampled_token_ids) == [12345]


def _one(
    mask: bytes,
    *,
    params: pb.SamplingParams | None = None,
    scheduled: int = 4,
    mask_for: str = "a",
    num_decode_steps: int = 0,
) -> pb.ExecuteRequest:
    """A step with one new request "a" (4 prompt tokens) and one mask."""
    return pb.ExecuteRequest(
        new_requests=[
            pb.NewRequest(
                req_id="a",
                prompt_token_ids=[1, 2, 3, 4],
                sampling_params=params or pb.SamplingParams(max_tokens=4),
            )
        ],
        num_scheduled_tokens={"a": scheduled},
        grammar_bitmask={mask_for: mask},
        num_decode_steps=num_decode_steps,
    )


ALL = np.full(WORDS, 0xFFFFFFFF, dtype="<u4").tobytes()


def _only(*tokens: int) -> bytes:
    words = np.zeros(WORDS, dtype="<u4")
    for token in tokens:
        words[token // 32] |= np.uint32(1 << (token % 32))
    return words.tobytes()


# A scheduler's grammar that is complete allows only EOS (2); min_tokens holds EOS and
# stop tokens back, so nothing could be sampled (the worker sampled token 0 here).
UNDER_MIN_TOKENS = pb.SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[777])
BAD_MASKS = [
    (_one(ALL[:-4]), "has 6140 bytes"),
    (_one(bytes(len(ALL))), "allows no token"),
    (_one(ALL, num_decode_steps=4), "num_decode_steps must be 0 or 1"),
    (_one(ALL, scheduled=2), "does not sample in this step"),
    (_one(ALL, mask_for="b"), "not scheduled in this step"),
    (_one(ALL, params=constrained(4, regex="[a-z]+")), "has sampling_params.structured_outputs"),
    (_one(_only(2), params=UNDER_MIN_TOKENS), "min_tokens holds back in this step"),
    (_one(_only(2, 777), params=UNDER_MIN_TOKENS), "min_tokens holds back in this step"),
]


@pytest.fixture(scope="module")
def shared_stub(tiny_dir: Path) -> Iterator[Stub]:
    """One worker for the refusals (a refused step changes nothing)."""
    with live_server() as (_, stub):
        bring_up(stub, tiny_dir)
        yield stub


@pytest.mark.parametrize(("step", "named"), BAD_MASKS, ids=[n for _, n in BAD_MASKS])
def test_a_bad_mask_rejects_the_step(
    shared_stub: Stub, step: pb.ExecuteRequest, named: str
) -> None:
    tiny_stub = shared_stub
    step.worker_epoch = epoch_of(tiny_stub)
    with pytest.raises(grpc.RpcError) as caught:
        tiny_stub.Execute(step)
    assert code_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert "grammar_bitmask[" in details_of(caught.value)
    assert named in details_of(caught.value)
    assert wait_until_idle(tiny_stub, 10).num_running_requests == 0
