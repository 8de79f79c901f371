"""A minimal Python scheduler over Execute (like tests/driver.py) that times each step.

One Execute call per step; every live request is scheduled in every step
(decode: one token; prefill: the whole prompt, or `chunk` tokens at a time).
With `decode_steps` n > 1, calls in which every request decodes run n decode
steps each (ExecuteRequest.num_decode_steps); prefill calls run one, so TTFT is
unchanged.
Each request's computed-token count is taken from the response, never assumed:
with a prefix-cache hit the worker computes the scheduled tokens beyond the
cached part, and `num_computed_tokens` counts both.
The client's wall time is measured around the RPC alone (the request message is
built before the clock starts), and the worker's own `timings` are kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from benchmarks.common import Worker
from benchmarks.timeline import Timeline
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc import convert

ExecuteCall = Callable[[pb.ExecuteRequest], pb.ExecuteResponse]


@dataclass
class Step:
    wall_ns: int
    forward_ns: int
    total_ns: int
    num_tokens: int
    decode_batch_size: int
    sampled: int


@dataclass
class ExecuteRun:
    timeline: Timeline
    steps: list[Step] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    # Per prompt: prompt tokens the worker took from its prefix cache.
    cached_prompt_tokens: list[int] = field(default_factory=list)


def greedy(max_tokens: int) -> pb.SamplingParams:
    """Greedy, EOS ignored: every path generates exactly `max_tokens` tokens."""
    return pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def in_process_call(worker: Worker) -> ExecuteCall:
    """What the servicer's Execute does, called directly: no gRPC, no serialization."""
    if worker.server is None:
        raise ValueError("in_process_call needs an in-process worker (live_worker)")
    engine = worker.server.worker

    def call(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        return convert.step_result(engine.execute(convert.step_plan(request)))

    return call


def run_execute(
    worker: Worker,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    chunk: int | None = None,
    call: ExecuteCall | None = None,
    decode_steps: int = 1,
    params: list[pb.SamplingParams] | None = None,
) -> ExecuteRun:
    """Runs `prompts` together to completion, one Execute step at a time.

    `call` replaces the gRPC stub (e.g. `in_process_call`) to split the round trip's cost;
    `params` gives each prompt its own sampling parameters (default: `greedy(max_tokens)`).
    """
    execute: ExecuteCall = call or worker.stub.Execute
    ids = [worker.new_id("bench") for _ in prompts]
    length = {rid: len(p) for rid, p in zip(ids, prompts, strict=True)}
    computed = dict.fromkeys(ids, 0)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    cached_prompt = dict.fromkeys(ids, 0)
    live = list(ids)
    sampling = params or [greedy(max_tokens)] * len(prompts)
    new = [
        pb.NewRequest(req_id=rid, prompt_token_ids=p, sampling_params=s)
        for rid, p, s in zip(ids, prompts, sampling, strict=True)
    ]
    run = ExecuteRun(timeline=Timeline())
    step_id = 0
    while live:
        scheduled: dict[str, int] = {}
        for rid in live:
            remaining = length[rid] + len(outputs[rid]) - computed[rid]
            scheduled[rid] = remaining if chunk is None else min(chunk, remaining)
        fresh = {r.req_id for r in new}
        cached = [
            pb.CachedRequest(req_id=rid, num_computed_tokens=computed[rid])
            for rid in live
            if rid not in fresh
        ]
        request = pb.ExecuteRequest(
            step_id=step_id,
            worker_epoch=worker.epoch,
            new_requests=new,
            cached_requests=cached,
            num_scheduled_tokens=scheduled,
            num_decode_steps=1 if new or any(n > 1 for n in scheduled.values()) else decode_steps,
        )
        if step_id == 0:
            run.timeline = Timeline()
        start = time.perf_counter_ns()
        response = execute(request)
        wall = time.perf_counter_ns() - start
        sampled = sum(len(o.sampled_token_ids) for o in response.outputs)
        run.timeline.add(sampled)
        t = response.timings
        run.steps.append(
            Step(wall, t.forward_ns, t.total_ns, t.num_tokens, t.decode_batch_size, sampled)
        )
        new = []
        step_id += 1
        for out in response.outputs:
            outputs[out.req_id].extend(out.sampled_token_ids)
            computed[out.req_id] = out.num_computed_tokens
            cached_prompt[out.req_id] += out.num_cached_prompt_tokens
            if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                live.remove(out.req_id)
    run.tokens = [outputs[rid] for rid in ids]
    run.cached_prompt_tokens = [cached_prompt[rid] for rid in ids]
    return run


def warm_up(worker: Worker, batch_sizes: list[int], prefill_lengths: list[int]) -> None:
    """The worker's WarmUp RPC: each decode batch size and prefill length once."""
    worker.stub.WarmUp(pb.WarmUpRequest(batch_sizes=batch_sizes, prefill_lengths=prefill_lengths))


def run_generate(
    worker: Worker,
    prompt: list[int],
    max_tokens: int,
    *,
    start: threading.Barrier | None = None,
    request_id: str | None = None,
) -> tuple[Timeline, list[int]]:
    """One Generate stream (server streaming); returns its timeline and tokens.

    With `start`, the call waits on that barrier (concurrent streams start together).
    """
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling_params=greedy(max_tokens),
        request_id=request_id or worker.new_id("bench-gen"),
    )
    if start is not None:
        start.wait()
    timeline = Timeline()
    tokens: list[int] = []
    for message in worker.stub.Generate(request):
        timeline.add(len(message.token_ids))
        tokens.extend(message.token_ids)
    return timeline, tokens


def run_generate_streams(
    worker: Worker, prompts: list[list[int]], max_tokens: int
) -> tuple[list[Timeline], list[list[int]]]:
    """One Generate stream per prompt, all started together, one client thread each.

    The worker schedules them itself (no per-step RPC). Returns each stream's
    timeline (tokens stamped on arrival; `timeline.combined_stats` sums them up)
    and tokens, in the prompts' order.
    """
    if len(prompts) == 1:
        timeline, tokens = run_generate(worker, prompts[0], max_tokens)
        return [timeline], [tokens]
    start = threading.Barrier(len(prompts))
    with ThreadPoolExecutor(max_workers=len(prompts), thread_name_prefix="bench-gen") as pool:
        futures = [
            pool.submit(
                run_generate, worker, p, max_tokens, start=start, request_id=worker.new_id("gen")
            )
            for p in prompts
        ]
        done = [f.result() for f in futures]
    return [t for t, _ in done], [tokens for _, tokens in done]
