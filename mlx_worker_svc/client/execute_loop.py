"""The smallest scheduler over Execute: runs prompts together to completion.

Every live request is scheduled in every step: its whole prompt (or `chunk`
tokens of it) until the prompt is computed, then one token a step. Each
request's computed-token count is taken from the response, never assumed: with
a prefix-cache hit the worker computes only the tokens beyond the cached part,
and `num_computed_tokens` counts both. The worker appends the tokens it samples,
so a cached request carries only its `num_computed_tokens`. The tests' and the
benchmarks' schedulers are this loop; `execute` is any callable with the stub's
shape (a stub's `Execute`, a client's `execute`, or a wrapper that times it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

ExecuteCall = Callable[[pb.ExecuteRequest], pb.ExecuteResponse]


@dataclass(frozen=True)
class LoopResult:
    """What the requests produced, in the prompts' order."""

    tokens: list[list[int]]
    # Prompt tokens each request took from the worker's prefix cache.
    cached_prompt_tokens: list[int]
    # Every RequestOutput each request got, step by step.
    outputs: list[list[pb.RequestOutput]]
    steps: int


def run_prompts(
    execute: ExecuteCall,
    epoch: int,
    prompts: Sequence[Sequence[int]],
    params: pb.SamplingParams | Sequence[pb.SamplingParams],
    *,
    req_ids: Sequence[str] | None = None,
    chunk: int | None = None,
    decode_steps: int = 0,
    decode_steps_with_prefill: bool = True,
) -> LoopResult:
    """Runs `prompts` to completion, one Execute call a step.

    `params` is every request's sampling, or one per prompt.

    `chunk` caps the prompt tokens a request computes per step (None: all at once).
    `decode_steps` is each call's `num_decode_steps`; with
    `decode_steps_with_prefill=False` a call that computes any prompt tokens runs
    one step, so the time to a first token is that of a single step.
    """
    ids = list(req_ids) if req_ids is not None else [f"req-{i}" for i in range(len(prompts))]
    if len(ids) != len(prompts):
        raise ValueError(f"{len(ids)} request ids for {len(prompts)} prompts")
    sampling = [params] * len(ids) if isinstance(params, pb.SamplingParams) else list(params)
    if len(sampling) != len(prompts):
        raise ValueError(f"{len(sampling)} sampling params for {len(prompts)} prompts")
    length = {rid: len(p) for rid, p in zip(ids, prompts, strict=True)}
    computed = dict.fromkeys(ids, 0)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    cached_prompt = dict.fromkeys(ids, 0)
    messages: dict[str, list[pb.RequestOutput]] = {rid: [] for rid in ids}
    live = set(ids)
    new = [
        pb.NewRequest(req_id=rid, prompt_token_ids=p, sampling_params=sp)
        for rid, p, sp in zip(ids, prompts, sampling, strict=True)
    ]
    step = 0
    while live:
        scheduled = {}
        for rid in sorted(live):
            remaining = length[rid] + len(outputs[rid]) - computed[rid]
            scheduled[rid] = remaining if chunk is None else min(chunk, remaining)
        fresh = {r.req_id for r in new}
        prefilling = bool(new) or any(n > 1 for n in scheduled.values())
        request = pb.ExecuteRequest(
            step_id=step,
            worker_epoch=epoch,
            new_requests=new,
            cached_requests=[
                pb.CachedRequest(req_id=rid, num_computed_tokens=computed[rid])
                for rid in sorted(live)
                if rid not in fresh
            ],
            num_scheduled_tokens=scheduled,
            num_decode_steps=decode_steps if decode_steps_with_prefill or not prefilling else 1,
        )
        response = execute(request)
        new = []
        step += 1
        for out in response.outputs:
            messages[out.req_id].append(out)
            outputs[out.req_id].extend(out.sampled_token_ids)
            computed[out.req_id] = out.num_computed_tokens
            cached_prompt[out.req_id] += out.num_cached_prompt_tokens
            if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                live.discard(out.req_id)
    return LoopResult(
        tokens=[outputs[rid] for rid in ids],
        cached_prompt_tokens=[cached_prompt[rid] for rid in ids],
        outputs=[messages[rid] for rid in ids],
        steps=step,
    )
