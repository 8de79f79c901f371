"""The adapter calls over gRPC: AddLora, RemoveLora, PinLora, ListLoras and their errors."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from driver import bring_up, code_of, details_of, greedy, live_server
from lora_adapters import make_adapter

from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import ServerConfig

Stub = pb_grpc.WorkerServiceStub


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(root / "a", tiny_dir, seed=1),
        "b": make_adapter(root / "b", tiny_dir, seed=2, rank=4, keys=None),
        "c": make_adapter(root / "c", tiny_dir, seed=3, keys=("mlp.down_proj",)),
        "d": make_adapter(root / "d", tiny_dir, seed=4, num_layers=1),
        "big": make_adapter(root / "big", tiny_dir, seed=5, rank=64, keys=None),
    }


@pytest.fixture
def two_slots() -> Iterator[Stub]:
    """A worker keeping at most two adapters resident."""
    with live_server(ServerConfig(port=0, engine=EngineOptions(max_loras=2))) as (_, stub):
        yield stub


def _tensors(adapter: Path) -> dict[str, mx.array]:
    loaded = mx.load(str(adapter / "adapters.safetensors"))
    assert isinstance(loaded, dict)
    return dict(loaded)


def _names(stub: Stub) -> list[str]:
    return list(stub.ListLoras(pb.ListLorasRequest()).names)


def _fails(call: object, request: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request)  # type: ignore[operator]
    return code_of(info.value), details_of(info.value)


def test_add_needs_a_model(stub: Stub, adapters: dict[str, Path]) -> None:
    code, text = _fails(stub.AddLora, pb.AddLoraRequest(name="a", path=str(adapters["a"])))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "AddLora needs state MODEL_LOADED" in text


def test_lifecycle_list_pin_remove(tiny_stub: Stub, adapters: dict[str, Path]) -> None:
    added = tiny_stub.AddLora(pb.AddLoraRequest(name="a", path=str(adapters["a"])))
    assert not added.already_loaded and added.adapter.name == "a"
    assert added.adapter.rank == 8 and added.adapter.num_modules == 4  # q, v in 2 layers
    assert added.adapter.path == str(adapters["a"].resolve())
    a = adapters["a"]
    own = sum(int(v.nbytes) for v in _tensors(a).values())
    assert added.adapter.bytes >= own
    again = tiny_stub.AddLora(pb.AddLoraRequest(name="a", path=str(adapters["a"])))
    assert again.already_loaded and again.adapter.bytes == added.adapter.bytes
    tiny_stub.AddLora(pb.AddLoraRequest(name="d", path=str(adapters["d"])))
    listed = tiny_stub.ListLoras(pb.ListLorasRequest())
    assert list(listed.names) == ["a", "d"] and listed.max_loras == 8
    d = next(x for x in listed.adapters if x.name == "d")
    assert d.num_modules == 2 and not d.pinned  # num_layers 1: the last block only
    assert tiny_stub.PinLora(pb.PinLoraRequest(name="d")).adapter.pinned
    assert not tiny_stub.PinLora(pb.PinLoraRequest(name="d", unpin=True)).adapter.pinned
    removed = tiny_stub.RemoveLora(pb.RemoveLoraRequest(name="a"))
    assert removed.path == str(adapters["a"].resolve())
    assert _names(tiny_stub) == ["d"]


def test_same_name_other_path_already_exists(tiny_stub: Stub, adapters: dict[str, Path]) -> None:
    tiny_stub.AddLora(pb.AddLoraRequest(name="a", path=str(adapters["a"])))
    code, text = _fails(tiny_stub.AddLora, pb.AddLoraRequest(name="a", path=str(adapters["b"])))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert "'a'" in text and "RemoveLora" in text
    assert _names(tiny_stub) == ["a"]


def _broken(tmp: Path, source: Path, *, config: dict[str, object] | None = None) -> Path:
    out = tmp / "broken"
    shutil.copytree(source, out)
    if config is not None:
        (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _config(source: Path) -> dict[str, object]:
    loaded: dict[str, object] = json.loads((source / "adapter_config.json").read_text())
    return loaded


@pytest.mark.parametrize(
    "case",
    [
        "no-path",
        "missing",
        "file",
        "no-weights",
        "dora",
        "no-scale",
        "rank",
        "not-linear",
        "other-model",
        "shape",
        "bad-name",
    ],
)
def test_bad_adapters_change_nothing(
    tiny_stub: Stub,
    adapters: dict[str, Path],
    tmp_path: Path,
    smollm_dir: Path,
    case: str,
) -> None:
    tiny_stub.AddLora(pb.AddLoraRequest(name="d", path=str(adapters["d"])))
    a = adapters["a"]
    config = _config(a)
    params = dict(config["lora_parameters"])  # type: ignore[call-overload]
    name, expect, words = "x", grpc.StatusCode.INVALID_ARGUMENT, ["AddLora"]
    path: Path | str
    if case == "no-path":  # not the server's working directory
        path, words = "", ["AddLora.path is required: the adapter directory"]
    elif case == "missing":
        path, expect, words = tmp_path / "nowhere", grpc.StatusCode.NOT_FOUND, ["does not exist"]
    elif case == "file":
        path, words = a / "adapters.safetensors", ["is a file"]
    elif case == "no-weights":
        path = _broken(tmp_path, a)
        (path / "adapters.safetensors").unlink()
        words = ["adapters.safetensors"]
    elif case == "dora":
        path, words = _broken(tmp_path, a, config={**config, "fine_tune_type": "dora"}), ["dora"]
    elif case == "no-scale":
        params.pop("scale")
        path = _broken(tmp_path, a, config={**config, "lora_parameters": params})
        words = ["scale"]
    elif case == "rank":
        params["rank"] = 4
        path = _broken(tmp_path, a, config={**config, "lora_parameters": params})
        words = ["lora_a", "shape", "rank (4)"]
    elif case == "not-linear":
        params["keys"] = ["input_layernorm"]
        path = _broken(tmp_path, a, config={**config, "lora_parameters": params})
        words = ["input_layernorm", "RMSNorm", "linear"]
    elif case == "other-model":  # SmolLM2's shapes (576 wide) on the tiny model (64)
        path = make_adapter(tmp_path / "smol", smollm_dir, seed=0, num_layers=2)
        words = ["model.layers.28.self_attn.q_proj.lora_a is not an adapter matrix"]
    elif case == "shape":
        path = _broken(tmp_path, a)
        tensors = _tensors(path)
        tensors["model.layers.1.self_attn.v_proj.lora_b"] = mx.ones((8, 65))
        mx.save_safetensors(str(path / "adapters.safetensors"), tensors)
        words = [
            f"AddLora: adapters.safetensors of {str(path)!r} ",  # the file, then the path
            "model.layers.1.self_attn.v_proj.lora_b has shape (8, 65)",
            "(8, 32)",
        ]
    else:
        name, path, words = "has space", a, ["AddLora.name"]
    before = tiny_stub.ListLoras(pb.ListLorasRequest())
    memory = tiny_stub.DetermineMemory(
        pb.DetermineMemoryRequest(max_num_batched_tokens=16, block_size=16)
    )
    code, text = _fails(tiny_stub.AddLora, pb.AddLoraRequest(name=name, path=str(path)))
    assert code == expect, text
    for word in words:
        assert word in text, text
    assert tiny_stub.ListLoras(pb.ListLorasRequest()) == before
    after = tiny_stub.DetermineMemory(
        pb.DetermineMemoryRequest(max_num_batched_tokens=16, block_size=16)
    )
    assert after.adapter_bytes == memory.adapter_bytes == before.adapters[0].bytes
    assert after.weight_bytes == memory.weight_bytes


def test_max_loras_evicts_the_least_recently_used_unpinned(
    two_slots: Stub, tiny_dir: Path, adapters: dict[str, Path]
) -> None:
    bring_up(two_slots, tiny_dir)
    for name in ("a", "b"):
        two_slots.AddLora(pb.AddLoraRequest(name=name, path=str(adapters[name])))
    two_slots.PinLora(pb.PinLoraRequest(name="a"))
    third = two_slots.AddLora(pb.AddLoraRequest(name="c", path=str(adapters["c"])))
    assert third.evicted == "b"
    assert _names(two_slots) == ["a", "c"]
    two_slots.PinLora(pb.PinLoraRequest(name="c"))
    code, text = _fails(two_slots.AddLora, pb.AddLoraRequest(name="d", path=str(adapters["d"])))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-loras 2" in text and "pinned" in text
    assert _names(two_slots) == ["a", "c"]


def test_remove_while_in_use_and_unknown_names(tiny_stub: Stub, adapters: dict[str, Path]) -> None:
    epoch = tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch
    tiny_stub.AddLora(pb.AddLoraRequest(name="a", path=str(adapters["a"])))
    new = pb.NewRequest(
        req_id="r", prompt_token_ids=[1, 2, 3], sampling_params=greedy(4), lora_name="a"
    )
    step = pb.ExecuteRequest(
        step_id=1, worker_epoch=epoch, new_requests=[new], num_scheduled_tokens={"r": 3}
    )
    tiny_stub.Execute(step)
    listed = tiny_stub.ListLoras(pb.ListLorasRequest())
    assert listed.adapters[0].num_requests == 1
    code, text = _fails(tiny_stub.RemoveLora, pb.RemoveLoraRequest(name="a"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "1 live request" in text
    tiny_stub.Execute(pb.ExecuteRequest(step_id=2, worker_epoch=epoch, finished_req_ids=["r"]))
    tiny_stub.RemoveLora(pb.RemoveLoraRequest(name="a"))
    code, text = _fails(tiny_stub.RemoveLora, pb.RemoveLoraRequest(name="a"))
    assert code == grpc.StatusCode.NOT_FOUND and "RemoveLora.name" in text
    code, text = _fails(tiny_stub.PinLora, pb.PinLoraRequest(name="zzz"))
    assert code == grpc.StatusCode.NOT_FOUND and "PinLora.name" in text
    for call, message in (
        (tiny_stub.RemoveLora, pb.RemoveLoraRequest),
        (tiny_stub.PinLora, pb.PinLoraRequest),
    ):
        code, text = _fails(call, message(name=""))  # as AddLora: required, not unknown
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "Lora.name is required" in text
    unknown = pb.NewRequest(
        req_id="u", prompt_token_ids=[1, 2], sampling_params=greedy(2), lora_name="a"
    )
    step = pb.ExecuteRequest(
        step_id=3, worker_epoch=epoch, new_requests=[unknown], num_scheduled_tokens={"u": 2}
    )
    code, text = _fails(tiny_stub.Execute, step)
    assert code == grpc.StatusCode.NOT_FOUND
    assert "new_requests[0] (req_id 'u').lora_name" in text
    assert tiny_stub.CheckHealth(pb.CheckHealthRequest()).num_running_requests == 0
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stub.Generate(pb.GenerateRequest(prompt="hi", lora_name="a")))
    assert code_of(info.value) == grpc.StatusCode.NOT_FOUND
    assert "GenerateRequest.lora_name" in details_of(info.value)


def test_adapter_bytes_count_in_memory(tiny_dir: Path, adapters: dict[str, Path]) -> None:
    with live_server() as (_, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir)))
        bare = stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=16))
        stub.AddLora(pb.AddLoraRequest(name="a", path=str(adapters["a"])))
        held = stub.ListLoras(pb.ListLorasRequest()).adapters[0].bytes
        profile = stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=16))
        assert bare.adapter_bytes == 0 and profile.adapter_bytes == held
        assert profile.weight_bytes == bare.weight_bytes + held
        kv = 4 * profile.bytes_per_block
        limit = profile.weight_bytes + kv + profile.activation_peak_bytes + 1024
        stub.InitCache(pb.InitCacheRequest(num_blocks=4, block_size=16, memory_limit_bytes=limit))
        code, text = _fails(stub.AddLora, pb.AddLoraRequest(name="big", path=str(adapters["big"])))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory limit" in text
        assert "gives up" in text and "of its 4 blocks" in text
        # No request holds a block: the budget would have none left, not "requests hold 0".
        assert "which would leave it none" in text and "requests hold" not in text
        assert [a.name for a in stub.ListLoras(pb.ListLorasRequest()).adapters] == ["a"]
        assert stub.CheckHealth(pb.CheckHealthRequest()).kv.num_blocks == 4


def _matrix_bytes(adapter: Path) -> int:
    weights = mx.load(str(adapter / "adapters.safetensors"))
    assert isinstance(weights, dict)
    return sum(int(v.nbytes) for v in weights.values())


def test_an_adapters_share_of_the_stacks_grows_beside_a_larger_one(
    tiny_dir: Path, adapters: dict[str, Path]
) -> None:
    """adapters.md: the stacks hold every adapter at the largest rank, for every layer any
    adapts; an adapter's bytes are its matrices and an equal share of them."""
    matrices = _matrix_bytes(adapters["a"])
    with live_server() as (_, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir)))

        def held() -> dict[str, int]:
            return {a.name: a.bytes for a in stub.ListLoras(pb.ListLorasRequest()).adapters}

        stub.AddLora(pb.AddLoraRequest(name="a", path=str(adapters["a"])))
        alone = held()["a"]
        assert 2 * matrices <= alone <= 3 * matrices, (alone, matrices)
        stub.AddLora(pb.AddLoraRequest(name="big", path=str(adapters["big"])))
        beside = held()
        assert beside["a"] > 3 * matrices, (beside, matrices)  # rank 64, every layer
        share = beside["big"] - _matrix_bytes(adapters["big"])
        assert beside["a"] - matrices == share  # an equal share


def test_adapters_determine_memory_counted_keep_init_caches_budget_whole(
    tiny_dir: Path, adapters: dict[str, Path]
) -> None:
    """An adapter resident at DetermineMemory is in the weights InitCache checked its
    budget against (a one-token step beside it): nothing more is taken for it, even
    under a limit that leaves no room for the activation peak."""
    with live_server() as (_, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir)))
        stub.AddLora(pb.AddLoraRequest(name="b", path=str(adapters["b"])))
        profile = stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=32))
        blocks = 64
        with pytest.raises(grpc.RpcError) as info:  # the smallest limit InitCache takes
            stub.InitCache(pb.InitCacheRequest(num_blocks=blocks, memory_limit_bytes=1))
        least = int(re.search(r"past (\d+)", details_of(info.value)).group(1))  # type: ignore[union-attr]
        assert least < profile.weight_bytes + blocks * profile.bytes_per_block + (
            profile.activation_peak_bytes
        )
        reply = stub.InitCache(pb.InitCacheRequest(num_blocks=blocks, memory_limit_bytes=least))
        assert reply.num_blocks == blocks
        for kv in (
            stub.CheckHealth(pb.CheckHealthRequest()).kv,
            stub.GetInfo(pb.GetInfoRequest()).kv,
        ):
            assert (kv.num_blocks, kv.free_blocks) == (blocks, blocks)
        stub.RemoveLora(pb.RemoveLoraRequest(name="b"))
        stub.AddLora(pb.AddLoraRequest(name="b", path=str(adapters["b"])))  # the same bytes
        assert stub.CheckHealth(pb.CheckHealthRequest()).kv.num_blocks == blocks
        added = stub.AddLora(pb.AddLoraRequest(name="a", path=str(adapters["a"])))
        assert added.kv.num_blocks < blocks  # bytes DetermineMemory never saw take blocks


def test_adapters_after_init_cache_take_their_bytes_from_the_kv_budget(
    tiny_dir: Path, adapters: dict[str, Path]
) -> None:
    with live_server() as (_, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        stub.LoadModel(pb.LoadModelRequest(model=str(tiny_dir)))
        profile = stub.DetermineMemory(pb.DetermineMemoryRequest(max_num_batched_tokens=16))
        blocks = 400
        limit = profile.weight_bytes + blocks * profile.bytes_per_block
        limit += profile.activation_peak_bytes  # no byte to spare beside the budget
        stub.InitCache(
            pb.InitCacheRequest(num_blocks=blocks, block_size=16, memory_limit_bytes=limit)
        )
        reply = stub.AddLora(pb.AddLoraRequest(name="b", path=str(adapters["b"])))
        given = -(-reply.adapter.bytes // profile.bytes_per_block)  # whole blocks of its bytes
        assert stub.CheckHealth(pb.CheckHealthRequest()).kv.num_blocks == blocks - given
        assert (reply.kv.num_blocks, reply.kv.free_blocks) == (blocks - given, blocks - given)
        # Asleep, the budget shown is the one WakeUp restores, the adapter's room taken.
        for level in (1, 2):
            stub.Sleep(pb.SleepRequest(level=level))
            for kv in (
                stub.CheckHealth(pb.CheckHealthRequest()).kv,
                stub.GetInfo(pb.GetInfoRequest()).kv,
            ):
                assert (kv.num_blocks, kv.free_blocks) == (blocks - given, blocks - given)
            stub.WakeUp(pb.WakeUpRequest())
            assert stub.CheckHealth(pb.CheckHealthRequest()).kv.num_blocks == blocks - given
        removed = stub.RemoveLora(pb.RemoveLoraRequest(name="b"))
        assert stub.CheckHealth(pb.CheckHealthRequest()).kv.num_blocks == blocks
        assert removed.kv.num_blocks == blocks and removed.kv.block_size == 16
