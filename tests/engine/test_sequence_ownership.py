"""CachedRequest.new_token_ids: the worker owns the tokens it samples.

The worker appends every token it samples; `new_token_ids` are tokens it does
not hold, placed after its last one. A scheduler that sends back what the
worker holds (an echoed sampled token, a resume carrying the whole sequence)
is refused with INVALID_ARGUMENT and nothing changes; tokens that are new are
appended, whole or in chunks, and give mlx-lm's greedy continuation.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from driver import code_of, details_of, greedy, mlx_lm_tokens

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
PROMPT = list(range(500, 537))  # 37 tokens
MAX_TOKENS = 12


class Scheduler:
    """One Execute request driven by hand; tracks its tokens and computed count."""

    def __init__(self, stub: Stub, prompt: list[int], max_tokens: int = MAX_TOKENS) -> None:
        self.stub = stub
        self.epoch = stub.GetInfo(pb.GetInfoRequest()).worker_epoch
        self.step_id = 0
        self.tokens = list(prompt)
        self.last = pb.RequestOutput(req_id="r")
        params = greedy(max_tokens, ignore_eos=True)
        new = pb.NewRequest(req_id="r", prompt_token_ids=prompt, sampling_params=params)
        self.last = self.send(new_requests=[new], num_scheduled_tokens={"r": len(prompt)})
        self.tokens += self.last.sampled_token_ids

    def send(self, **fields: object) -> pb.RequestOutput:
        self.step_id += 1
        request = pb.ExecuteRequest(step_id=self.step_id, worker_epoch=self.epoch, **fields)  # type: ignore[arg-type]
        response: pb.ExecuteResponse = self.stub.Execute(request)
        self.last = next((o for o in response.outputs if o.req_id == "r"), self.last)
        return self.last

    def step(
        self,
        scheduled: int,
        new: list[int] | None = None,
        *,
        resumed: bool = False,
        computed: int | None = None,
    ) -> pb.RequestOutput:
        cached = pb.CachedRequest(
            req_id="r",
            num_computed_tokens=self.last.num_computed_tokens if computed is None else computed,
            new_token_ids=new or [],
            resumed_from_preemption=resumed,
        )
        out = self.send(cached_requests=[cached], num_scheduled_tokens={"r": scheduled})
        self.tokens += [*(new or []), *out.sampled_token_ids]
        return out

    def refused(
        self, scheduled: int, new: list[int], *, resumed: bool = False, computed: int | None = None
    ) -> str:
        with pytest.raises(grpc.RpcError) as info:
            self.step(scheduled, new, resumed=resumed, computed=computed)
        assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT, details_of(info.value)
        return details_of(info.value)

    def decode_to_end(self) -> pb.RequestOutput:
        out = self.last
        while out.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            out = self.step(1)
        return out

    def preempt(self) -> None:
        self.send(preempted_req_ids=["r"])
        self.last = pb.RequestOutput(req_id="r", num_computed_tokens=0)


def test_an_echoed_sampled_token_is_refused_and_changes_nothing(
    tiny_stub: Stub, tiny_dir: Path
) -> None:
    expected = mlx_lm_tokens(tiny_dir, [PROMPT], MAX_TOKENS)[0]
    s = Scheduler(tiny_stub, PROMPT)
    s.step(1)
    sampled = s.tokens[-1]
    # vLLM's pipeline-parallel path: the sampled token sent back, counted from num_computed_tokens.
    message = s.refused(1, [sampled])
    assert f"new_token_ids repeats [{sampled}], which the worker holds from position 38" in message
    assert "appends every token it samples" in message and "schedules 1 token" in message
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_running_requests == 1 and health.kv.used_blocks == 3  # 38 computed / 16
    end = s.decode_to_end()
    assert s.tokens[len(PROMPT) :] == expected and end.finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize("echoed", [None, 1, 2], ids=["whole", "last", "last-two"])
def test_a_resume_that_echoes_tokens_it_holds_is_refused(
    tiny_stub: Stub, tiny_dir: Path, echoed: int | None
) -> None:
    """The whole sequence, or the last sampled token(s) as a decode step's echo, sent back
    on a resume: appending them would hold them twice (and the step would sample nothing)."""
    expected = mlx_lm_tokens(tiny_dir, [PROMPT], MAX_TOKENS)[0]
    s = Scheduler(tiny_stub, PROMPT)
    for _ in range(4):
        s.step(1)
    s.preempt()
    held = list(s.tokens)
    sent = held if echoed is None else held[-echoed:]
    message = s.refused(len(held), sent, resumed=True)
    if echoed is None:
        assert "repeats 42 tokens" in message and "from position 0" in message
    else:
        at = len(held) - echoed
        assert f"repeats {sent}, which the worker holds from position {at}" in message
    assert "resume it with num_computed_tokens 0 and no new_token_ids" in message
    assert "restarts from 0" in s.refused(len(held), [], resumed=True, computed=len(held) - 1)
    health = tiny_stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_preempted_requests == 1 and health.kv.used_blocks == 0
    out = s.step(len(held), resumed=True)
    # Not 69 computed for a 37-token prompt, and a token sampled.
    assert out.num_computed_tokens == len(held) and len(out.sampled_token_ids) == 1
    s.decode_to_end()
    assert s.tokens[len(PROMPT) :] == expected


def test_output_sent_back_is_refused_too(tiny_stub: Stub) -> None:
    s = Scheduler(tiny_stub, PROMPT)
    s.step(1)
    output = s.tokens[len(PROMPT) :]  # the whole output, as if the worker had none of it
    message = s.refused(1, output)
    assert "repeats" in message and "which the worker holds from position 3" in message


@pytest.mark.parametrize("resumed", [False, True], ids=["running", "resumed"])
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_new_tokens_are_appended_after_the_sampled_ones(
    tiny_stub: Stub, tiny_dir: Path, resumed: bool, chunked: bool
) -> None:
    s = Scheduler(tiny_stub, PROMPT)
    s.step(1)
    forced = [77, 78, 79]
    if resumed:
        s.preempt()
    uncomputed = len(s.tokens) + len(forced) - s.last.num_computed_tokens
    out = s.step(2 if chunked else uncomputed, forced, resumed=resumed)
    if chunked:  # the appended tokens computed over three steps
        assert not out.sampled_token_ids
        out = s.step(len(s.tokens) - out.num_computed_tokens - 1)
        assert not out.sampled_token_ids
        out = s.step(1)
    assert len(out.sampled_token_ids) == 1
    held = s.tokens[:-1]
    assert out.num_computed_tokens == len(held)
    assert s.tokens[-1] == mlx_lm_tokens(tiny_dir, [held], 1)[0][0]


def test_appended_tokens_count_toward_max_tokens(tiny_stub: Stub) -> None:
    s = Scheduler(tiny_stub, PROMPT, max_tokens=5)
    s.step(1)  # 2 sampled
    message = s.refused(5, [7, 8, 9])  # 5 output tokens: none left to sample
    assert "would make the sequence 42 tokens" in message and "ends at 42" in message
    out = s.step(3, [7, 8])
    assert len(s.tokens) == len(PROMPT) + 5 and out.finish_reason == pb.FINISH_REASON_LENGTH
