"""Memory: measured bytes per block, the enforced KV budget, out-of-memory steps."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from driver import bring_up, code_of, details_of, drive, greedy, reference_tokens
from mlx_lm.models import llama
from tiny_model import build_tiny_model

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import WorkerServer

Stub = pb_grpc.WorkerServiceStub


def _prompt(length: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 4000 + 100 for i in range(length)]


class Stepper:
    """Sends Execute steps by hand, tracking computed counts and outputs."""

    def __init__(self, stub: Stub, epoch: int) -> None:
        self.stub, self.epoch, self.step_id = stub, epoch, 0
        self.computed: dict[str, int] = {}
        self.lengths: dict[str, int] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()

    def step(
        self,
        new: dict[str, list[int]] | None = None,
        schedule: dict[str, int] | None = None,
        finished: list[str] | None = None,
        max_tokens: int = 12,
    ) -> pb.ExecuteResponse:
        """One step; `schedule` counts default to 'everything left' for live requests."""
        new = new or {}
        live = [r for r in self.computed if r not in self.finished and r not in (finished or [])]
        counts = (
            schedule
            if schedule is not None
            else {r: self.lengths[r] + len(self.outputs[r]) - self.computed[r] for r in live}
        )
        for rid, prompt in new.items():
            counts.setdefault(rid, len(prompt))
        request = pb.ExecuteRequest(
            step_id=self.step_id,
            worker_epoch=self.epoch,
            new_requests=[
                pb.NewRequest(req_id=r, prompt_token_ids=p, sampling_params=greedy(max_tokens))
                for r, p in new.items()
            ],
            cached_requests=[
                pb.CachedRequest(req_id=r, num_computed_tokens=self.computed[r])
                for r in live
                if r in counts
            ],
            num_scheduled_tokens=counts,
            finished_req_ids=finished or [],
        )
        self.step_id += 1
        response = self.stub.Execute(request)
        for rid, prompt in new.items():
            self.computed[rid], self.lengths[rid], self.outputs[rid] = 0, len(prompt), []
        for rid in finished or []:
            self.finished.add(rid)
        for out in response.outputs:
            self.outputs[out.req_id] += out.sampled_token_ids
            self.computed[out.req_id] = out.num_computed_tokens
            if out.finish_reason:
                self.finished.add(out.req_id)
        return response

    def run_out(self, *ids: str) -> None:
        while any(r not in self.finished for r in ids):
            self.step(
                schedule={
                    r: self.lengths[r] + len(self.outputs[r]) - self.computed[r]
                    for r in ids
                    if r not in self.finished
                }
            )


def _health(stub: Stub) -> pb.CheckHealthResponse:
    return stub.CheckHealth(pb.CheckHealthRequest())


# ----------------------------------------------------------- bytes per block
@pytest.fixture(scope="module")
def head_dim_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    """A tiny llama whose head_dim (32) is not hidden_size / heads (16)."""
    return build_tiny_model(tmp_path_factory.mktemp("hd") / "model", smollm_dir, head_dim=32)


@pytest.mark.parametrize("which", ["tiny", "smollm", "head_dim"])
def test_bytes_per_block_matches_the_real_cache(
    which: str,
    server: WorkerServer,
    stub: Stub,
    request: pytest.FixtureRequest,
) -> None:
    model = request.getfixturevalue(
        {"tiny": "tiny_dir", "smollm": "smollm_f32_dir", "head_dim": "head_dim_dir"}[which]
    )  # SmolLM2's float32 copy: the same float32 KV as its 4-bit weights, prefilled fast
    epoch = bring_up(stub, model)
    per_block = stub.DetermineMemory(
        pb.DetermineMemoryRequest(max_num_batched_tokens=64, block_size=16)
    ).bytes_per_block
    # 256 tokens fill 16 whole blocks and exactly one growth step of mlx-lm's KVCache.
    Stepper(stub, epoch).step(new={"r": _prompt(300)}, schedule={"r": 256})
    real = server.worker.kv_nbytes("r")
    assert real > 0
    assert abs(real - 16 * per_block) <= 0.01 * real, (real, per_block)
    if which == "head_dim":
        # 2 layers x (K + V) x 2 KV heads x 32 head_dim x 4 bytes (float32) per token.
        assert per_block == 16 * 2 * 2 * 2 * 32 * 4


# ------------------------------------------------------------- the budget
def test_filling_the_budget_exactly_then_one_more_token_is_refused(
    stub: Stub, tiny_dir: Path
) -> None:
    epoch = bring_up(stub, tiny_dir, num_blocks=8)
    steps = Stepper(stub, epoch)
    a, b = _prompt(64, 1), _prompt(64, 2)
    steps.step(new={"a": a, "b": b})
    assert _health(stub).kv.used_blocks == 8 and _health(stub).kv.free_blocks == 0
    before = dict(steps.computed), {k: list(v) for k, v in steps.outputs.items()}
    with pytest.raises(grpc.RpcError) as info:
        steps.step(schedule={"a": 1})
    assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs 9 KV blocks but the budget is 8" in details_of(info.value)
    health = _health(stub)
    assert health.kv.used_blocks == 8 and health.state == pb.WORKER_STATE_SERVING
    assert (steps.computed, steps.outputs) == before
    # Nothing changed: the same request continues once room is made.
    steps.step(finished=["b"], schedule={"a": 1})
    assert steps.computed["a"] == 65
    steps.step(finished=["a"], schedule={})
    health = _health(stub)
    assert health.kv.used_blocks == 0 and health.kv.free_blocks == 8
    # Their blocks went to the prefix cache, which gives them back on demand.
    assert health.kv.prefix_cache_blocks > 0
    c, d = _prompt(48, 3), _prompt(48, 4)
    steps.step(new={"c": c, "d": d})
    health = _health(stub)
    # Requests first: the prefix cache keeps only what is left of the budget.
    assert health.kv.used_blocks == 6 and health.kv.prefix_cache_blocks <= 2
    steps.run_out("c", "d")
    assert len(steps.outputs["c"]) == len(steps.outputs["d"]) == 12
    assert _health(stub).kv.used_blocks == 0


def test_refill_after_free_gives_the_same_tokens(stub: Stub, tiny_dir: Path) -> None:
    epoch = bring_up(stub, tiny_dir, num_blocks=8)
    prompts = [_prompt(60, 5), _prompt(60, 6)]
    first = drive(stub, epoch, prompts, max_tokens=4)
    assert _health(stub).kv.used_blocks == 0
    again = drive(stub, epoch, prompts, max_tokens=4)
    assert again == first


# ------------------------------------------------------- out-of-memory steps
def _memory_limited(stub: Stub, model: Path, headroom: int) -> int:
    """Brings a worker up with its MLX memory limit `headroom` bytes above what it holds."""
    stub.InitDevice(pb.InitDeviceRequest())
    epoch = int(stub.LoadModel(pb.LoadModelRequest(model=str(model))).worker_epoch)
    stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=64, block_size=16))
    active = stub.GetInfo(pb.GetInfoRequest()).memory.active_bytes
    answer = stub.InitCache(
        pb.InitCacheRequest(num_blocks=256, block_size=16, memory_limit_bytes=active + headroom)
    )
    assert answer.memory_limit_bytes == active + headroom
    return epoch


def test_a_step_too_large_for_the_memory_limit_is_refused_and_others_finish(
    tiny_dir: Path, stub: Stub, channel: grpc.Channel
) -> None:
    p1, p2 = _prompt(20, 7), _prompt(8, 8)
    epoch = _memory_limited(stub, tiny_dir, headroom=8 << 20)
    steps = Stepper(stub, epoch)
    steps.step(new={"p1": p1, "p2": p2})
    steps.step()
    cached = _health(stub).kv.prefix_cache_blocks  # p1's whole block
    assert cached == 1
    with pytest.raises(grpc.RpcError) as info:
        steps.step(new={"big": _prompt(400, 9)})
    assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "memory limit" in details_of(info.value)
    health = _health(stub)
    assert health.state == pb.WORKER_STATE_SERVING
    # Emptying the prefix cache would not have made room: it keeps its blocks.
    assert health.kv.prefix_cache_blocks == cached
    steps.run_out("p1", "p2")
    reference = reference_tokens(tiny_dir, [p1, p2], 12)
    assert [steps.outputs["p1"], steps.outputs["p2"]] == reference


class _FailingForward:
    """Makes the model's batched decode forward raise like an MLX allocation failure."""

    def __init__(self) -> None:
        self.armed = False
        self.original: Any = llama.Model.__call__

    def __call__(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if self.armed and inputs.shape[0] > 1:
            self.armed = False
            raise RuntimeError("[metal::malloc] Unable to allocate 1073741824 bytes")
        return self.original(model, inputs, *args, **kwargs)


@pytest.fixture
def failing_forward(monkeypatch: pytest.MonkeyPatch) -> Iterator[_FailingForward]:
    fault = _FailingForward()

    def call(model: Any, *args: Any, **kwargs: Any) -> Any:
        return fault(model, *args, **kwargs)

    monkeypatch.setattr(llama.Model, "__call__", call)
    yield fault


def test_an_allocation_failure_mid_step_is_undone_and_nothing_is_lost(
    tiny_dir: Path, stub: Stub, failing_forward: _FailingForward
) -> None:
    p1, p2, p3 = _prompt(20, 10), _prompt(30, 11), _prompt(40, 12)
    epoch = bring_up(stub, tiny_dir)
    steps = Stepper(stub, epoch)
    steps.step(new={"p1": p1, "p2": p2})
    steps.step()
    steps.step()
    before = dict(steps.computed), {k: list(v) for k, v in steps.outputs.items()}
    used = _health(stub).kv.used_blocks
    # The step prefills p3 (a private forward that succeeds), then the batched
    # decode of p1, p2 and p3 fails: the whole step is undone.
    failing_forward.armed = True
    with pytest.raises(grpc.RpcError) as info:
        steps.step(new={"p3": p3})
    assert code_of(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "undone" in details_of(info.value)
    health = _health(stub)
    assert health.state == pb.WORKER_STATE_SERVING and health.kv.used_blocks == used
    assert health.num_running_requests == 2
    assert (steps.computed, steps.outputs) == before
    # p3 was never added: the scheduler may submit it again as new.
    steps.step(new={"p3": p3})
    steps.run_out("p1", "p2", "p3")
    reference = reference_tokens(tiny_dir, [p1, p2, p3], 12)
    assert [steps.outputs[r] for r in ("p1", "p2", "p3")] == reference


# ------------------------------------------------------------- the KV budget
def _profiled(stub: Stub, model: Path) -> pb.DetermineMemoryResponse:
    stub.InitDevice(pb.InitDeviceRequest())
    stub.LoadModel(pb.LoadModelRequest(model=str(model)))
    request = pb.DetermineMemoryRequest(max_num_batched_tokens=64, block_size=16)
    profile: pb.DetermineMemoryResponse = stub.DetermineMemory(request)
    return profile


def _refused_budget(stub: Stub, request: pb.InitCacheRequest) -> str:
    with pytest.raises(grpc.RpcError) as info:
        stub.InitCache(request)
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT, details_of(info.value)
    assert _health(stub).state == pb.WORKER_STATE_MEMORY_PROFILED  # nothing changed
    return details_of(info.value)


def _step_bytes(message: str) -> int:
    """The bytes a refusal keeps free for a one-token step beside the weights and KV."""
    found = re.search(r"and (\d+) bytes for a one-token step's activations", message)
    assert found is not None, message
    return int(found.group(1))


def test_a_kv_budget_over_the_memory_limit_is_refused_with_the_bytes(
    stub: Stub, tiny_dir: Path
) -> None:
    profile = _profiled(stub, tiny_dir)
    per_block, weights = profile.bytes_per_block, profile.weight_bytes
    message = _refused_budget(stub, pb.InitCacheRequest(num_blocks=2**32, memory_limit_bytes=1))
    assert f"num_blocks {2**32} of 16 tokens would take {2**32 * per_block} bytes of KV" in message
    assert f"beside {weights} bytes of weights and " in message
    assert "InitCache.memory_limit_bytes (1 bytes): at most 0 blocks fit" in message
    step = _step_bytes(message)
    assert 0 < step < profile.activation_peak_bytes
    # Weights and 10 blocks but no room for a step: refused (every step would be).
    message = _refused_budget(
        stub, pb.InitCacheRequest(num_blocks=10, memory_limit_bytes=weights + 10 * per_block)
    )
    assert f"raise the limit (past {weights + 10 * per_block + step}, what those take" in message
    # A limit that holds the weights, exactly 10 blocks and a step takes 10 and refuses 11.
    limit = weights + 10 * per_block + step
    message = _refused_budget(stub, pb.InitCacheRequest(num_blocks=11, memory_limit_bytes=limit))
    assert "at most 10 blocks fit" in message
    cache = stub.InitCache(pb.InitCacheRequest(num_blocks=10, memory_limit_bytes=limit))
    assert cache.num_blocks == 10 and cache.memory_limit_bytes == limit
    generated = stub.Generate(
        pb.GenerateRequest(prompt_token_ids=[5], sampling_params=pb.SamplingParams(max_tokens=1))
    )
    assert sum(len(m.token_ids) for m in generated) == 1  # a step runs under it


def test_a_kv_budget_over_the_device_memory_is_refused(stub: Stub, tiny_dir: Path) -> None:
    profile = _profiled(stub, tiny_dir)
    message = _refused_budget(stub, pb.InitCacheRequest(num_blocks=2**32))
    room = profile.total_memory_bytes - profile.weight_bytes - _step_bytes(message)
    fits = room // profile.bytes_per_block
    assert f"the device's memory ({profile.total_memory_bytes} bytes)" in message
    assert f"at most {fits} blocks fit" in message
    assert stub.InitCache(pb.InitCacheRequest(num_blocks=fits)).num_blocks == fits
