"""The benchmarks' Execute and Generate clients, timing every step.

`run_execute` is the shared scheduler (`mlx_worker_svc.client.execute_loop`, the
one the tests use) with each call timed: the client's wall time around the RPC
alone (the request message is built before the clock starts) and the worker's
own `timings`. With `decode_steps` n > 1, calls in which every request decodes
run n decode steps each; calls that compute prompt tokens run one, so TTFT is
unchanged. `run_generate_streams` runs Generate streams, one client thread each.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from benchmarks.common import Worker
from benchmarks.timeline import Timeline
from mlx_worker_svc.client.execute_loop import ExecuteCall, run_prompts
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.rpc import convert


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
    run = ExecuteRun(timeline=Timeline())

    def timed(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        start = time.perf_counter_ns()
        response = execute(request)
        wall = time.perf_counter_ns() - start
        sampled = sum(len(o.sampled_token_ids) for o in response.outputs)
        run.timeline.add(sampled)
        t = response.timings
        run.steps.append(
            Step(wall, t.forward_ns, t.total_ns, t.num_tokens, t.decode_batch_size, sampled)
        )
        return response

    result = run_prompts(
        timed,
        worker.epoch,
        prompts,
        params or greedy(max_tokens),
        req_ids=[worker.new_id("bench") for _ in prompts],
        chunk=chunk,
        decode_steps=decode_steps,
        decode_steps_with_prefill=False,
    )
    run.tokens = result.tokens
    run.cached_prompt_tokens = result.cached_prompt_tokens
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
