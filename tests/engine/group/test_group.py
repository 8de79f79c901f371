"""Worker groups: two ranks over mx.distributed (ring backend on loopback) serving as one worker.

The module-wide group is `mlx-worker serve --world-size 2 --auto-init` on the tiny llama
(4 attention / 2 KV heads, so tensor parallel), which starts both ranks through
`mlx.launch`; rank 0 serves gRPC. It answers the parity, weight, grpcurl and fleet tests
against an in-process single worker on the same model, and is stopped by SIGTERM last.
Two more groups are broken on purpose: one by killing the follower, one (a pipeline, on a
llama whose heads do not divide by 2) by stopping it with SIGSTOP, a hang only the
watchdog can see. Every process (launcher, mlx.launch, ranks) is reaped, even when a
test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from driver import bring_up, code_of, details_of, drive, greedy, live_server
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpcurl_cli import SERVICE, Grpcurl, grpcurl_binary
from mlx_lm.models import llama
from processes import Fleet, Proc, Stream, distinct_prompts, run_streams, token_request
from tiny_model import build_tiny_model

from mlx_worker_svc.cli.group_launch import free_ports
from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.reports import Parallelism
from mlx_worker_svc.engine.model import sharding
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import WorkerServer

WATCHDOG = 5.0  # --collective-timeout of the groups broken on purpose
MAX_TOKENS = 8


class Group:
    """A 2-rank group on the tiny model, and a stub to rank 0.

    By default started as a user would, `mlx-worker serve --world-size 2`, which runs
    mlx.launch. `direct` starts the two ranks itself with the two variables mlx.launch
    gives each rank of a ring on loopback (MLX_RANK, MLX_HOSTFILE): the same processes
    without mlx.launch, whose I/O loop keeps a core busy (and which SIGTERMs rank 0 when
    a rank dies), for the tests that break a group on purpose.
    """

    def __init__(self, model: Path, *options: str, hostfile: Path | None = None) -> None:
        args = ["serve", "--model", str(model), "--auto-init", "--port", "0"]
        args += ["--grace-seconds", "2", *options]
        if hostfile is None:
            self.procs = [Proc([*args, "--world-size", "2"])]
        else:
            base = free_ports(2)
            hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(2)]))
            env = {**os.environ, "MLX_HOSTFILE": str(hostfile)}
            self.procs = [Proc([*args, "--group"], {**env, "MLX_RANK": str(r)}) for r in range(2)]
        self.lead = self.procs[0]
        try:
            self.port = int(self.lead.wait_for(r"listening on [\d.]+:(\d+)").group(1))
            self.lead.wait_for(r"^ready:")
        except BaseException:
            self.reap()
            raise
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.WorkerServiceStub(self.channel)

    @property
    def output(self) -> str:
        return "".join(proc.output for proc in self.procs)

    @property
    def pids(self) -> dict[int, int]:
        """Rank -> pid, from the line each rank prints when it joins."""
        found = re.findall(r"group rank (\d) of 2 \(ring\) pid (\d+)", self.output)
        return {int(rank): int(pid) for rank, pid in found}

    def signal_rank(self, rank: int, signum: int) -> None:
        os.kill(self.pids[rank], signum)

    def exit_status(self, timeout: float = 60.0) -> int:
        """The exit status of rank 0 (through the launcher, when there is one)."""
        return self.lead.proc.wait(timeout=timeout)

    def reap(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            proc.reap()


class HealthWatch(threading.Thread):
    """Records every status `grpc.health.v1.Health/Watch` reports for the worker service."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.statuses: list[int] = []
        self.serving = threading.Event()
        self.not_serving = threading.Event()
        self.start()
        assert self.serving.wait(30), "health never reported SERVING"

    def run(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        watch = health_pb2.HealthCheckRequest(service=SERVICE)
        try:
            for answer in stub.Watch(watch, timeout=120):
                self.statuses.append(answer.status)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    self.serving.set()
                else:
                    self.not_serving.set()
        except grpc.RpcError:
            pass  # the server went away

    def close(self) -> None:
        self.channel.close()
        self.join(timeout=10)


class Single:
    """An in-process single worker on the same model: the reference, and a fleet member."""

    def __init__(self, server: WorkerServer, stub: pb_grpc.WorkerServiceStub, model: Path):
        self.port, self.stub = server.port, stub
        self.epoch = bring_up(stub, model)

    def tokens(self, prompts: list[list[int]], params: pb.SamplingParams) -> list[list[int]]:
        return drive(self.stub, self.epoch, prompts, max_tokens=params.max_tokens, params=params)


@pytest.fixture(scope="module")
def single(tiny_dir: Path) -> Iterator[Single]:
    with live_server() as (server, stub):
        yield Single(server, stub, tiny_dir)


@pytest.fixture(scope="module")
def group(tiny_dir: Path) -> Iterator[Group]:
    started = Group(tiny_dir)
    try:
        yield started
    finally:
        started.reap()


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A tiny llama whose 6 / 3 heads do not divide by 2: split into a pipeline."""
    heads = {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}
    return build_tiny_model(
        tmp_path_factory.mktemp("pipeline") / "model", smollm_dir, overrides=heads
    )


@pytest.fixture
def start_group(tiny_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Group]]:
    """Starts groups (ranks started directly) that a test breaks; reaped afterwards."""
    groups: list[Group] = []

    def start(*options: str, model: Path = tiny_dir) -> Group:
        groups.append(Group(model, *options, hostfile=tmp_path / f"hosts{len(groups)}.json"))
        return groups[-1]

    yield start
    for started in groups:
        started.reap()


def _epoch(stub: pb_grpc.WorkerServiceStub) -> int:
    return int(stub.GetInfo(pb.GetInfoRequest()).worker_epoch)


# ------------------------------------------------------------ choosing a split
@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "expected"),
    [
        (4, 2, 2, Parallelism.TENSOR),
        (6, 3, 2, Parallelism.PIPELINE),  # a llama stage per rank
        (6, 3, 3, Parallelism.TENSOR),
        (4, 2, 3, None),  # neither: 2 layers cannot make 3 stages
    ],
)
def test_tensor_parallel_where_the_heads_divide_else_a_pipeline(
    heads: int, kv_heads: int, size: int, expected: Parallelism | None
) -> None:
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=heads * 8,
        num_hidden_layers=2,
        intermediate_size=32,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=64,
    )
    model = llama.Model(args)
    if expected is None:
        with pytest.raises(InvalidArgument, match=f"cannot be split over {size} ranks"):
            sharding.choose(model, size)
    else:
        assert sharding.choose(model, size) is expected


# ------------------------------------------------------------------ the group
def test_the_group_reports_its_ranks_and_each_holds_half_the_weights(
    group: Group, single: Single
) -> None:
    info = group.stub.GetInfo(pb.GetInfoRequest())
    device = info.device
    assert (device.world_size, device.backend) == (2, "ring")
    assert [r.rank for r in device.ranks] == [0, 1]
    assert [r.pid for r in device.ranks] == [group.pids[0], group.pids[1]]
    assert [r.local_rank for r in device.ranks] == [0, 1]
    assert all(r.host and r.total_memory_bytes > 0 for r in device.ranks)
    assert info.model.parallelism == pb.PARALLELISM_TENSOR
    assert info.model.num_attention_heads == 4 and info.model.num_kv_heads == 2
    whole = single.stub.GetInfo(pb.GetInfoRequest()).model
    assert whole.parallelism == pb.PARALLELISM_NONE
    shares = [r.weight_bytes / whole.weight_bytes for r in device.ranks]
    print(
        f"weight bytes: whole {whole.weight_bytes}, ranks {[r.weight_bytes for r in device.ranks]}"
    )
    assert all(abs(share - 0.5) <= 0.05 for share in shares), shares
    assert info.model.weight_bytes == device.ranks[0].weight_bytes


@pytest.mark.parametrize("batch", [1, 4])
def test_execute_gives_a_single_workers_tokens(group: Group, single: Single, batch: int) -> None:
    prompts = distinct_prompts(batch, 18 + batch, seed=batch)  # a whole KV block each
    params = greedy(MAX_TOKENS, ignore_eos=True)
    expected = single.tokens(prompts, params)
    stub = group.stub
    assert drive(stub, _epoch(stub), prompts, max_tokens=MAX_TOKENS, params=params) == expected
    # Again in chunks of 3, each prompt's first block now from every rank's prefix cache.
    assert stub.GetInfo(pb.GetInfoRequest()).kv.prefix_cache_blocks >= batch
    got = drive(stub, _epoch(stub), prompts, max_tokens=MAX_TOKENS, chunk=3, params=params)
    assert got == expected
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest()).freed_blocks >= batch
    assert drive(stub, _epoch(stub), prompts, max_tokens=MAX_TOKENS, params=params) == expected


def test_seeded_sampling_gives_a_single_workers_tokens(group: Group, single: Single) -> None:
    prompts = distinct_prompts(4, 6, seed=11)
    params = pb.SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = single.tokens(prompts, params)
    assert drive(group.stub, _epoch(group.stub), prompts, max_tokens=MAX_TOKENS, params=params) == (
        expected
    )


def test_structured_outputs_give_a_single_workers_tokens(group: Group, single: Single) -> None:
    # Every rank compiles and advances its own copy of the grammar, deterministically.
    prompts = distinct_prompts(4, 6, seed=12)
    spec = pb.StructuredOutputs(regex="[a-z]{2,8}(-[0-9]{1,3}){1,3}")
    params = pb.SamplingParams(temperature=0.8, seed=5, max_tokens=64, structured_outputs=spec)
    expected = single.tokens(prompts, params)
    got = drive(group.stub, _epoch(group.stub), prompts, max_tokens=64, params=params)
    assert got == expected
    for tokens in got:
        ask = pb.DetokenizeRequest(token_ids=tokens, skip_special_tokens=True)
        text = group.stub.Detokenize(ask).text
        assert re.fullmatch("[a-z]{2,8}(-[0-9]{1,3}){1,3}", text), text


@pytest.mark.parametrize("batch", [1, 4])
def test_generate_gives_a_single_workers_tokens(group: Group, single: Single, batch: int) -> None:
    prompts = distinct_prompts(batch, 7, seed=20 + batch)
    expected = single.tokens(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    streams = run_streams(group.stub, [token_request(p, MAX_TOKENS) for p in prompts])
    assert [s.error for s in streams] == [None] * batch
    assert [s.tokens for s in streams] == expected
    # Unseeded sampling draws from each rank's own generator: rank 0 checks at the
    # next step that the follower drew the same tokens, or the group breaks.
    sampled = pb.GenerateRequest(
        prompt_token_ids=prompts[0],
        sampling_params=pb.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    streams = run_streams(group.stub, [sampled] * batch)
    assert [len(s.tokens) for s in streams] == [MAX_TOKENS] * batch
    health = group.stub.CheckHealth(pb.CheckHealthRequest(deep=True))
    assert health.healthy and health.deep_check_ns > 0, health


def test_sleep_and_wake_up_apply_on_every_rank(group: Group, single: Single) -> None:
    slept = group.stub.Sleep(pb.SleepRequest(level=2))
    assert slept.state == pb.WORKER_STATE_SLEEPING
    ranks = group.stub.GetInfo(pb.GetInfoRequest()).device.ranks
    assert [r.weight_bytes for r in ranks] == [0, 0]
    woke = group.stub.WakeUp(pb.WakeUpRequest())
    assert woke.state == pb.WORKER_STATE_SERVING
    ranks = group.stub.GetInfo(pb.GetInfoRequest()).device.ranks
    assert all(r.weight_bytes > 0 for r in ranks)
    prompts = distinct_prompts(2, 6, seed=71)
    params = greedy(MAX_TOKENS, ignore_eos=True)
    expected = single.tokens(prompts, params)
    got = drive(group.stub, woke.worker_epoch, prompts, max_tokens=MAX_TOKENS, params=params)
    assert got == expected


def test_grpcurl_shows_the_group_and_generates(group: Group) -> None:
    grpcurl = Grpcurl(grpcurl_binary(), group.port)
    device = grpcurl.unary("InitDevice", {})["device"]  # the lifecycle is done: a no-op
    assert (device["world_size"], device["backend"], len(device["ranks"])) == (2, "ring", 2)
    info = grpcurl.unary("GetInfo", {})
    assert info["model"]["parallelism"] == "PARALLELISM_TENSOR"
    assert [int(r["weight_bytes"]) > 0 for r in info["device"]["ranks"]] == [True, True]
    body = {"prompt": "hello", "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS}}
    messages = grpcurl.stream("Generate", body)
    assert messages[-1]["finish_reason"] in {"FINISH_REASON_LENGTH", "FINISH_REASON_EOS"}
    assert "".join(m.get("text", "") for m in messages).strip()


def test_a_fleet_drives_a_group_beside_a_single_worker(group: Group, single: Single) -> None:
    prompts = distinct_prompts(8, 6, seed=31)
    expected = single.tokens(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    targets = [f"127.0.0.1:{group.port}", f"127.0.0.1:{single.port}"]
    workers = [arg for target in targets for arg in ("--worker", target)]
    proc = Proc(["fleet", *workers, "--port", "0", "--routing", "least-loaded"])
    try:
        fleet = Fleet(proc, targets)
        with fleet.channel:
            fleet.wait(lambda s: all(w.up for w in s.workers), "both workers up")
            streams = run_streams(fleet.stub, [token_request(p, MAX_TOKENS) for p in prompts])
            assert [s.error for s in streams] == [None] * len(prompts)
            assert [s.tokens for s in streams] == expected
            finished = {w.target: w.num_finished for w in fleet.status().workers}
        assert all(finished.values()) and sum(finished.values()) == len(prompts), finished
    finally:
        proc.reap()


def test_sigterm_stops_every_rank(group: Group) -> None:
    pids = group.pids
    os.kill(group.lead.proc.pid, signal.SIGTERM)  # the launcher passes it to rank 0
    assert group.exit_status() == 0, group.output
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "rank 0 exits with status 0" in group.output


# ------------------------------------------------------------ broken groups
def _in_flight(stub: pb_grpc.WorkerServiceStub, prompts: list[list[int]]) -> list[object]:
    """Starts long Generate streams and an Execute loop; returns them once all produce."""
    calls = [Stream(stub, token_request(p, 400)) for p in prompts[:2]]
    for call in calls:
        call.start()
    execute = ExecuteLoop(stub, prompts[2])
    for call in calls:
        assert call.first_token.wait(60), "a Generate stream produced nothing"
    assert execute.stepped.wait(60), "Execute made no step"
    return [*calls, execute]


class ExecuteLoop(threading.Thread):
    """Drives one long request through Execute until a step fails."""

    def __init__(self, stub: pb_grpc.WorkerServiceStub, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.stub, self.prompt = stub, prompt
        self.error: grpc.RpcError | None = None
        self.stepped = threading.Event()
        self.elapsed = 0.0
        self.start()

    def run(self) -> None:
        start = time.monotonic()
        try:
            drive(
                self.stub,
                _epoch(self.stub),
                [self.prompt],
                max_tokens=400,
                params=greedy(400, ignore_eos=True),
                before_step=lambda request: self.stepped.set() if request.step_id else None,
            )
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.elapsed = time.monotonic() - start


def _wait_all_unavailable(calls: list[object], since: float) -> float:
    """Waits for every call to end; each with UNAVAILABLE naming rank 1. Returns the last end."""
    for call in calls:
        assert isinstance(call, threading.Thread)
        call.join(timeout=WATCHDOG + 30)
        assert not call.is_alive(), "a call hung"
        error = getattr(call, "error", None)
        assert error is not None and code_of(error) == grpc.StatusCode.UNAVAILABLE, error
        assert "rank 1 did not answer" in details_of(error), details_of(error)
    return time.monotonic() - since


def _break_follower(group: Group, signum: int, seed: int) -> tuple[float, list[object]]:
    """Sends `signum` to rank 1 while calls run: every call must end UNAVAILABLE naming
    rank 1, and health turn NOT_SERVING. Returns the seconds until the last call ended."""
    health = HealthWatch(group.port)
    try:
        calls = _in_flight(group.stub, distinct_prompts(3, 6, seed=seed))
        since = time.monotonic()
        group.signal_rank(1, signum)
        took = _wait_all_unavailable(calls, since)
        assert health.not_serving.wait(10), health.statuses
    finally:
        health.close()
    return took, calls


def test_killing_the_follower_ends_every_call_unavailable(
    start_group: Callable[..., Group],
) -> None:
    group = start_group("--collective-timeout", str(WATCHDOG), "--death-exit-seconds", "2")
    took, _ = _break_follower(group, signal.SIGKILL, seed=41)
    print(f"follower killed: every call ended UNAVAILABLE within {took:.2f} s")
    assert took <= WATCHDOG + 2.0
    assert group.exit_status() == 3


def test_a_hung_follower_trips_the_watchdog(
    start_group: Callable[..., Group], pipeline_dir: Path
) -> None:
    group = start_group(
        "--collective-timeout", str(WATCHDOG), "--death-exit-seconds", "2", model=pipeline_dir
    )
    # This group is a pipeline: rank 1 runs the first layer, rank 0 the second.
    assert group.stub.GetInfo(pb.GetInfoRequest()).model.parallelism == pb.PARALLELISM_PIPELINE
    prompts = distinct_prompts(4, 6, seed=61)
    params = greedy(MAX_TOKENS, ignore_eos=True)
    with live_server() as (server, stub):
        expected = Single(server, stub, pipeline_dir).tokens(prompts, params)
    assert drive(group.stub, _epoch(group.stub), prompts, max_tokens=MAX_TOKENS, params=params) == (
        expected
    )
    took, calls = _break_follower(group, signal.SIGSTOP, seed=51)
    print(f"follower stopped: every call ended UNAVAILABLE after {took:.2f} s")
    assert WATCHDOG - 0.5 <= took <= WATCHDOG + 2.0
    message = details_of(calls[0].error)  # type: ignore[attr-defined]
    assert f"did not finish within {WATCHDOG:.1f} s" in message, message
    assert group.exit_status() == 3
