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

import os
import re
import signal
from pathlib import Path

import grpc
import pytest
from driver import code_of, details_of, drive, epoch_of, greedy
from engine.group.ranks import MAX_TOKENS, Group, Single
from grpcurl_cli import Grpcurl, grpcurl_binary
from mlx_lm.models import llama
from processes import Fleet, Proc, distinct_prompts, run_streams, token_request

from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.reports import Parallelism
from mlx_worker_svc.engine.model import sharding
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


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
    # Both ranks on this machine share its memory: each sizes KV in half of it.
    ask = pb.DetermineMemoryRequest(max_num_batched_tokens=16)
    mine, alone = group.stub.DetermineMemory(ask), single.stub.DetermineMemory(ask)
    assert mine.recommended_working_set_bytes == alone.recommended_working_set_bytes
    half = alone.available_kv_bytes / 2
    assert abs(mine.available_kv_bytes - half) < 64 << 20, (mine, alone)
    assert mine.suggested_num_blocks < alone.suggested_num_blocks
    # A repeat naming the group's backend, or leaving it to the worker, is the same call.
    for method in ("", "ring"):
        again = group.stub.InitDevice(
            pb.InitDeviceRequest(distributed_init_method=method, world_size=2)
        )
        assert (again.device.world_size, again.device.backend) == (2, "ring")
    with pytest.raises(grpc.RpcError) as info_error:
        group.stub.InitDevice(pb.InitDeviceRequest(distributed_init_method="mpi"))
    assert code_of(info_error.value) == grpc.StatusCode.FAILED_PRECONDITION
    assert "distributed_init_method 'mpi' (initialised with 'ring')" in details_of(info_error.value)


@pytest.mark.parametrize("batch", [1, 4])
def test_execute_gives_a_single_workers_tokens(group: Group, single: Single, batch: int) -> None:
    prompts = distinct_prompts(batch, 18 + batch, seed=batch)  # a whole KV block each
    params = greedy(MAX_TOKENS, ignore_eos=True)
    expected = single.tokens(prompts, params)
    stub = group.stub
    assert drive(stub, epoch_of(stub), prompts, max_tokens=MAX_TOKENS, params=params) == expected
    # Again in chunks of 3, each prompt's first block now from every rank's prefix cache.
    assert stub.GetInfo(pb.GetInfoRequest()).kv.prefix_cache_blocks >= batch
    got = drive(stub, epoch_of(stub), prompts, max_tokens=MAX_TOKENS, chunk=3, params=params)
    assert got == expected
    assert stub.ResetPrefixCache(pb.ResetPrefixCacheRequest()).freed_blocks >= batch
    assert drive(stub, epoch_of(stub), prompts, max_tokens=MAX_TOKENS, params=params) == expected


def test_seeded_sampling_gives_a_single_workers_tokens(group: Group, single: Single) -> None:
    prompts = distinct_prompts(4, 6, seed=11)
    params = pb.SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = single.tokens(prompts, params)
    assert drive(
        group.stub, epoch_of(group.stub), prompts, max_tokens=MAX_TOKENS, params=params
    ) == (expected)


def test_structured_outputs_give_a_single_workers_tokens(group: Group, single: Single) -> None:
    # Every rank compiles and advances its own copy of the grammar, deterministically.
    prompts = distinct_prompts(4, 6, seed=12)
    spec = pb.StructuredOutputs(regex="[a-z]{2,8}(-[0-9]{1,3}){1,3}")
    params = pb.SamplingParams(temperature=0.8, seed=5, max_tokens=64, structured_outputs=spec)
    expected = single.tokens(prompts, params)
    got = drive(group.stub, epoch_of(group.stub), prompts, max_tokens=64, params=params)
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
    # A group holds no adapters: one named is NOT_FOUND, as on a worker without it (it
    # once ran the base model's tokens under the adapter's name).
    named = token_request(prompts[0], MAX_TOKENS)
    named.lora_name = "absent"
    with pytest.raises(grpc.RpcError) as refused:
        list(group.stub.Generate(named))
    assert code_of(refused.value) == grpc.StatusCode.NOT_FOUND
    assert "GenerateRequest.lora_name" in details_of(refused.value)
    listed = group.stub.ListLoras(pb.ListLorasRequest())
    assert (list(listed.names), listed.max_loras) == ([], 0)


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


def test_a_killed_rank_0_is_the_commands_exit_status(tiny_dir: Path) -> None:
    """Rank 0 killed by a signal prints no exit line: the command exits 128 + the
    signal, as a shell reports it (it once exited 1)."""
    group = Group(tiny_dir)
    try:
        group.signal_rank(0, signal.SIGKILL)
        assert group.exit_status() == 128 + signal.SIGKILL, group.output
    finally:
        group.reap()
