"""Structured outputs enforced by the worker (SamplingParams.structured_outputs).

The tiny random model's free output is noise, the hardest case: every
constrained answer must still parse and validate, end with
GRAMMAR_COMPLETE, and leave the free rows of its batch as they were.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from driver import epoch_of, wait_until_idle
from structured_driver import (
    CHOICES,
    REGEXES,
    SCHEMA_TEXTS,
    SCHEMAS,
    Finished,
    constrained,
    random_prompts,
    run_requests,
)

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
MAX_TOKENS = 160


def _text(stub: Stub, tokens: list[int]) -> str:
    request = pb.DetokenizeRequest(token_ids=tokens, skip_special_tokens=True)
    return str(stub.Detokenize(request).text)


def _completed(stub: Stub, results: list[Finished]) -> list[str]:
    for r in results:
        assert r.reason == pb.FINISH_REASON_GRAMMAR_COMPLETE, (r.reason, _text(stub, r.tokens))
    return [_text(stub, r.tokens) for r in results]


def test_200_requests_over_20_schemas_all_validate(tiny_stub: Stub) -> None:
    prompts = random_prompts(200, seed=1)
    requests = []
    for i, prompt in enumerate(prompts):
        # Greedy and seeded sampling. Compact JSON: free whitespace lets noise pad
        # forever (a legitimate LENGTH).
        sampled = i % 2 == 1
        params = constrained(
            MAX_TOKENS,
            temperature=1.0 if sampled else 0.0,
            seed=i if sampled else None,
            json_schema=SCHEMA_TEXTS[i % len(SCHEMAS)],
            disable_any_whitespace=True,
        )
        requests.append((prompt, params))
    texts = _completed(tiny_stub, run_requests(tiny_stub, epoch_of(tiny_stub), requests))
    for i, text in enumerate(texts):
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
    assert len(set(texts)) > 40  # the noise really varies the answers
    assert wait_until_idle(tiny_stub, 10).kv.used_blocks == 0


def test_regex_and_choice_outputs_match(tiny_stub: Stub) -> None:
    prompts = random_prompts(40, seed=2)
    requests = [
        (p, constrained(MAX_TOKENS, regex=REGEXES[i % len(REGEXES)])) for i, p in enumerate(prompts)
    ]
    requests += [
        (p, constrained(MAX_TOKENS, choice=pb.StructuredChoice(choices=CHOICES[i % len(CHOICES)])))
        for i, p in enumerate(prompts)
    ]
    texts = _completed(tiny_stub, run_requests(tiny_stub, epoch_of(tiny_stub), requests))
    for i, text in enumerate(texts[:40]):
        assert re.fullmatch(REGEXES[i % len(REGEXES)], text), text
    for i, text in enumerate(texts[40:]):
        assert text in CHOICES[i % len(CHOICES)]


def test_json_object_gives_an_object_or_a_prefix_of_one(tiny_stub: Stub) -> None:
    # Any object: the noise picks free keys and strings, so some run out of tokens.
    requests = [
        (p, constrained(48, json_object=True, disable_any_whitespace=True, seed=i, temperature=1))
        for i, p in enumerate(random_prompts(8, seed=7))
    ]
    for r in run_requests(tiny_stub, epoch_of(tiny_stub), requests):
        text = _text(tiny_stub, r.tokens)
        assert text.startswith("{")
        if r.reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
            assert isinstance(json.loads(text), dict)
        else:
            assert r.reason == pb.FINISH_REASON_LENGTH


def test_the_boolean_schema_true_gives_any_json_value(tiny_stub: Stub) -> None:
    # json_schema "true" is JSON Schema's "anything", as {} (and "false" is refused).
    requests = [
        (
            p,
            constrained(
                48, json_schema=" true", disable_any_whitespace=True, seed=i, temperature=1
            ),
        )
        for i, p in enumerate(random_prompts(8, seed=5))
    ]
    complete = 0
    for r in run_requests(tiny_stub, epoch_of(tiny_stub), requests):
        if r.reason == pb.FINISH_REASON_GRAMMAR_COMPLETE:
            json.loads(_text(tiny_stub, r.tokens))
            complete += 1
        else:
            assert r.reason == pb.FINISH_REASON_LENGTH
    assert complete > 0


def test_annotations_are_accepted_and_shape_nothing(tiny_stub: Stub) -> None:
    """As JSON Schema validation: title, contentEncoding and the other annotations are
    no assertions (worker.proto's StructuredOutputs), so a schema with them gives what
    the same schema without them gives, token for token."""
    annotations = {
        "title": "t",
        "description": "d",
        "examples": ["x"],
        "default": "x",
        "$comment": "c",
        "deprecated": True,
        "readOnly": True,
        "writeOnly": False,
        "contentEncoding": "base64",
        "contentMediaType": "text/plain",
        "contentSchema": {"type": "integer"},
    }
    field: dict[str, Any] = {"type": "string", "maxLength": 6}
    plain = {"type": "object", "properties": {"s": field}}
    annotated = {"type": "object", "properties": {"s": field | annotations}}
    prompts = random_prompts(3, seed=6)
    outputs = [
        [
            r.tokens
            for r in run_requests(
                tiny_stub,
                epoch_of(tiny_stub),
                [
                    (p, constrained(24, json_schema=json.dumps(schema), seed=i, temperature=1))
                    for i, p in enumerate(prompts)
                ],
            )
        ]
        for schema in (plain, annotated)
    ]
    assert outputs[0] == outputs[1] and all(outputs[0])


def test_grammars_in_lark_and_gbnf(tiny_stub: Stub) -> None:
    prompts = random_prompts(6, seed=3)
    lark = 'start: "(" num ("," num)? ("," num)? ")"\nnum: /[0-9]{1,3}/'
    gbnf = 'root ::= "[" item ("," item)? "]"\nitem ::= [a-c] [a-c]?'
    requests = [(p, constrained(MAX_TOKENS, lark_grammar=lark)) for p in prompts[:3]]
    requests += [(p, constrained(MAX_TOKENS, gbnf_grammar=gbnf)) for p in prompts[3:]]
    texts = _completed(tiny_stub, run_requests(tiny_stub, epoch_of(tiny_stub), requests))
    for text in texts[:3]:
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)", text), text
    for text in texts[3:]:
        assert re.fullmatch(r"\[[a-c]{1,2}(,[a-c]{1,2})?\]", text), text


def test_free_rows_keep_their_tokens_beside_constrained_rows(tiny_stub: Stub) -> None:
    epoch = epoch_of(tiny_stub)
    prompts = random_prompts(16, seed=4)
    free = pb.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = run_requests(tiny_stub, epoch, [(p, free) for p in prompts[::2]])
    mixed_requests = [
        (
            p,
            free
            if i % 2 == 0
            else constrained(64, json_schema=SCHEMA_TEXTS[i], disable_any_whitespace=True),
        )
        for i, p in enumerate(prompts)
    ]
    mixed = run_requests(tiny_stub, epoch, mixed_requests)
    assert [r.tokens for r in mixed[::2]] == [r.tokens for r in alone]
    for i, r in enumerate(mixed[1::2]):
        jsonschema.validate(json.loads(_text(tiny_stub, r.tokens)), SCHEMAS[2 * i + 1])


@pytest.mark.parametrize(
    ("how", "options"),
    [
        ("chunked prefill", {"chunk": 3}),
        ("multi-step decode", {"decode_steps": 8}),
        ("preemption and resume", {"preempt_at": (4, 1)}),
    ],
)
def test_same_tokens_through_chunks_multi_step_and_preemption(
    tiny_stub: Stub, how: str, options: dict[str, object]
) -> None:
    epoch = epoch_of(tiny_stub)
    prompts = random_prompts(4, seed=5)
    requests = [
        (
            p,
            constrained(
                MAX_TOKENS,
                json_schema=SCHEMA_TEXTS[i + 4],
                seed=i,
                temperature=0.8,
                disable_any_whitespace=True,
            ),
        )
        for i, p in enumerate(prompts)
    ]
    plain = run_requests(tiny_stub, epoch, requests)
    other = run_requests(tiny_stub, epoch, requests, **options)  # type: ignore[arg-type]
    assert [r.tokens for r in other] == [r.tokens for r in plain], how
    for i, text in enumerate(_completed(tiny_stub, other)):
        jsonschema.validate(json.loads(text), SCHEMAS[i + 4])


def test_max_tokens_first_ends_with_length_and_logprobs_are_raw(tiny_stub: Stub) -> None:
    epoch = epoch_of(tiny_stub)
    prompt = random_prompts(1, seed=6)[0]
    short = constrained(3, json_schema=SCHEMA_TEXTS[1], disable_any_whitespace=True)
    short.logprobs = 0
    [cut] = run_requests(tiny_stub, epoch, [(prompt, short)])
    assert cut.reason == pb.FINISH_REASON_LENGTH and len(cut.tokens) == 3
    assert _text(tiny_stub, cut.tokens).startswith('{"name":"')
    free = pb.SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, ignore_eos=True)
    step = pb.ExecuteRequest(
        worker_epoch=epoch,
        new_requests=[
            pb.NewRequest(req_id="c", prompt_token_ids=prompt, sampling_params=short),
            pb.NewRequest(req_id="f", prompt_token_ids=prompt, sampling_params=free),
        ],
        num_scheduled_tokens={"c": len(prompt), "f": len(prompt)},
    )
    c, f = tiny_stub.Execute(step).outputs
    # The constrained row's logprob is the raw model's: below the free argmax's.
    assert c.sampled_token_ids != f.sampled_token_ids
    assert c.logprobs[0].logprob < f.logprobs[0].logprob and c.logprobs[0].rank > 1


def test_generate_honours_the_spec(tiny_stub: Stub) -> None:
    request = pb.GenerateRequest(
        prompt="Give me JSON",
        sampling_params=constrained(
            MAX_TOKENS, json_schema=SCHEMA_TEXTS[5], disable_any_whitespace=True
        ),
    )
    messages = list(tiny_stub.Generate(request))
    assert messages[-1].finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE
    jsonschema.validate(json.loads("".join(m.text for m in messages)), SCHEMAS[5])
