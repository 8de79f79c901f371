"""A test scheduler that runs ahead: steps sent before the replies of earlier ones.

`drive_ahead` builds each step from what it predicts the earlier steps in
flight will have done (a prefill chunk computes its tokens, a sampling step
one token a decode step) and never predicts a finish: a request that
finished while later steps were in flight is skipped by the worker and
reported in already_finished_req_ids. With `depth=0` it runs the same
schedule through unary Execute, one step at a time: the reference.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mlx_worker_svc.client.step_stream import ExecuteStreamCall, raise_for_error
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc


@dataclass
class _Request:
    req_id: str
    prompt: list[int]
    computed: int = 0  # predicted, after every step sent so far
    length: int = 0  # predicted sequence length after every step sent so far
    tokens: list[int] = field(default_factory=list)  # from the replies
    new: bool = True
    preempted: bool = False
    done: bool = False


@dataclass
class Drive:
    tokens: list[list[int]]
    skipped: int = 0  # requests left out of a step because an earlier one finished them
    steps: int = 0


def drive_ahead(
    stub: pb_grpc.WorkerServiceStub,
    epoch: int,
    prompts: list[list[int]],
    params: list[pb.SamplingParams],
    *,
    depth: int,
    chunk: int | None = None,
    decode_steps: int = 0,
    preempt: tuple[int, int] | None = None,
) -> Drive:
    """Runs every prompt together; `preempt` (step, index) preempts that request at
    that step and resumes it two steps later."""
    reqs = [_Request(f"req-{i}", p, length=len(p)) for i, p in enumerate(prompts)]
    stream = ExecuteStreamCall(stub) if depth else None
    in_flight: deque[pb.ExecuteRequest] = deque()
    result = Drive(tokens=[])
    step = 0

    def receive() -> None:
        sent = in_flight.popleft()
        if stream is not None:
            reply = stream.receive()
            assert reply.step_id == sent.step_id
            result.skipped += len(reply.already_finished_req_ids)
            response = raise_for_error(reply)
        else:
            response = stub.Execute(sent)
        for out in response.outputs:
            r = reqs[int(out.req_id.split("-")[1])]
            r.tokens.extend(out.sampled_token_ids)
            if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                r.done = True

    while any(not r.done for r in reqs):
        if len(in_flight) >= max(depth, 1):
            receive()
            continue
        request = _next_step(reqs, params, step, epoch, chunk, decode_steps, preempt)
        if stream is not None:
            stream.send(request)
        in_flight.append(request)
        step += 1
        if stream is None:
            receive()
    while in_flight:
        receive()
    if stream is not None:
        stream.close()
    result.steps = step
    result.tokens = [r.tokens for r in reqs]
    return result


def _next_step(
    reqs: list[_Request],
    params: list[pb.SamplingParams],
    step: int,
    epoch: int,
    chunk: int | None,
    decode_steps: int,
    preempt: tuple[int, int] | None,
) -> pb.ExecuteRequest:
    """The next step, counting what the steps in flight will have computed."""
    request = pb.ExecuteRequest(step_id=step, worker_epoch=epoch, num_decode_steps=decode_steps)
    for i, r in enumerate(reqs):
        if r.done:
            continue
        if preempt is not None and preempt[1] == i and step == preempt[0]:
            request.preempted_req_ids.append(r.req_id)
            r.preempted, r.computed = True, 0
            continue
        if r.preempted and step < preempt[0] + 2:  # type: ignore[index]
            continue
        count = r.length - r.computed if chunk is None else min(chunk, r.length - r.computed)
        if r.new:
            request.new_requests.add(
                req_id=r.req_id, prompt_token_ids=r.prompt, sampling_params=params[i]
            )
        else:
            request.cached_requests.add(
                req_id=r.req_id,
                num_computed_tokens=r.computed,
                resumed_from_preemption=r.preempted,
            )
        r.new, r.preempted = False, False
        request.num_scheduled_tokens[r.req_id] = count
        if r.computed + count < r.length:
            r.computed += count
        else:  # it samples: one token a decode step
            more = max(decode_steps, 1)
            r.computed, r.length = r.length + more - 1, r.length + more
    return request
