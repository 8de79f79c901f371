"""A seeded fuzz of ExecuteStream: run-ahead steps mixed with faults, and the books balance.

Each round opens a stream at a random depth and drives random requests through
it, one step ahead or more, while injecting faults: an unknown req_id (the step
fails with NOT_FOUND), an invalid new request (INVALID_ARGUMENT), a
finished_req_ids entry naming a request the stream already finished (skipped),
and now and then the stream is cancelled midway. The driver resynchronises
after a failed step the way a scheduler would: it reads the replies in flight
(the steps that counted on the failed one fail too) and rebuilds its view from
the replies. Every request that is not cancelled must end exactly once with
exactly the tokens its stopping rule allows, each reply's num_computed_tokens
must match the tokens received so far (no token lost or duplicated), no call
may hang (every stream has a deadline), and the worker must stay SERVING with
nothing left behind.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from driver import bring_up, greedy, live_server, wait_until_idle

from mlx_worker_svc.client.step_stream import ExecuteStreamCall
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

ROUNDS = 12
_OK_FAILURES = {grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]}


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: pb.SamplingParams
    expected: int  # tokens its stopping rule gives
    tokens: list[int] = field(default_factory=list)
    finishes: int = 0
    created = False
    computed = 0  # confirmed by the replies
    predicted = 0  # counting the steps in flight
    length = 0


class _Round:
    def __init__(self, stub: pb_grpc.WorkerServiceStub, epoch: int, eos: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.epoch, self.depth = epoch, self.rng.randint(1, 4)
        self.stream = ExecuteStreamCall(stub, timeout=120)
        self.reqs: dict[str, _Req] = {}
        for i in range(self.rng.randint(1, 6)):
            prompt = [self.rng.randrange(3, 5000) for _ in range(self.rng.randint(1, 20))]
            n = self.rng.randint(1, 9)
            params = greedy(n, ignore_eos=True)
            if self.rng.random() < 0.3:  # ends by EOS after min_tokens
                params.ignore_eos, params.max_tokens, params.min_tokens = False, 40, n - 1
                params.logit_bias[eos] = 100.0
            r = _Req(f"s{seed}-r{i}", prompt, params, n)
            r.length = len(prompt)
            self.reqs[r.req_id] = r
        self.in_flight: deque[pb.ExecuteRequest] = deque()
        self.failures = 0
        self.step = 0

    def live(self) -> list[_Req]:
        return [r for r in self.reqs.values() if not r.finishes]

    def build(self) -> pb.ExecuteRequest:
        request = pb.ExecuteRequest(step_id=self.step, worker_epoch=self.epoch)
        self.step += 1
        for r in self.live():
            if not r.created and r.predicted == 0 and r.req_id not in _new_ids(self.in_flight):
                request.new_requests.add(
                    req_id=r.req_id, prompt_token_ids=r.prompt, sampling_params=r.params
                )
            elif r.created or r.req_id in _new_ids(self.in_flight):
                request.cached_requests.add(req_id=r.req_id, num_computed_tokens=r.predicted)
            request.num_scheduled_tokens[r.req_id] = r.length - r.predicted
            r.predicted, r.length = r.length, r.length + 1
        fault = self.rng.random()
        if fault < 0.08:
            request.cached_requests.add(req_id="nobody", num_computed_tokens=0)
            request.num_scheduled_tokens["nobody"] = 1
        elif fault < 0.14:
            request.new_requests.add(req_id=f"bad{self.step}", prompt_token_ids=[1])
            request.new_requests[-1].sampling_params.top_p = 7.0
        elif fault < 0.3:
            done = [r.req_id for r in self.reqs.values() if r.finishes]
            if done:
                request.finished_req_ids.append(self.rng.choice(done))
        return request

    def apply(self, sent: pb.ExecuteRequest, reply: pb.ExecuteStreamResponse) -> bool:
        """Books a reply; False if the step failed."""
        assert reply.step_id == sent.step_id
        if reply.HasField("error"):
            assert reply.error.code in _OK_FAILURES, reply.error
            return False
        for new in sent.new_requests:
            self.reqs[new.req_id].created = True
        for out in reply.result.outputs:
            r = self.reqs[out.req_id]
            r.tokens.extend(out.sampled_token_ids)
            assert out.num_computed_tokens == len(r.prompt) + len(r.tokens) - 1, (r, out)
            r.computed = out.num_computed_tokens
            r.finishes += out.finish_reason != pb.FINISH_REASON_UNSPECIFIED
        return True

    def resync(self) -> None:
        """After a failed step: drain the steps in flight, then trust only the replies."""
        while self.in_flight:
            self.apply(self.in_flight.popleft(), self.stream.receive())
        for r in self.reqs.values():
            r.predicted = r.computed if r.created else 0
            r.length = len(r.prompt) + len(r.tokens)

    def run(self) -> bool:
        """Drives the round; False if it was cancelled midway."""
        while self.live() or self.in_flight:
            if self.rng.random() < 0.04:
                self.stream.cancel()
                return False
            if self.live() and len(self.in_flight) < self.depth:
                request = self.build()
                self.stream.send(request)
                self.in_flight.append(request)
                continue
            if not self.apply(self.in_flight.popleft(), self.stream.receive()):
                self.failures += 1
                self.resync()
        self.stream.close()
        return True


def _new_ids(steps: deque[pb.ExecuteRequest]) -> set[str]:
    return {new.req_id for step in steps for new in step.new_requests}


def test_fuzzed_streams_lose_and_duplicate_nothing(tiny_dir: Path) -> None:
    completed = cancelled = failures = 0
    with live_server() as (_, stub):
        epoch = bring_up(stub, tiny_dir)
        eos = stub.GetInfo(pb.GetInfoRequest()).model.eos_token_ids[0]
        for seed in range(ROUNDS):
            rnd = _Round(stub, epoch, eos, seed)
            if not rnd.run():
                cancelled += 1
            else:
                completed += 1
                for r in rnd.reqs.values():
                    assert (r.finishes, len(r.tokens)) == (1, r.expected), r
            failures += rnd.failures
            health = wait_until_idle(stub, 30)  # a cancelled stream's requests are freed
            assert health.state == pb.WORKER_STATE_SERVING and health.healthy
    print(f"rounds completed {completed}, cancelled {cancelled}, failed steps {failures}")
    assert completed and cancelled and failures
