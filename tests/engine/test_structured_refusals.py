"""Structured outputs the worker refuses or ends early: a spec only the empty text
matches, bad specs, bad continuations, and specs past the grammar engine's limits
(each refused step changes nothing; a request past a limit fails alone).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from driver import bring_up, code_of, details_of, epoch_of, live_server, wait_until_idle
from structured_driver import (
    CHOICE_PAST_LIMIT,
    SCHEMA_TEXTS,
    constrained,
    failing_beside,
    random_prompts,
    run_requests,
)

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def shared_stub(tiny_dir: Path) -> Iterator[Stub]:
    """One worker for the tests that only get refusals (a refused step changes nothing)."""
    with live_server() as (_, stub):
        bring_up(stub, tiny_dir)
        yield stub


EMPTY_ONLY = [{"regex": "(?:)"}, {"lark_grammar": 'start: ""'}]


@pytest.mark.parametrize("spec", EMPTY_ONLY, ids=["regex", "lark"])
@pytest.mark.parametrize("min_tokens", [0, 3])
def test_a_spec_only_the_empty_text_matches_ends_with_eos(
    shared_stub: Stub, spec: dict[str, Any], min_tokens: int
) -> None:
    """Its one token is EOS, FINISH_REASON_EOS, even before min_tokens: the grammar
    decides where the output ends (min_tokens once masked the only token it allowed,
    and the step failed as if the spec were past the engine's limits)."""
    stub = shared_stub
    eos = list(stub.GetInfo(pb.GetInfoRequest()).model.eos_token_ids)
    params = constrained(8, **spec)
    params.min_tokens = min_tokens
    messages = list(stub.Generate(pb.GenerateRequest(prompt="x", sampling_params=params)))
    assert [t for m in messages for t in m.token_ids] == eos[:1]
    assert messages[-1].finish_reason == pb.FINISH_REASON_EOS
    assert "".join(m.text for m in messages) == ""
    step = pb.ExecuteRequest(
        worker_epoch=epoch_of(stub),
        new_requests=[pb.NewRequest(req_id="e", prompt_token_ids=[5, 6], sampling_params=params)],
        num_scheduled_tokens={"e": 2},
    )
    (out,) = stub.Execute(step).outputs
    assert list(out.sampled_token_ids) == eos[:1]
    assert out.finish_reason == pb.FINISH_REASON_EOS


def test_min_tokens_holds_eos_back_where_the_grammar_allows_more(tiny_stub: Stub) -> None:
    """EOS, biased to win wherever it may, comes only after min_tokens tokens."""
    eos = int(tiny_stub.GetInfo(pb.GetInfoRequest()).model.eos_token_ids[0])
    for min_tokens in (0, 1, 4):
        params = constrained(12, regex="[a-z ]*")
        params.min_tokens = min_tokens
        params.logit_bias[eos] = 1000.0
        messages = list(tiny_stub.Generate(pb.GenerateRequest(prompt="x", sampling_params=params)))
        tokens = [t for m in messages for t in m.token_ids]
        assert len(tokens) == min_tokens + 1 and tokens[-1] == eos, tokens
        assert eos not in tokens[:-1]
        assert messages[-1].finish_reason == pb.FINISH_REASON_EOS


BAD_SPECS = [
    ({"json_schema": "{not json"}, "structured_outputs.json_schema"),
    ({"json_schema": '{"type": "array", "uniqueItems": true}'}, "uniqueItems"),
    ({"json_schema": '{"type": "string", "minLength": 3, "maxLength": 2}'}, "minLength"),
    ({"json_schema": '{"type": "strnig"}'}, "strnig"),
    # Integers a double cannot hold: the engine would round them (2^53 + 1 to 2^53).
    ({"json_schema": '{"const": 9007199254740993}'}, "const holds 9007199254740993, past 2^53"),
    (
        {
            "json_schema": '{"type": "object", "properties": '
            '{"n": {"enum": [1, -18446744073709551616]}}}'
        },
        "properties.n.enum holds -18446744073709551616, past 2^53",
    ),
    (
        {"json_schema": '{"type": "integer", "minimum": 9007199254740993}'},
        "minimum holds 9007199254740993",
    ),
    # Written with a fraction it is rounded as it is read: refused from 2^53 on.
    ({"json_schema": '{"const": 9007199254740993.0}'}, "const holds 9007199254740992.0"),
    ({"regex": "a["}, "structured_outputs.regex"),
    ({"lark_grammar": "start: foo"}, "structured_outputs.lark_grammar"),
    ({"gbnf_grammar": "root ::= foo"}, "structured_outputs.gbnf_grammar"),
    # Lark's start rule in GBNF (the engine took it for Lark and quoted a parse error).
    ({"gbnf_grammar": 'start ::= "a"'}, "gbnf_grammar: no 'root' rule (GBNF's start rule"),
    ({"choice": pb.StructuredChoice()}, "structured_outputs.choice.choices is empty"),
    ({"json_schema": "false"}, "json_schema is the schema false: no JSON value matches it"),
    ({"json_schema": "[1, 2]"}, "json_schema: a JSON Schema is an object (or true), got an array"),
    (
        {"json_schema": '{"oneOf": [{"type": "integer"}, {"type": "number"}]}'},
        "json_schema: oneOf is taken only where its branches cannot both match, and these "
        "may: use anyOf",
    ),
    ({"json_object": False}, "structured_outputs.json_object must be true"),
    ({}, "structured_outputs: set one of"),
    ({"regex": "a+", "disable_any_whitespace": True}, "disable_any_whitespace"),
    # Specs no text matches: their first mask has no token, not even EOS.
    ({"regex": r"[^\s\S]"}, "structured_outputs.regex: no text matches this spec"),
    ({"lark_grammar": 'start: start "a"'}, "lark_grammar: no text matches this spec"),
    (
        {"json_schema": '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}'},
        "json_schema: no text matches this spec",
    ),
]


@pytest.mark.parametrize(("spec", "named"), BAD_SPECS, ids=[n for _, n in BAD_SPECS])
def test_a_bad_spec_rejects_the_whole_step(
    shared_stub: Stub, spec: dict[str, Any], named: str
) -> None:
    tiny_stub = shared_stub
    epoch = epoch_of(tiny_stub)
    good = constrained(8, regex="[a-z]+")
    step = pb.ExecuteRequest(
        worker_epoch=epoch,
        new_requests=[
            pb.NewRequest(req_id="good", prompt_token_ids=[1, 2], sampling_params=good),
            pb.NewRequest(
                req_id="bad", prompt_token_ids=[1, 2], sampling_params=constrained(8, **spec)
            ),
        ],
        num_scheduled_tokens={"good": 2, "bad": 2},
    )
    with pytest.raises(grpc.RpcError) as caught:
        tiny_stub.Execute(step)
    assert code_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert "new_requests[1]" in details_of(caught.value) and named in details_of(caught.value)
    assert wait_until_idle(tiny_stub, 10).num_running_requests == 0
    with pytest.raises(grpc.RpcError) as generate:
        list(
            tiny_stub.Generate(
                pb.GenerateRequest(prompt="x", sampling_params=constrained(8, **spec))
            )
        )
    assert code_of(generate.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert named in details_of(generate.value)


def test_ignore_eos_is_refused_with_a_spec(shared_stub: Stub) -> None:
    tiny_stub = shared_stub
    params = constrained(8, regex="[a-z]+")
    params.ignore_eos = True
    step = pb.ExecuteRequest(
        worker_epoch=epoch_of(tiny_stub),
        new_requests=[pb.NewRequest(req_id="a", prompt_token_ids=[1], sampling_params=params)],
        num_scheduled_tokens={"a": 1},
    )
    with pytest.raises(grpc.RpcError) as caught:
        tiny_stub.Execute(step)
    assert code_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.ignore_eos cannot be combined" in details_of(caught.value)


def test_a_continuation_elsewhere_keeps_the_grammar(tiny_stub: Stub) -> None:
    epoch = epoch_of(tiny_stub)
    prompt = random_prompts(1, seed=8)[0]
    spec: dict[str, Any] = {"json_schema": SCHEMA_TEXTS[6], "disable_any_whitespace": True}
    [whole] = run_requests(tiny_stub, epoch, [(prompt, constrained(MAX_TOKENS, **spec))])
    [head] = run_requests(tiny_stub, epoch, [(prompt, constrained(5, **spec))])
    assert head.tokens == whole.tokens[:5]
    # As a fleet continues a request after a failover: prompt + output so far.
    step = pb.ExecuteRequest(
        worker_epoch=epoch,
        new_requests=[
            pb.NewRequest(
                req_id="rest",
                prompt_token_ids=prompt + head.tokens,
                sampling_params=constrained(MAX_TOKENS, **spec),
                num_generated_tokens=len(head.tokens),
            )
        ],
        num_scheduled_tokens={"rest": len(prompt) + len(head.tokens)},
        num_decode_steps=64,
    )
    [rest] = tiny_stub.Execute(step).outputs
    assert rest.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE
    assert head.tokens + list(rest.sampled_token_ids) == whole.tokens


@pytest.mark.parametrize(
    ("generated", "named"), [(4, "must leave at least one"), (2, "not a start its")]
)
def test_a_bad_continuation_is_refused(shared_stub: Stub, generated: int, named: str) -> None:
    tiny_stub = shared_stub
    params = constrained(8, regex="[0-9]+")
    step = pb.ExecuteRequest(
        worker_epoch=epoch_of(tiny_stub),
        new_requests=[
            pb.NewRequest(
                req_id="c",
                prompt_token_ids=[1000, 1001, 1002, 1003],
                sampling_params=params,
                num_generated_tokens=generated,
            )
        ],
        num_scheduled_tokens={"c": 4},
    )
    with pytest.raises(grpc.RpcError) as caught:
        tiny_stub.Execute(step)
    assert code_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert "new_requests[0] (req_id 'c').num_generated_tokens" in details_of(caught.value)
    assert named in details_of(caught.value)


# Past llguidance's parser limits only on a token: CHOICE_PAST_LIMIT, and a regex
# whose lexer needs too many expressions.
REGEX_PAST_LIMIT: dict[str, Any] = {"regex": "(x{1000}){1021}"}
LIMIT = "the grammar engine (llguidance) reached one of its limits on this spec: "


def test_a_spec_past_the_engines_limits_fails_its_request_alone(shared_stub: Stub) -> None:
    """A limit reached while a request runs is INVALID_ARGUMENT naming the request and
    the field, never INTERNAL, never an EOS-only text the spec does not match; the step
    is undone, and the same spec sent again fails the same way (its cached matcher,
    which may share the exhausted state, is dropped)."""
    stub = shared_stub
    epoch = epoch_of(stub)
    free = pb.SamplingParams(temperature=0, max_tokens=2)
    step = pb.ExecuteRequest(
        worker_epoch=epoch,
        new_requests=[
            pb.NewRequest(req_id="free", prompt_token_ids=[5, 6], sampling_params=free),
            pb.NewRequest(
                req_id="bad",
                prompt_token_ids=[5, 6],
                sampling_params=constrained(8, **CHOICE_PAST_LIMIT),
            ),
        ],
        num_scheduled_tokens={"free": 2, "bad": 2},
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.Execute(step)
    assert code_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(caught.value).startswith(
        f"req_id 'bad': sampling_params.structured_outputs.choice: {LIMIT}Parser Error: "
        "Current row has 2002 items; max is 2000"
    )
    assert wait_until_idle(stub, 10).num_running_requests == 0  # nothing was applied
    # As the proto says: finish the request (new in the failed step, so never held: no
    # NOT_FOUND) and schedule the others again.
    again = pb.ExecuteRequest(
        worker_epoch=epoch,
        new_requests=[step.new_requests[0]],
        num_scheduled_tokens={"free": 2},
        finished_req_ids=["bad"],
    )
    assert stub.Execute(again).outputs[0].req_id == "free"
    stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, finished_req_ids=["free"]))
    # A request that ran a step (a prompt chunk) before it reached the limit: the step
    # that reaches it is undone, and the request stays where it was until freed.
    params = constrained(8, **CHOICE_PAST_LIMIT)
    chunk = pb.ExecuteRequest(
        worker_epoch=epoch,
        new_requests=[
            pb.NewRequest(req_id="late", prompt_token_ids=[5, 6, 7, 8], sampling_params=params)
        ],
        num_scheduled_tokens={"late": 2},
    )
    assert stub.Execute(chunk).outputs[0].num_computed_tokens == 2
    rest = pb.ExecuteRequest(
        worker_epoch=epoch,
        cached_requests=[pb.CachedRequest(req_id="late", num_computed_tokens=2)],
        num_scheduled_tokens={"late": 2},
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.Execute(rest)
    assert code_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(caught.value).startswith(
        "req_id 'late': sampling_params.structured_outputs.choice: "
    )
    assert stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 1
    stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, finished_req_ids=["late"]))
    assert wait_until_idle(stub, 10).num_running_requests == 0
    for _ in range(2):  # Generate, twice: the second finds no poisoned matcher
        request = pb.GenerateRequest(prompt="x", sampling_params=constrained(8, **REGEX_PAST_LIMIT))
        with pytest.raises(grpc.RpcError) as generate:
            list(stub.Generate(request))
        assert code_of(generate.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert details_of(generate.value) == (
            f"sampling_params.structured_outputs.regex: {LIMIT}lexer error: too many "
            "expressions constructed; simplify the spec (fewer alternatives, shorter repetitions)"
        )


def test_a_failed_step_leaves_the_kv_it_did_not_write_and_caches_nothing(
    shared_stub: Stub,
) -> None:
    """A decode row the failed step did not schedule keeps its KV: its logprobs are the
    very ones of a run without the failure (its KV was rebuilt, which with quantized KV
    changed its tokens); and the prompt blocks the step put in the prefix cache are
    taken out again, so a request of it sent again finds none."""
    clean = failing_beside(shared_stub, fail=False)
    failed = failing_beside(shared_stub, fail=True)
    assert failed == clean
    assert failed[1] == 0


def test_a_generate_request_past_a_limit_does_not_fail_the_step_it_rides(tiny_dir: Path) -> None:
    """A Generate request riding along a scheduler's step (both queued while the engine
    was busy) fails alone; the scheduler's step runs."""
    with live_server() as (server, stub):
        bring_up(stub, tiny_dir)
        gate = threading.Event()
        blocker = server.worker.core.engine.submit(gate.wait)  # occupies the engine thread
        request = pb.GenerateRequest(
            prompt="x", sampling_params=constrained(8, **CHOICE_PAST_LIMIT)
        )
        with ThreadPoolExecutor(2) as pool:
            generate = pool.submit(lambda: list(stub.Generate(request)))
            engine = server.worker.core.engine
            deadline = time.monotonic() + 30
            while engine.queued < 1:  # the Generate start is queued first
                assert time.monotonic() < deadline
                time.sleep(0.01)
            params = pb.SamplingParams(temperature=0, max_tokens=1)
            step = pb.ExecuteRequest(
                worker_epoch=epoch_of(stub),
                new_requests=[
                    pb.NewRequest(req_id="s", prompt_token_ids=[5, 6], sampling_params=params)
                ],
                num_scheduled_tokens={"s": 2},
            )
            execute = pool.submit(stub.Execute, step)
            while engine.queued < 2:  # then the scheduler's step
                assert time.monotonic() < deadline
                time.sleep(0.01)
            gate.set()
            blocker.result(timeout=10)
            output = execute.result(timeout=30).outputs[0]
            assert output.req_id == "s" and len(output.sampled_token_ids) == 1
            with pytest.raises(grpc.RpcError) as caught:
                generate.result(timeout=30)
        assert code_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert details_of(caught.value).startswith(
            f"sampling_params.structured_outputs.choice: {LIMIT}"
        )
        assert wait_until_idle(stub, 10).num_running_requests == 0


def test_a_dead_end_deeper_in_the_spec_fails_saying_so(tiny_stub: Stub) -> None:
    """A required property whose schema only refers to itself: the first mask has '{'
    and the key, then no text continues. The request fails there, saying it is a dead
    end of the spec, not one of the engine's limits."""
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/d"}},
        "required": ["a"],
        "$defs": {"d": {"$ref": "#/$defs/d"}},
    }
    params = constrained(50, json_schema=json.dumps(schema), disable_any_whitespace=True)
    with pytest.raises(grpc.RpcError) as failed:
        list(tiny_stub.Generate(pb.GenerateRequest(prompt="x", sampling_params=params)))
    assert code_of(failed.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(failed.value).startswith(
        "sampling_params.structured_outputs.json_schema: the output reached a point no "
        "text continues under this spec"
    ), details_of(failed.value)
    assert wait_until_idle(tiny_stub, 10).num_running_requests == 0
