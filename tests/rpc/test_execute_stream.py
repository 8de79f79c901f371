"""ExecuteStream: steps sent ahead give unary Execute's tokens, and its rules hold.

The same schedule (chunked prefill, a preemption and its resume, requests ending
by EOS and by length while later steps are in flight) runs through unary Execute
and through the stream at depths 1, 2 and 4, greedy and seeded, at batch 1, 4
and 16, on one worker with the prefix cache off (a sent-ahead chunk of a new
request can only be predicted without a prefix hit; see stream_driver.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from driver import bring_up, greedy, live_server, wait_until_idle
from stream_driver import drive_ahead

from mlx_worker_svc.client.step_stream import ExecuteStreamCall, StepFailed, raise_for_error
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def worker(tiny_dir: Path) -> Iterator[tuple[pb_grpc.WorkerServiceStub, int, int]]:
    """(stub, epoch, EOS id) of a worker on the tiny model, prefix cache off."""
    with live_server() as (_, stub):
        epoch = bring_up(stub, tiny_dir)
        stub.InitCache(
            pb.InitCacheRequest(num_blocks=4096, block_size=16, enable_prefix_caching=False)
        )
        eos = stub.GetInfo(pb.GetInfoRequest()).model.eos_token_ids[0]
        yield stub, epoch, eos


def _workload(
    batch: int, eos: int, seeded: bool
) -> tuple[list[list[int]], list[pb.SamplingParams]]:
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 5000) for _ in range(rng.randrange(3, 30))] for _ in range(batch)]
    params = []
    for i in range(batch):
        p = greedy(4 + i % 7, ignore_eos=True)
        if seeded:
            p.temperature, p.top_p, p.seed = 0.9, 0.95, 1000 + i
        if i % 3 == 1:  # ends by EOS after min_tokens (EOS pushed up, masked before)
            p.ignore_eos, p.min_tokens, p.max_tokens = False, 2 + i % 4, 30
            p.logit_bias[eos] = 100.0
        params.append(p)
    return prompts, params


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_stream_tokens_equal_unary_execute(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int], batch: int, seeded: bool
) -> None:
    stub, epoch, eos = worker
    prompts, params = _workload(batch, eos, seeded)
    schedule = {"chunk": 8, "preempt": (3, 0)}
    unary = drive_ahead(stub, epoch, prompts, params, depth=0, **schedule)  # type: ignore[arg-type]
    assert all(unary.tokens), unary
    for depth in (1, 2, 4):
        ahead = drive_ahead(stub, epoch, prompts, params, depth=depth, **schedule)  # type: ignore[arg-type]
        assert ahead.tokens == unary.tokens, f"depth {depth}"
        if depth > 1:  # requests finished while later steps naming them were in flight
            assert ahead.skipped > 0
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_stream_combines_with_decode_steps(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    stub, epoch, eos = worker
    prompts, params = _workload(4, eos, seeded=False)
    unary = drive_ahead(stub, epoch, prompts, params, depth=0, decode_steps=3)
    ahead = drive_ahead(stub, epoch, prompts, params, depth=2, decode_steps=3)
    assert ahead.tokens == unary.tokens


def _new(req_id: str, prompt: list[int], max_tokens: int) -> pb.NewRequest:
    return pb.NewRequest(req_id=req_id, prompt_token_ids=prompt, sampling_params=greedy(max_tokens))


def _decoding(
    step_id: int, epoch: int, computed: dict[str, int], **extra: Any
) -> pb.ExecuteRequest:
    """A step that decodes one token of each request, from its computed tokens."""
    return pb.ExecuteRequest(
        step_id=step_id,
        worker_epoch=epoch,
        cached_requests=[
            pb.CachedRequest(req_id=r, num_computed_tokens=n) for r, n in computed.items()
        ],
        num_scheduled_tokens=dict.fromkeys(computed, 1),
        **extra,
    )


def _starting(
    req_id: str, prompt: list[int], epoch: int, step_id: int = 1, max_tokens: int = 50
) -> pb.ExecuteRequest:
    """A step that starts one request and prefills its whole prompt."""
    return pb.ExecuteRequest(
        step_id=step_id,
        worker_epoch=epoch,
        new_requests=[_new(req_id, prompt, max_tokens)],
        num_scheduled_tokens={req_id: len(prompt)},
    )


def test_failed_step_is_answered_and_later_steps_that_counted_on_it_fail(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    stub, epoch, _ = worker
    with ExecuteStreamCall(stub) as stream:
        stream.send(_starting("a", [5, 6, 7], epoch))
        # Step 2 fails (an unknown request): nothing of it runs, "a" included.
        stream.send(_decoding(2, epoch, {"a": 3, "ghost": 0}))
        # Step 3 was sent counting on step 2's token for "a": refused, not run.
        stream.send(
            pb.ExecuteRequest(
                step_id=3,
                worker_epoch=epoch,
                cached_requests=[pb.CachedRequest(req_id="a", num_computed_tokens=4)],
                num_scheduled_tokens={"a": 1},
            )
        )
        # Step 4 is the scheduler's retry after reading step 2's error.
        stream.send(
            pb.ExecuteRequest(
                step_id=4,
                worker_epoch=epoch,
                cached_requests=[pb.CachedRequest(req_id="a", num_computed_tokens=3)],
                num_scheduled_tokens={"a": 1},
            )
        )
        first = raise_for_error(stream.receive())
        replies = [stream.receive() for _ in range(3)]
        assert [r.step_id for r in replies] == [2, 3, 4]
        assert replies[0].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        assert "'ghost'" in replies[0].error.message
        with pytest.raises(StepFailed) as failed:
            raise_for_error(replies[1])
        assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert "num_computed_tokens is 4 but the worker has 4" not in failed.value.message
        assert "num_computed_tokens is 4 but the worker has 3 computed" in failed.value.message
        retried = raise_for_error(replies[2]).outputs[0]
        assert retried.num_computed_tokens == 4 and len(retried.sampled_token_ids) == 1
        assert len(first.outputs[0].sampled_token_ids) == 1
    assert wait_until_idle(stub, 30).num_running_requests == 0  # cancel freed "a"


def test_bad_field_fails_only_its_step(worker: tuple[pb_grpc.WorkerServiceStub, int, int]) -> None:
    stub, epoch, _ = worker
    bad = pb.SamplingParams(temperature=-1.0)
    with ExecuteStreamCall(stub) as stream:
        stream.send(
            pb.ExecuteRequest(
                step_id=7,
                worker_epoch=epoch,
                new_requests=[pb.NewRequest(req_id="x", prompt_token_ids=[1], sampling_params=bad)],
                num_scheduled_tokens={"x": 1},
            )
        )
        stream.send(pb.ExecuteRequest(step_id=8, worker_epoch=epoch + 1))
        stream.send(pb.ExecuteRequest(step_id=9, worker_epoch=epoch))
        replies = [stream.receive() for _ in range(3)]
        stream.close()
    assert [r.WhichOneof("outcome") for r in replies] == ["error", "error", "result"]
    assert replies[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in replies[0].error.message
    assert replies[1].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "worker_epoch" in replies[1].error.message


def test_message_without_its_step_fails_only_itself(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """The raw stub: an empty ExecuteStreamRequest is answered (step_id 0), the next runs."""
    stub, epoch, _ = worker
    messages = [
        pb.ExecuteStreamRequest(),
        pb.ExecuteStreamRequest(step=pb.ExecuteRequest(step_id=5, worker_epoch=epoch)),
    ]
    first, second = list(stub.ExecuteStream(iter(messages), timeout=30))
    assert (first.step_id, first.WhichOneof("outcome")) == (0, "error")
    assert first.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert first.error.message == "ExecuteStreamRequest.step is required"
    assert (second.step_id, second.WhichOneof("outcome")) == (5, "result")


def test_a_field_unknown_here_fails_only_its_step(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """A step from a client built from a newer proto sets a field this server lacks: that
    step is refused UNIMPLEMENTED naming it (as unary Execute refuses it), the request it
    was to create counts as never created, and the stream and its requests go on."""
    stub, epoch, _ = worker
    newer = pb.ExecuteRequest()  # protobuf keeps the unknown field 40 and sends it on
    newer.ParseFromString(
        _starting("u", [5, 6], epoch, step_id=2).SerializeToString() + b"\xc0\x02\x01"
    )
    with ExecuteStreamCall(stub) as stream:
        stream.send(_starting("k", [5, 6, 7], epoch))
        stream.send(newer)
        stream.send(_decoding(3, epoch, {"k": 3}))
        stream.send(_decoding(4, epoch, {"u": 2}))
        first, refused, decoded, ahead = [stream.receive() for _ in range(4)]
        stream.close()
    assert raise_for_error(first).outputs[0].req_id == "k"
    assert (refused.step_id, refused.error.code) == (2, grpc.StatusCode.UNIMPLEMENTED.value[0])
    assert refused.error.message.startswith(
        "mlx_worker.v1.ExecuteStreamRequest: step.field 40 is not a field this server knows"
    )
    [out] = raise_for_error(decoded).outputs
    assert (out.req_id, out.num_computed_tokens, len(out.sampled_token_ids)) == ("k", 4, 1)
    assert ahead.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "step 2 of this stream was to create it and failed" in ahead.error.message
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_cancelled_stream_frees_its_requests(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    stub, epoch, _ = worker
    stream = ExecuteStreamCall(stub)
    stream.send(
        pb.ExecuteRequest(
            step_id=1,
            worker_epoch=epoch,
            new_requests=[_new(f"c{i}", [9, 8, 7, i + 3], 500) for i in range(3)],
            num_scheduled_tokens={f"c{i}": 4 for i in range(3)},
        )
    )
    raise_for_error(stream.receive())
    assert stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 3
    stream.cancel()
    health = wait_until_idle(stub, 30)
    assert health.state == pb.WORKER_STATE_SERVING and health.healthy


def test_a_new_request_may_reuse_the_id_of_one_the_stream_finished(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """The id of a request an earlier step finished is free: a new request under it runs
    as it would through Execute, and is not reported as already finished."""
    stub, epoch, _ = worker

    def step(step_id: int, new: pb.NewRequest, *finished: str) -> pb.ExecuteRequest:
        count = {new.req_id: len(new.prompt_token_ids)}
        return pb.ExecuteRequest(
            step_id=step_id,
            worker_epoch=epoch,
            new_requests=[new],
            num_scheduled_tokens=count,
            finished_req_ids=finished,
        )

    prompt = [504, 3575, 282, 4649]
    unary = stub.Execute(step(0, _new("u", prompt, 3))).outputs[0].sampled_token_ids
    stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, finished_req_ids=["u"]))
    with ExecuteStreamCall(stub) as stream:
        stream.send(step(1, _new("w", prompt[:3], 1)))  # finishes at once (max_tokens)
        finished = raise_for_error(stream.receive())
        assert finished.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
        replies = []
        for step_id, extra in ((2, ()), (3, ("w",))):  # the second also names the old "w"
            stream.send(step(step_id, _new("w", prompt, 3), *extra))
            replies.append(stream.receive())
        for reply in replies:
            assert not reply.already_finished_req_ids
            [out] = raise_for_error(reply).outputs
            assert (out.req_id, out.num_computed_tokens) == ("w", 4)
            assert list(out.sampled_token_ids) == list(unary)
        stream.close()
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_a_stream_frees_only_the_requests_it_created(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """A request Execute created under the id of one the stream created and that
    Execute finished is not the stream's: it outlives the stream."""
    stub, epoch, _ = worker
    with ExecuteStreamCall(stub) as stream:
        stream.send(_starting("r", [5, 6, 7], epoch))
        raise_for_error(stream.receive())
        restarted = pb.ExecuteRequest(
            worker_epoch=epoch,
            finished_req_ids=["r"],
            new_requests=[_new("r", [5, 6, 7, 8], 50)],
            num_scheduled_tokens={"r": 4},
        )
        stub.Execute(restarted)
        stream.close()
        with pytest.raises(StopIteration):  # ended: its clean-up is queued before what follows
            stream.receive()
    decoded = pb.ExecuteRequest(
        worker_epoch=epoch,
        cached_requests=[pb.CachedRequest(req_id="r", num_computed_tokens=4)],
        num_scheduled_tokens={"r": 1},
    )
    assert stub.Execute(decoded).outputs[0].num_computed_tokens == 5
    stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, finished_req_ids=["r"]))
    assert wait_until_idle(stub, 30).num_running_requests == 0


def _finished_then_made_again(
    stream: ExecuteStreamCall,
    stub: pb_grpc.WorkerServiceStub,
    req_id: str,
    prompt: list[int],
    epoch: int,
) -> pb.RequestOutput:
    """The stream's step 1 creates `req_id`, which finishes at once; then unary Execute
    makes a new, live request under the id. Returns that one's output."""
    stream.send(
        pb.ExecuteRequest(
            step_id=1,
            worker_epoch=epoch,
            new_requests=[_new(req_id, prompt, 1)],
            num_scheduled_tokens={req_id: len(prompt)},
        )
    )
    assert raise_for_error(stream.receive()).outputs[0].finish_reason
    return stub.Execute(_starting(req_id, prompt, epoch)).outputs[0]


def test_a_live_request_under_a_finished_id_is_scheduled(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """The stream skips the request it saw finish, not one Execute made since under its id."""
    stub, epoch, _ = worker
    prompt = [5, 6, 7]
    with ExecuteStreamCall(stub) as stream:
        made = _finished_then_made_again(stream, stub, "r", prompt, epoch)
        stream.send(_decoding(2, epoch, {"r": 3}))
        reply = stream.receive()
        assert not reply.already_finished_req_ids
        [out] = raise_for_error(reply).outputs
        assert (out.req_id, out.num_computed_tokens, len(out.sampled_token_ids)) == ("r", 4, 1)
        assert made.sampled_token_ids
        stream.close()
    stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, finished_req_ids=["r"]))
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_a_finish_sent_for_a_finished_id_never_frees_anothers_request_under_it(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """The stream's finish (or preemption) of the request it saw finish meant that one:
    it is dropped and listed, and the live request Execute made since under the id runs on."""
    stub, epoch, _ = worker
    prompt = [5, 6, 7]
    with ExecuteStreamCall(stub) as stream:
        theirs = _finished_then_made_again(stream, stub, "g", prompt, epoch)
        stream.send(pb.ExecuteRequest(step_id=2, worker_epoch=epoch, finished_req_ids=["g"]))
        stream.send(pb.ExecuteRequest(step_id=3, worker_epoch=epoch, preempted_req_ids=["g"]))
        for _ in range(2):
            reply = stream.receive()
            assert list(reply.already_finished_req_ids) == ["g"]
            raise_for_error(reply)
        stream.close()
    [out] = stub.Execute(_decoding(4, epoch, {"g": theirs.num_computed_tokens})).outputs
    assert (out.req_id, out.num_computed_tokens) == ("g", 4)
    stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, finished_req_ids=["g"]))
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_once_the_stream_makes_a_finished_id_again_the_id_means_the_new_request(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """Step 1 finishes "x" (max_tokens 1); step 2 creates a new "x"; step 3's preemption of
    "x" is the new one's: it is preempted, and nothing is listed as already finished."""
    stub, epoch, _ = worker
    with ExecuteStreamCall(stub) as stream:
        stream.send(_starting("x", [5, 6, 7], epoch, step_id=1, max_tokens=1))
        stream.send(_starting("x", [8, 9, 10], epoch, step_id=2))
        stream.send(pb.ExecuteRequest(step_id=3, worker_epoch=epoch, preempted_req_ids=["x"]))
        [out] = raise_for_error(stream.receive()).outputs
        assert out.finish_reason == pb.FINISH_REASON_LENGTH
        raise_for_error(stream.receive())
        reply = stream.receive()
        raise_for_error(reply)
        assert list(reply.already_finished_req_ids) == []
        health = stub.CheckHealth(pb.CheckHealthRequest())
        assert (health.num_running_requests, health.num_preempted_requests) == (0, 1)
        stream.send(pb.ExecuteRequest(step_id=4, worker_epoch=epoch, finished_req_ids=["x"]))
        raise_for_error(stream.receive())
        stream.close()
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_an_error_names_the_index_the_scheduler_sent(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """A step's already finished requests are left out of it; an error about the others
    still names each at the index it had in the step as sent."""
    stub, epoch, _ = worker
    with ExecuteStreamCall(stub) as stream:
        stream.send(
            pb.ExecuteRequest(
                step_id=1,
                worker_epoch=epoch,
                new_requests=[_new("m", [5, 6], 1), _new("n", [7, 8], 50)],
                num_scheduled_tokens={"m": 2, "n": 2},
            )
        )
        stream.send(_decoding(2, epoch, {"m": 2, "n": 7}))  # n's count is wrong
        raise_for_error(stream.receive())
        with pytest.raises(StepFailed) as refused:
            raise_for_error(stream.receive())
        stream.close()
    assert refused.value.message.startswith(
        "cached_requests[1] (req_id 'n').num_computed_tokens is 7"
    ), refused.value.message
    assert wait_until_idle(stub, 30).num_running_requests == 0


def _failed_to_create(stream: ExecuteStreamCall, step: int) -> str:
    """Step `step`, which was to create a request, fails INVALID_ARGUMENT; the next, sent
    ahead for that request, NOT_FOUND naming the failed step (its message returned)."""
    with pytest.raises(StepFailed) as refused:
        raise_for_error(stream.receive())
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(StepFailed) as ahead:
        raise_for_error(stream.receive())
    assert ahead.value.code == grpc.StatusCode.NOT_FOUND
    assert f"step {step} of this stream was to create it and failed" in ahead.value.message
    return ahead.value.message


def test_a_step_ahead_never_runs_on_another_schedulers_request_under_its_id(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """Another scheduler (unary Execute) holds "dup"; this stream's step that was to create
    its own "dup" fails (already running), and the step sent ahead for it fails NOT_FOUND
    instead of decoding the other scheduler's request; its finish of "dup" is left out.
    The other scheduler's request keeps its counts."""
    stub, epoch, _ = worker
    prompt = [5, 6, 7]
    theirs = stub.Execute(_starting("dup", prompt, epoch)).outputs[0]
    assert theirs.num_computed_tokens == 3
    with ExecuteStreamCall(stub) as stream:
        stream.send(_starting("dup", prompt, epoch, step_id=1))
        stream.send(_decoding(2, epoch, {"dup": 3}))  # ahead: counts on step 1's token
        stream.send(pb.ExecuteRequest(step_id=3, worker_epoch=epoch, finished_req_ids=["dup"]))
        message = _failed_to_create(stream, 1)
        assert message.startswith("cached_requests[0] (req_id 'dup'): step 1 of"), message
        raise_for_error(stream.receive())  # the finish of a request it never had
        stream.close()
    [out] = stub.Execute(_decoding(4, epoch, {"dup": 3})).outputs  # theirs, untouched
    assert (out.req_id, out.num_computed_tokens) == ("dup", 4)
    stub.Execute(pb.ExecuteRequest(worker_epoch=epoch, finished_req_ids=["dup"]))
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_a_step_ahead_never_runs_on_the_streams_own_request_it_failed_to_finish(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """Step 3 finishes "z" and fails; step 4, which counted on that finish, creates a new
    "z" (same prompt length) and fails (already running); step 5, sent ahead for the new
    "z", fails NOT_FOUND instead of decoding the old one whose counts happen to match;
    step 6's finish of "z" frees the old one (the scheduler finished it once already)."""
    stub, epoch, _ = worker
    with ExecuteStreamCall(stub) as stream:
        stream.send(_starting("z", [5, 6, 7], epoch, step_id=1))
        stream.send(_decoding(2, epoch, {"z": 3}))
        leaving = pb.ExecuteRequest(step_id=3, worker_epoch=epoch, finished_req_ids=["z"])
        leaving.num_scheduled_tokens["nope"] = 1  # fails: scheduled, and in no list
        stream.send(leaving)
        stream.send(_starting("z", [8, 9, 10, 11], epoch, step_id=4))
        stream.send(_decoding(5, epoch, {"z": 4}))  # the old "z" has 4 computed too
        stream.send(pb.ExecuteRequest(step_id=6, worker_epoch=epoch, finished_req_ids=["z"]))
        raise_for_error(stream.receive())
        [out] = raise_for_error(stream.receive()).outputs
        assert (out.req_id, out.num_computed_tokens) == ("z", 4)
        with pytest.raises(StepFailed) as unknown:
            raise_for_error(stream.receive())
        assert "num_scheduled_tokens['nope']" in unknown.value.message
        _failed_to_create(stream, 4)
        raise_for_error(stream.receive())
        assert stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 0
        stream.send(_starting("z", [8, 9, 10, 11], epoch, step_id=7))  # the id is free
        [out] = raise_for_error(stream.receive()).outputs
        assert (out.req_id, out.num_computed_tokens) == ("z", 4)
        stream.close()
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_a_failed_step_keeps_the_streams_memory_of_a_request_never_created(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """Step 1 was to create "u" and fails; step 2 finishes "u" and fails for a reason of
    its own: it changed nothing, so step 3's finish of "u" (the scheduler trying step 2
    again) is still the finish of a request this stream never had, and is dropped, not
    NOT_FOUND."""
    stub, epoch, _ = worker
    with ExecuteStreamCall(stub) as stream:
        creating = _starting("u", [5, 6, 7], epoch, step_id=1)
        creating.num_scheduled_tokens["nope"] = 1  # fails: scheduled, and in no list
        stream.send(creating)
        leaving = pb.ExecuteRequest(step_id=2, worker_epoch=epoch, finished_req_ids=["u"])
        leaving.num_scheduled_tokens["nope"] = 1
        stream.send(leaving)
        stream.send(pb.ExecuteRequest(step_id=3, worker_epoch=epoch, finished_req_ids=["u"]))
        for step in (1, 2):
            with pytest.raises(StepFailed) as failed:
                raise_for_error(stream.receive())
            assert "num_scheduled_tokens['nope']" in failed.value.message, step
        assert raise_for_error(stream.receive()).step_id == 3
        stream.close()
    assert wait_until_idle(stub, 30).num_running_requests == 0


@pytest.mark.parametrize(
    "bad",
    [
        pb.SamplingParams(temperature=-1.0),  # refused as the step's message converts
        pb.SamplingParams(structured_outputs=pb.StructuredOutputs(regex="(")),  # as it compiles
    ],
)
def test_a_request_refused_for_its_sampling_params_counts_as_never_created(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int], bad: pb.SamplingParams
) -> None:
    """Refused before it could run, a step's new request is remembered as one it failed
    to create, as when the step fails running: a later step scheduling it is NOT_FOUND
    naming the failed step, and a later step's finish of it is left out (that step
    decodes its others)."""
    stub, epoch, _ = worker
    with ExecuteStreamCall(stub) as stream:
        stream.send(_starting("b", [8, 9, 10], epoch, step_id=1))
        starting = _starting("a", [5, 6, 7], epoch, step_id=2)
        starting.new_requests[0].sampling_params.CopyFrom(bad)
        stream.send(starting)
        stream.send(_decoding(3, epoch, {"a": 3}))  # ahead: counts on step 2
        leaving = _decoding(4, epoch, {"b": 3})
        leaving.finished_req_ids.append("a")  # the scheduler drops it, decodes b
        stream.send(leaving)
        raise_for_error(stream.receive())
        _failed_to_create(stream, 2)
        [out] = raise_for_error(stream.receive()).outputs
        assert (out.req_id, out.num_computed_tokens) == ("b", 4)
        stream.close()
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_a_finished_requests_mask_is_left_out_with_it(
    worker: tuple[pb_grpc.WorkerServiceStub, int, int],
) -> None:
    """A step sent ahead with a grammar_bitmask for a request an earlier step finished
    runs for the others (the mask goes with the request's other entries)."""
    stub, epoch, _ = worker
    vocab = stub.GetInfo(pb.GetInfoRequest()).model.vocab_size
    every = b"\xff" * (-(-vocab // 32) * 4)
    with ExecuteStreamCall(stub) as stream:
        stream.send(
            pb.ExecuteRequest(
                step_id=1,
                worker_epoch=epoch,
                new_requests=[_new("a", [5, 6, 7], 1), _new("b", [8, 9], 9)],
                num_scheduled_tokens={"a": 3, "b": 2},
            )
        )
        masks = {"a": every, "b": every}  # sent before step 1's reply: "a" will have finished
        stream.send(_decoding(2, epoch, {"a": 3, "b": 2}, grammar_bitmask=masks))
        first = raise_for_error(stream.receive())
        assert {o.req_id for o in first.outputs if o.finish_reason} == {"a"}
        reply = stream.receive()
        assert list(reply.already_finished_req_ids) == ["a"]
        [out] = raise_for_error(reply).outputs
        assert (out.req_id, out.num_computed_tokens) == ("b", 3)
        stream.close()
    assert wait_until_idle(stub, 30).num_running_requests == 0


def test_get_info_states_the_depth(worker: tuple[pb_grpc.WorkerServiceStub, int, int]) -> None:
    stub, _, _ = worker
    assert stub.GetInfo(pb.GetInfoRequest()).limits.max_steps_in_flight == 4


def test_stream_refused_before_the_cache_is_set_up(tiny_dir: Path) -> None:
    with live_server() as (_, stub), ExecuteStreamCall(stub) as stream:
        stream.send(pb.ExecuteRequest(step_id=1))
        reply = stream.receive()
    assert reply.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "the worker is NEW: call InitDevice first" in reply.error.message
