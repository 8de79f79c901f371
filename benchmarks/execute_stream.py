"""The benchmarks' scheduler over ExecuteStream: `run_execute`'s schedule, run ahead.

The same steps as `execute_client.run_execute` (every live request scheduled in
every step; prefill whole or in chunks), but up to `depth` steps are sent
before the oldest reply is read. A step sent ahead counts what the steps in
flight will compute (a decode step: one token, or `decode_steps`); a request
whose prefill chunk in flight does not reach its prompt's end waits for that
reply (a prefix-cache hit may move it), and a finish is never predicted: the
worker leaves a finished request out of later steps (already_finished_req_ids).
A step's client wall time is the time between its reply and the one before
(from the first send, for the first): in a full pipeline, that is what a step
costs the scheduler.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from benchmarks.common import Worker
from benchmarks.execute_client import ExecuteRun, Step, greedy
from benchmarks.timeline import Timeline
from mlx_worker_svc.client.step_stream import ExecuteStreamCall, raise_for_error
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


@dataclass
class _Book:
    computed: int = 0  # counting the steps in flight
    length: int = 0  # counting the steps in flight
    new: bool = True
    waiting: bool = False  # a chunk in flight: wait for its reply
    done: bool = False


def run_execute_stream(
    worker: Worker,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    depth: int = 2,
    chunk: int | None = None,
    decode_steps: int = 1,
) -> ExecuteRun:
    """Runs `prompts` together to completion through one ExecuteStream."""
    ids = [worker.new_id("bench") for _ in prompts]
    books = {rid: _Book(length=len(p)) for rid, p in zip(ids, prompts, strict=True)}
    prompt_of = dict(zip(ids, prompts, strict=True))
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    cached_prompt = dict.fromkeys(ids, 0)
    run = ExecuteRun(timeline=Timeline())
    in_flight: deque[list[str]] = deque()  # per step: the requests whose chunk it carries
    step_id = 0
    with ExecuteStreamCall(worker.stub) as stream:
        last = time.perf_counter_ns()
        while any(not b.done for b in books.values()) or in_flight:
            ready = [r for r, b in books.items() if not b.done and not b.waiting]
            if ready and len(in_flight) < depth:
                request = pb.ExecuteRequest(step_id=step_id, worker_epoch=worker.epoch)
                chunked = _schedule(
                    request, ready, books, prompt_of, chunk=chunk, max_tokens=max_tokens
                )
                if (
                    request.new_requests
                    or chunked
                    or any(n > 1 for n in request.num_scheduled_tokens.values())
                ):
                    request.num_decode_steps = 1
                else:
                    request.num_decode_steps = decode_steps
                _advance(request, books)
                if step_id == 0:
                    last = time.perf_counter_ns()
                stream.send(request)
                in_flight.append(chunked)
                step_id += 1
                continue
            response = raise_for_error(stream.receive())
            now = time.perf_counter_ns()
            wall, last = now - last, now
            for rid in in_flight.popleft():
                books[rid].waiting = False
            sampled = sum(len(o.sampled_token_ids) for o in response.outputs)
            run.timeline.add(sampled)
            t = response.timings
            run.steps.append(
                Step(wall, t.forward_ns, t.total_ns, t.num_tokens, t.decode_batch_size, sampled)
            )
            for out in response.outputs:
                book = books[out.req_id]
                outputs[out.req_id].extend(out.sampled_token_ids)
                cached_prompt[out.req_id] += out.num_cached_prompt_tokens
                if not out.sampled_token_ids:  # a chunk: the worker's count is the truth
                    book.computed = out.num_computed_tokens
                if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    book.done = True
        stream.close()
    run.tokens = [outputs[rid] for rid in ids]
    run.cached_prompt_tokens = [cached_prompt[rid] for rid in ids]
    return run


def _schedule(
    request: pb.ExecuteRequest,
    ready: list[str],
    books: dict[str, _Book],
    prompts: dict[str, list[int]],
    *,
    chunk: int | None,
    max_tokens: int,
) -> list[str]:
    """Schedules `ready` into `request`; returns the requests it gives a prefill chunk."""
    chunked = []
    for rid in ready:
        book = books[rid]
        remaining = book.length - book.computed
        count = remaining if chunk is None else min(chunk, remaining)
        if book.new:
            request.new_requests.add(
                req_id=rid, prompt_token_ids=prompts[rid], sampling_params=greedy(max_tokens)
            )
        else:
            request.cached_requests.add(req_id=rid, num_computed_tokens=book.computed)
        request.num_scheduled_tokens[rid] = count
        if count < remaining:
            chunked.append(rid)
    return chunked


def _advance(request: pb.ExecuteRequest, books: dict[str, _Book]) -> None:
    """Counts what the step will compute, for the steps sent after it."""
    for rid, count in request.num_scheduled_tokens.items():
        book = books[rid]
        book.new = False
        if book.computed + count < book.length:
            book.computed += count
            book.waiting = True
        else:
            more = max(request.num_decode_steps, 1)
            book.computed, book.length = book.length + more - 1, book.length + more
