"""One worker's next step, planned from the requests routed to it (continuous batching).

`plan_step` gives every decoding request one token, then fills the token
budget with prefill chunks, shortest first, and starts waiting requests while
the KV budget (`KVRoom`) has room; `decode_steps` says how many decode steps
one call may take. Both only read and move requests between the link's lists;
the link sends the step, and step_outcome.py takes its reply.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_worker_svc.fleet.checks import STEP_BYTES, new_request_bytes, too_large
from mlx_worker_svc.fleet.request import FleetRequest, Phase
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


@dataclass(frozen=True)
class KVRoom:
    """A worker's KV budget as the fleet counts it: `num_blocks` of `block_size` tokens."""

    num_blocks: int
    block_size: int

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


def plan_step(
    request: pb.ExecuteRequest,
    views: dict[str, tuple[int, int]],
    waiting: list[FleetRequest],
    running: dict[str, FleetRequest],
    *,
    budget: int,
    used: int,
    max_seqs: int,
    kv: KVRoom,
    max_bytes: int = 0,
) -> tuple[list[FleetRequest], int]:
    """Fills `request` (step id, epoch and frees set); returns the requests it starts
    (moved from `waiting` to `running`, added to `views`) and the KV blocks used after it.

    `views` holds (computed, length) of each running request that may be scheduled.
    A new request that would take the step past `max_bytes` (the worker's largest
    message; 0: unknown) starts with a later step; one past it alone ends `BadRequest`.
    """
    # Decodes first (one token each), then prefill chunks, shortest first.
    order = sorted(views, key=lambda worker_id: views[worker_id][1] - views[worker_id][0])
    for worker_id in order:
        computed, length = views[worker_id]
        count = min(length - computed, budget)
        if count <= 0:
            continue
        request.cached_requests.append(
            pb.CachedRequest(req_id=worker_id, num_computed_tokens=computed)
        )
        request.num_scheduled_tokens[worker_id] = count
        budget -= count
        used += kv.blocks(computed + count) - kv.blocks(computed)
    started: list[FleetRequest] = []
    size = 0  # the step's bytes, measured once a new request is considered
    while waiting and budget > 0 and len(running) < max_seqs:
        r = waiting[0]
        count = min(len(r.tokens), budget)
        # The KV it may hold after this step: a prefix-cache hit, which only the worker
        # knows, comes on top of `count` (up to all but the last prompt token), so its
        # whole prompt is counted; counting `count` alone, a step of hits was refused
        # for KV, put back, and planned the same again, for good.
        holds = len(r.tokens)
        if used + kv.blocks(holds + 1) > kv.num_blocks and running:
            break
        prompt, params = r.continuation()
        new = pb.NewRequest(
            req_id=r.id_for(r.attempt + 1),  # the attempt it starts
            prompt_token_ids=prompt,
            sampling_params=params,
            num_generated_tokens=len(r.generated),
            lora_name=r.lora_name,
            # Text with every step: no Detokenize call per request per step.
            detokenize=True,
            skip_special_tokens=r.skip_special_tokens,
        )
        if max_bytes:
            size = (size or request.ByteSize() + STEP_BYTES) + new_request_bytes(new)
            if size > max_bytes:
                if request.new_requests or request.cached_requests:
                    break  # the next step takes it
                waiting.pop(0)  # no step can: admission checked another worker's limit
                r.phase = Phase.DONE
                r.outbox.put_nowait(too_large(new, max_bytes, size))
                continue
        waiting.pop(0)
        r.attempt += 1
        r.computed, r.phase, r.reported_cached = 0, Phase.RUNNING, False
        request.new_requests.append(new)
        request.num_scheduled_tokens[r.worker_id] = count
        running[r.worker_id] = r
        views[r.worker_id] = (0, len(prompt))
        started.append(r)
        budget -= count
        used += kv.blocks(holds)
    return started, used


def decode_steps(
    steps: int,
    request: pb.ExecuteRequest,
    running: dict[str, FleetRequest],
    *,
    waiting: bool,
    used: int,
    kv: KVRoom,
) -> int:
    """The configured decode `steps` for this call, or 1.

    Several steps only when every scheduled request decodes one token,
    nothing waits to start (its first token would wait for the whole call),
    no request has stop strings (this scheduler checks them between calls,
    so tokens past one would be computed for nothing) and the KV budget
    holds the extra tokens.
    """
    if steps <= 1 or waiting or request.new_requests:
        return 1
    scheduled = request.num_scheduled_tokens
    if not scheduled or any(count != 1 for count in scheduled.values()):
        return 1
    rows = [running[req_id] for req_id in scheduled]
    if any(r.stop for r in rows):
        return 1
    more = sum(kv.blocks(r.computed + steps) - kv.blocks(r.computed + 1) for r in rows)
    return steps if used + more <= kv.num_blocks else 1
