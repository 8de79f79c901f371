"""The RPC fuzzer's driver (test_fuzz.py): sends calls to one live worker and judges them.

`EXPECTED` and `CLIENT_ERRORS` are the statuses each RPC may answer with; a
`Fuzzer` sends each call with a deadline, fails on any other status, keeps the
greedy keeper requests decoding between fuzzed steps, finishes what fuzzed
steps started, and counts calls per RPC and status for the failure message.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
from driver import code_of, details_of, greedy
from google.protobuf.message import Message
from rpc.fuzz_calls import Call, summary
from rpc.fuzz_values import KEEPERS

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

Stub = pb_grpc.WorkerServiceStub
Code = grpc.StatusCode
TIMEOUT_S = 30.0  # per call: a hang is DEADLINE_EXCEEDED, which fails the test
DECODE_EVERY = 20  # live phase: the keepers decode one token every this many calls
CHECK_EVERY = 40  # requests fuzzed steps started are finished, the rest checked, this often
NUM_BLOCKS, BLOCK_SIZE = 4096, 16  # the KV budget bring_up sets
KEEPER_MAX_TOKENS = 480


# Every answer must be OK or one of these documented client errors; UNAVAILABLE
# only comes from a draining worker, which this one never is.
CLIENT_ERRORS = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.FAILED_PRECONDITION,
        Code.RESOURCE_EXHAUSTED,
        Code.UNIMPLEMENTED,
        Code.OUT_OF_RANGE,
    }
)
ANSWERS = CLIENT_ERRORS | {Code.OK}
# Tighter expectations where the request can only be refused one way.
EXPECTED: dict[str, frozenset[Code]] = {
    "Sleep": frozenset({Code.INVALID_ARGUMENT}),  # only invalid levels are sent
    # Random names and paths: no adapter directory is ever found.
    "AddLora": frozenset({Code.NOT_FOUND, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}),
    "RemoveLora": frozenset({Code.NOT_FOUND, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}),
    "PinLora": frozenset({Code.NOT_FOUND, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}),
    "ListLoras": frozenset({Code.OK}),
    "LoadModel": frozenset(
        {Code.OK, Code.NOT_FOUND, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION}
    ),
    "GetInfo": frozenset({Code.OK}),
    "CheckHealth": frozenset({Code.OK}),
    "WakeUp": frozenset({Code.OK}),  # awake: a no-op
    "ResetPrefixCache": frozenset({Code.OK}),
}


# ------------------------------------------------------------------ the driver
@dataclass
class Keeper:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    live: bool = True


class Fuzzer:
    """Sends calls, checks every status, keeps the keepers decoding, counts."""

    def __init__(self, stub: Stub, tiny: Path) -> None:
        self.stub = stub
        self.tiny = tiny
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=TIMEOUT_S)
        self.epoch = info.worker_epoch
        self.model_path = info.model.model_path
        self.counts: Counter[tuple[str, str]] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)  # waiting on each RPC
        self.keepers: dict[str, Keeper] = {}
        self.maybe_live: set[str] = set()  # Execute requests fuzzed steps started
        self.live_phase = False
        self.recent: deque[tuple[str, str, Message]] = deque(maxlen=CHECK_EVERY)
        self.sent = 0
        self.step_id = 0

    # ------------------------------------------------------------- calls
    def invoke(self, rpc: str, message: Message) -> tuple[Code, Any, str]:
        method: Callable[..., Any] = getattr(self.stub, rpc)
        start = time.perf_counter()
        try:
            if rpc == "Generate":
                response: Any = list(method(message, timeout=TIMEOUT_S))
            else:
                response = method(message, timeout=TIMEOUT_S)
        except grpc.RpcError as err:
            code, response, details = code_of(err), None, details_of(err)
        else:
            code, details = Code.OK, ""
        self.seconds[rpc] += time.perf_counter() - start
        self.counts[(rpc, code.name)] += 1
        self.recent.append((rpc, code.name, message))
        return code, response, details

    def fail(self, why: str, message: Message | None = None) -> NoReturn:
        request = f"\nrequest: {summary(message, 4000)}" if message is not None else ""
        recent = "\n".join(f"  {rpc} -> {code}: {summary(m, 300)}" for rpc, code, m in self.recent)
        raise AssertionError(f"{why}{request}\n{self.table()}\nthe last calls:\n{recent}")

    def expect(self, rpc: str, message: Message, codes: Iterable[Code]) -> Any:
        code, response, details = self.invoke(rpc, message)
        if code not in codes:
            self.fail(f"{rpc} answered {code.name}: {details!r}", message)
        return response

    def send(self, call: Call) -> None:
        """One fuzzed call; every few, a keeper step and a clean-up."""
        message = self.build(call)
        code, response, details = self.invoke(call.rpc, message)
        allowed = EXPECTED.get(call.rpc, ANSWERS)
        if code not in allowed:
            self.fail(f"{call.rpc} answered {code.name}: {details!r}", message)
        if code is Code.OK:
            self.accepted(call.rpc, message, response)
        self.sent += 1
        if self.maybe_live and not self.live_phase:
            self.cleanup()  # at once, so that the lifecycle calls find the worker idle
        if self.sent % CHECK_EVERY == 0:
            self.checkpoint()
        if self.live_phase and self.sent % DECODE_EVERY == 0:
            self.keeper_step()

    def build(self, call: Call) -> Message:
        if call.rpc != "Execute":
            return call.message
        assert isinstance(call.message, pb.ExecuteRequest)
        message = pb.ExecuteRequest()
        message.CopyFrom(call.message)
        epoch = call.epoch
        if isinstance(epoch, str):
            epoch = {"current": 0, "next": 1, "previous": -1}[epoch] + self.epoch
        message.worker_epoch = epoch
        for cached in message.cached_requests:
            keeper = self.keepers.get(cached.req_id)
            if keeper is not None and cached.num_computed_tokens == keeper.computed:
                cached.num_computed_tokens += 1  # a keeper is only ever named wrongly
        return message

    def accepted(self, rpc: str, message: Any, response: Any) -> None:
        """Checks an OK answer and tracks what it started."""
        if rpc == "LoadModel":
            same = pb.LoadModelRequest(model=str(self.tiny))
            if message != same or response.worker_epoch != self.epoch:
                self.fail("LoadModel accepted a spec other than the loaded one", message)
        if self.live_phase and rpc == "DetermineMemory":
            self.fail("DetermineMemory profiled while requests were live", message)
        budget = (NUM_BLOCKS, BLOCK_SIZE)
        if (
            self.live_phase
            and rpc == "InitCache"
            and (response.num_blocks, response.block_size) != budget
        ):
            self.fail("InitCache changed the budget while requests were live", message)
        if rpc != "Execute":
            return
        named = {r.req_id for r in message.new_requests}
        named |= {r.req_id for r in message.cached_requests}
        named |= set(message.num_scheduled_tokens)
        if named & set(self.keepers):
            self.fail("Execute accepted a step that names a keeper wrongly", message)
        self.maybe_live -= set(message.finished_req_ids)
        self.maybe_live |= named | set(message.preempted_req_ids)
        for out in response.outputs:
            if out.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                self.maybe_live.discard(out.req_id)

    def checkpoint(self) -> None:
        """Nothing but the keepers may be left running, and the engine met no error."""
        self.cleanup()
        health = self.expect("CheckHealth", pb.CheckHealthRequest(), (Code.OK,))
        live = sum(k.live for k in self.keepers.values()) if self.live_phase else 0
        left = (health.num_running_requests, health.num_preempted_requests)
        if left != (live, 0) or not health.healthy or health.last_error:
            self.fail(f"after the last calls, expected {live} running requests: {health}")

    def cleanup(self) -> None:
        """Finishes the Execute requests that fuzzed steps started (one per step)."""
        for req_id in sorted(self.maybe_live):
            step = pb.ExecuteRequest(
                step_id=self.next_step(), worker_epoch=self.epoch, finished_req_ids=[req_id]
            )
            self.expect("Execute", step, (Code.OK, Code.NOT_FOUND))
        self.maybe_live.clear()

    def next_step(self) -> int:
        self.step_id += 1
        return self.step_id

    # ----------------------------------------------------------- keepers
    def start_keepers(self) -> None:
        self.keepers = {rid: Keeper(prompt) for rid, prompt in KEEPERS.items()}
        params = greedy(KEEPER_MAX_TOKENS, ignore_eos=True)
        step = pb.ExecuteRequest(
            step_id=self.next_step(),
            worker_epoch=self.epoch,
            new_requests=[
                pb.NewRequest(req_id=rid, prompt_token_ids=k.prompt, sampling_params=params)
                for rid, k in self.keepers.items()
            ],
            num_scheduled_tokens={rid: len(k.prompt) for rid, k in self.keepers.items()},
        )
        self.record(step, self.expect("Execute", step, (Code.OK,)))
        self.live_phase = True

    def keeper_step(self) -> None:
        live = {rid: k for rid, k in self.keepers.items() if k.live}
        if not live:
            return
        step = pb.ExecuteRequest(
            step_id=self.next_step(),
            worker_epoch=self.epoch,
            cached_requests=[
                pb.CachedRequest(req_id=rid, num_computed_tokens=k.computed)
                for rid, k in live.items()
            ],
            num_scheduled_tokens=dict.fromkeys(live, 1),
        )
        self.record(step, self.expect("Execute", step, (Code.OK,)))

    def record(self, step: pb.ExecuteRequest, response: pb.ExecuteResponse) -> None:
        outputs = {out.req_id: out for out in response.outputs}
        for req_id in step.num_scheduled_tokens:
            out = outputs.get(req_id)
            keeper = self.keepers[req_id]
            if out is None or len(out.sampled_token_ids) != 1:
                self.fail(f"keeper {req_id} did not sample one token: {out}", step)
            keeper.tokens.extend(out.sampled_token_ids)
            keeper.computed = out.num_computed_tokens
            keeper.live = out.finish_reason == pb.FINISH_REASON_UNSPECIFIED

    def finish_keepers(self) -> None:
        live = [rid for rid, k in self.keepers.items() if k.live]
        step = pb.ExecuteRequest(
            step_id=self.next_step(), worker_epoch=self.epoch, finished_req_ids=live
        )
        self.expect("Execute", step, (Code.OK,))
        self.live_phase = False

    # ------------------------------------------------------------ report
    def total(self) -> int:
        return sum(self.counts.values())

    def table(self) -> str:
        """Calls per RPC and status code, and the seconds spent waiting on each RPC."""
        codes = sorted({code for _, code in self.counts}, key=lambda c: (c != "OK", c))
        rpcs = sorted({rpc for rpc, _ in self.counts})
        rows = [["RPC", *codes, "total", "seconds"]]
        for rpc in rpcs:
            counts = [self.counts[(rpc, code)] for code in codes]
            rows.append([rpc, *map(str, counts), str(sum(counts)), f"{self.seconds[rpc]:.1f}"])
        totals = [sum(self.counts[(rpc, code)] for rpc in rpcs) for code in codes]
        seconds = sum(self.seconds.values())
        rows.append(["total", *map(str, totals), str(self.total()), f"{seconds:.1f}"])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(pairs))
            for pairs in (zip(row, widths, strict=True) for row in rows)
        ]
        return "calls per RPC and status code:\n" + "\n".join(lines)
