"""A test scheduler for structured outputs: requests with their own sampling params.

`run_requests` drives Execute over many requests at once (one batch), with
chunked prefill, multi-step decode, a preemption, or a per-step
grammar_bitmask computed by the caller. The JSON schemas, regexes and
choices the structured-output tests and the benchmark share live here, and
`failing_beside`, a run with or without a step failing past the grammar
engine's limits beside decoding rows.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from driver import code_of

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

# (req_id, output so far) -> the packed mask of its next token, or None.
BitmaskFn = Callable[[str, list[int]], bytes | None]


def random_prompts(count: int, seed: int) -> list[list[int]]:
    """`count` prompts of 3 to 11 random token ids, the same for a seed."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randrange(3, 12))] for _ in range(count)]


@dataclass
class Finished:
    tokens: list[int] = field(default_factory=list)
    reason: int = pb.FINISH_REASON_UNSPECIFIED


def run_requests(
    stub: pb_grpc.WorkerServiceStub,
    epoch: int,
    requests: list[tuple[list[int], pb.SamplingParams]],
    *,
    chunk: int | None = None,
    decode_steps: int = 0,
    bitmask: BitmaskFn | None = None,
    preempt_at: tuple[int, int] | None = None,
    end_on_none: bool = False,
) -> list[Finished]:
    """Runs `requests` together to their end; returns each one's tokens and finish reason.

    `bitmask` gives the mask of each sampling request's next token; with
    `end_on_none`, None means its grammar is complete: the scheduler finishes
    it (finished_req_ids) and records GRAMMAR_COMPLETE. `preempt_at` =
    (step, index): that request is preempted in that step and resumed in the next.
    """
    ids = [f"r{i}" for i in range(len(requests))]
    prompts = {rid: p for rid, (p, _) in zip(ids, requests, strict=True)}
    results = {rid: Finished() for rid in ids}
    computed = dict.fromkeys(ids, 0)
    live = set(ids)
    new = [
        pb.NewRequest(req_id=rid, prompt_token_ids=p, sampling_params=s)
        for rid, (p, s) in zip(ids, requests, strict=True)
    ]
    step, resumed = 0, ""
    while live:
        preempted = ""
        if preempt_at is not None and step == preempt_at[0] and ids[preempt_at[1]] in live:
            preempted = ids[preempt_at[1]]
        new_ids = {r.req_id for r in new}
        scheduled, masks, done = {}, {}, []
        for rid in sorted(live - {preempted}):
            remaining = len(prompts[rid]) + len(results[rid].tokens) - computed[rid]
            scheduled[rid] = remaining if chunk is None else min(chunk, remaining)
            if bitmask is None or scheduled[rid] != remaining:
                continue
            data = bitmask(rid, results[rid].tokens)
            if data is not None:
                masks[rid] = data
            elif end_on_none:
                done.append(rid)
                del scheduled[rid]
                results[rid].reason = pb.FINISH_REASON_GRAMMAR_COMPLETE
        live -= set(done)
        cached = [
            pb.CachedRequest(
                req_id=rid,
                num_computed_tokens=computed[rid],
                resumed_from_preemption=rid == resumed,
            )
            for rid in sorted(live - {preempted})
            if rid not in new_ids
        ]
        if not scheduled and not done:
            break
        response = stub.Execute(
            pb.ExecuteRequest(
                step_id=step,
                worker_epoch=epoch,
                new_requests=new,
                cached_requests=cached,
                num_scheduled_tokens=scheduled,
                preempted_req_ids=[preempted] if preempted else [],
                finished_req_ids=done,
                num_decode_steps=decode_steps,
                grammar_bitmask=masks,
            )
        )
        new, resumed = [], preempted
        if preempted:
            computed[preempted] = 0
        step += 1
        for out in response.outputs:
            results[out.req_id].tokens.extend(out.sampled_token_ids)
            computed[out.req_id] = out.num_computed_tokens
            if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                results[out.req_id].reason = out.finish_reason
                live.discard(out.req_id)
    return [results[rid] for rid in ids]


def constrained(
    max_tokens: int, *, temperature: float = 0.0, seed: int | None = None, **spec: Any
) -> pb.SamplingParams:
    """Sampling params with a StructuredOutputs spec (its fields as keywords)."""
    params = pb.SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        structured_outputs=pb.StructuredOutputs(**spec),
    )
    if seed is not None:
        params.seed = seed
    return params


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _array(items: dict[str, Any], most: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "maxItems": most}


_NAME = {"type": "string", "pattern": "^[a-z]{1,8}$"}
_SMALL = {"type": "integer", "minimum": 0, "maximum": 99}

# Twenty schemas: nested objects, arrays, enums, bounded numbers, required
# fields and string patterns. Strings, arrays and numbers are bounded (a JSON
# number's fraction has no length limit), so that even the tiny model's noise
# ends within the tests' max_tokens.
SCHEMAS: list[dict[str, Any]] = [
    _obj({"a": _SMALL}),
    _obj({"name": _NAME, "age": _SMALL}),
    _obj({"color": {"enum": ["red", "green", "blue"]}}),
    _obj({"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 5}}),
    _obj({"tags": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 3}}),
    _obj({"point": _obj({"x": _SMALL, "y": _SMALL})}),
    _obj({"user": _obj({"id": _SMALL, "role": {"enum": ["admin", "guest"]}})}),
    {"type": "array", "items": _SMALL, "minItems": 2, "maxItems": 4},
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    _obj({"x": {"type": "integer", "minimum": -1000, "maximum": 1000, "multipleOf": 10}}),
    _obj({"a": _SMALL, "b": {"type": "string", "maxLength": 4}}, required=["a"]),
    _obj({"status": {"const": "done"}, "count": _SMALL}),
    _obj({"items": {"type": "array", "items": _obj({"id": _SMALL}), "maxItems": 2}}),
    _obj({"v": {"anyOf": [_SMALL, {"type": "boolean"}]}}),
    _obj({"level": {"type": "integer", "enum": [1, 2, 3]}, "name": _NAME}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    _obj(
        {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": _SMALL, "maxItems": 2},
                "maxItems": 2,
            }
        }
    ),
    _obj({"deep": _obj({"deeper": _obj({"deepest": {"enum": ["yes", "no"]}})})}),
    _obj(
        {
            "price": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000},
            "cur": {"enum": ["EUR", "USD"]},
        }
    ),
    _obj(
        {
            "id": _SMALL,
            "kind": {"enum": ["a", "b"]},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        }
    ),
]
SCHEMA_TEXTS = [json.dumps(s) for s in SCHEMAS]

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)",
    r"#[0-9a-f]{6}",
    r"(\+|-)?[1-9][0-9]{0,3}",
]
CHOICES = [["Paris", "London", "Berlin"], ["positive", "negative"], ["A", "B", "C", "D"]]


# Past llguidance's parser limits only on a token: 2,001 alternatives in one row
# (the limit is 2,000): a step with it fails while it runs.
CHOICE_PAST_LIMIT: dict[str, Any] = {
    "choice": pb.StructuredChoice(choices=[f"city{i}" for i in range(2001)])
}


def failing_beside(stub: pb_grpc.WorkerServiceStub, fail: bool) -> tuple[list[float], int, int]:
    """a and b decode together; then a step of a, a new 48-token prompt n and, if `fail`,
    a request past the engine's limits, sent again without it; then b alone, 3 steps.
    Returns b's last logprobs, n's cached prompt tokens, and the prefix cache's blocks
    after the failed step (before it, without one)."""
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    epoch = int(stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
    free = pb.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)

    def step(**fields: Any) -> pb.ExecuteResponse:
        response: pb.ExecuteResponse = stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, **fields))
        return response

    def cached(req_id: str, computed: int) -> pb.CachedRequest:
        return pb.CachedRequest(req_id=req_id, num_computed_tokens=computed)

    new = [
        pb.NewRequest(req_id=k, prompt_token_ids=p, sampling_params=free)
        for k, p in (("a", [5, 6, 7, 8, 9]), ("b", [9, 8, 7, 6, 5]))
    ]
    step(new_requests=new, num_scheduled_tokens={"a": 5, "b": 5})
    step(cached_requests=[cached("a", 5), cached("b", 5)], num_scheduled_tokens={"a": 1, "b": 1})
    long = pb.NewRequest(req_id="n", prompt_token_ids=list(range(600, 648)), sampling_params=free)
    scheduled = {"a": 1, "n": 48}
    if fail:
        bad = pb.NewRequest(
            req_id="bad",
            prompt_token_ids=[5, 6],
            sampling_params=constrained(8, **CHOICE_PAST_LIMIT),
        )
        with pytest.raises(grpc.RpcError) as caught:
            step(
                cached_requests=[cached("a", 6)],
                new_requests=[long, bad],
                num_scheduled_tokens={**scheduled, "bad": 2},
            )
        assert code_of(caught.value) == grpc.StatusCode.INVALID_ARGUMENT
    blocks = stub.CheckHealth(pb.CheckHealthRequest()).kv.prefix_cache_blocks
    again = step(
        cached_requests=[cached("a", 6)], new_requests=[long], num_scheduled_tokens=scheduled
    )
    hit = next(o.num_cached_prompt_tokens for o in again.outputs if o.req_id == "n")
    logprobs = []
    for computed in (6, 7, 8):  # b was out of the failed step: its KV must be as it was
        out = step(cached_requests=[cached("b", computed)], num_scheduled_tokens={"b": 1})
        logprobs += [lp.logprob for lp in out.outputs[0].logprobs]
    step(finished_req_ids=["a", "b", "n"])
    return logprobs, hit, blocks
