"""LoRA adapters per request: the tokens mlx-lm gives with that adapter, alone and batched.

Three adapters made here (random A, non-zero B, in mlx_lm.lora's format; other
ranks, targets and num_layers), on the tiny model and on SmolLM2: every
request's greedy tokens equal `mlx_lm.generate`'s (its `generate_step`) on
`mlx_lm.load(model, adapter_path=that adapter)`, one request at a time and in
one batch of 8 mixing the base model and the three adapters, through Execute
(chunked prefill, prefix cache on) and Generate.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from driver import bring_up, greedy, live_server
from lora_adapters import make_adapter
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_worker_svc.client.execute_loop import LoopResult, run_prompts
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import ServerConfig

Stub = pb_grpc.WorkerServiceStub
PROMPTS = [
    [1, 2, 3, 4, 5],
    [100, 200, 300, 17, 18, 19, 20],
    [7] * 20,
    [42, 43],
    list(range(500, 537)),
    [9, 8, 7, 6, 5, 4, 3, 2],
    [31000, 17, 4242, 12],
    [5] * 3,
]
NAMES = ["", "a0", "a1", "a2", "a0", "", "a2", "a1"]  # "" : the base model
TOKENS = 12


def mlx_lm_reference(
    model: Path, adapters: dict[str, Path], prompts: list[list[int]], names: list[str], n: int
) -> list[list[int]]:
    """mlx-lm's greedy tokens of each prompt alone, with its adapter loaded by mlx_lm.load."""
    out: list[list[int]] = [[] for _ in prompts]
    for name in sorted(set(names)):
        loaded, _ = load(str(model), adapter_path=str(adapters[name]) if name else None)
        for i, (prompt, asked) in enumerate(zip(prompts, names, strict=True)):
            if asked == name:
                steps = generate_step(mx.array(prompt), loaded, max_tokens=n)
                out[i] = [int(token) for token, _ in steps]
    return out


def make_three(model: Path, root: Path, *, layers: int = -1) -> dict[str, Path]:
    """a0: every linear layer (of the last `layers` blocks); a1: rank 4, q and v; a2: the
    last block's o_proj and up_proj."""
    return {
        "a0": make_adapter(root / "a0", model, seed=10, keys=None, num_layers=layers),
        "a1": make_adapter(root / "a1", model, seed=11, rank=4, num_layers=layers),
        "a2": make_adapter(
            root / "a2", model, seed=12, keys=("self_attn.o_proj", "mlp.up_proj"), num_layers=1
        ),
    }


def execute(
    stub: Stub, epoch: int, prompts: list[list[int]], names: list[str], n: int, *, chunk: int
) -> LoopResult:
    """Runs the prompts together through Execute, each with its adapter (run_prompts' ids)."""
    by_id = {f"req-{i}": name for i, name in enumerate(names)}

    def call(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        for new in request.new_requests:
            new.lora_name = by_id[new.req_id]
        response: pb.ExecuteResponse = stub.Execute(request)
        return response

    return run_prompts(call, epoch, prompts, greedy(n, ignore_eos=True), chunk=chunk)


def generate_all(stub: Stub, prompts: list[list[int]], names: list[str], n: int) -> list[list[int]]:
    """Every prompt as its own Generate stream, all open at once."""
    out: list[list[int]] = [[] for _ in prompts]

    def one(i: int) -> None:
        request = pb.GenerateRequest(
            prompt_token_ids=prompts[i], sampling_params=greedy(n, ignore_eos=True)
        )
        request.lora_name = names[i]
        for chunk in stub.Generate(request):
            out[i] += list(chunk.token_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> dict[str, Path]:
    return make_three(tiny_dir, tmp_path_factory.mktemp("tiny-adapters"))


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir: Path, tiny_adapters: dict[str, Path]) -> list[list[int]]:
    return mlx_lm_reference(tiny_dir, tiny_adapters, PROMPTS, NAMES, TOKENS)


@pytest.fixture(scope="module")
def tiny_worker(tiny_dir: Path, tiny_adapters: dict[str, Path]) -> Iterator[tuple[Stub, int]]:
    with live_server() as (_, stub):
        epoch = bring_up(stub, tiny_dir)
        for name, path in tiny_adapters.items():
            stub.AddLora(pb.AddLoraRequest(name=name, path=str(path)))
        yield stub, epoch


def test_the_adapters_change_the_tokens(tiny_reference: list[list[int]]) -> None:
    # The same prompt under the base model and each adapter: four different answers.
    assert tiny_reference[0] != tiny_reference[4] != tiny_reference[1]
    assert len({tuple(tokens) for tokens in tiny_reference}) == len(PROMPTS)


@pytest.mark.parametrize("together", [False, True], ids=["alone", "batch-of-8"])
def test_execute_parity(
    tiny_worker: tuple[Stub, int], tiny_reference: list[list[int]], together: bool
) -> None:
    stub, epoch = tiny_worker
    if together:
        got = execute(stub, epoch, PROMPTS, NAMES, TOKENS, chunk=4).tokens
    else:
        got = [
            execute(stub, epoch, [p], [name], TOKENS, chunk=4).tokens[0]
            for p, name in zip(PROMPTS, NAMES, strict=True)
        ]
    assert got == tiny_reference


def test_generate_parity(tiny_worker: tuple[Stub, int], tiny_reference: list[list[int]]) -> None:
    stub, _ = tiny_worker
    assert generate_all(stub, PROMPTS, NAMES, TOKENS) == tiny_reference
    assert generate_all(stub, PROMPTS[1:2], NAMES[1:2], TOKENS) == tiny_reference[1:2]


def test_a_failed_step_leaves_the_adapters_in_force(
    tiny_worker: tuple[Stub, int], tiny_reference: list[list[int]]
) -> None:
    """A step that fails while it decodes is undone; the batch it rebuilds still opens
    each row's adapter (it once came back with the base model's weights for all)."""
    stub, epoch = tiny_worker
    past_limit = pb.StructuredChoice(choices=[f"city{i}" for i in range(2001)])
    bad = greedy(4)
    bad.structured_outputs.choice.CopyFrom(past_limit)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6], sampling_params=bad)))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert generate_all(stub, PROMPTS, NAMES, TOKENS) == tiny_reference
        assert execute(stub, epoch, PROMPTS, NAMES, TOKENS, chunk=4).tokens == tiny_reference


def test_prefix_cache_keeps_adapters_apart(
    tiny_worker: tuple[Stub, int], tiny_dir: Path, tiny_adapters: dict[str, Path]
) -> None:
    stub, epoch = tiny_worker
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    prompt = list(range(1000, 1040))  # two whole blocks and a part
    names = ["a1", "", "a2", "a1"]
    want = mlx_lm_reference(tiny_dir, tiny_adapters, [prompt] * 4, names, 6)
    runs = [execute(stub, epoch, [prompt], [name], 6, chunk=16) for name in names]
    assert [r.tokens[0] for r in runs] == want
    # Only the second a1 request finds KV: the one a1 computed, not the base model's or a2's.
    assert [r.cached_prompt_tokens[0] for r in runs] == [0, 0, 0, 32]
    # Removing an adapter drops its blocks: loaded again, it computes from scratch.
    held = stub.CheckHealth(pb.CheckHealthRequest()).kv.prefix_cache_blocks
    stub.RemoveLora(pb.RemoveLoraRequest(name="a1"))
    assert stub.CheckHealth(pb.CheckHealthRequest()).kv.prefix_cache_blocks < held
    stub.AddLora(pb.AddLoraRequest(name="a1", path=str(tiny_adapters["a1"])))
    again = execute(stub, epoch, [prompt], ["a1"], 6, chunk=16)
    assert again.tokens[0] == want[0] and again.cached_prompt_tokens[0] == 0


# Four (prompt, adapter) pairs, twice: the batch of 8 mixes the base model and three adapters.
def test_rewrites_apply_the_deltas_or_step_aside(
    tiny_dir: Path, tiny_adapters: dict[str, Path], tiny_reference: list[list[int]]
) -> None:
    """Fused projections and the llama decode step on (a CPU's default is off)."""
    config = ServerConfig(port=0, engine=EngineOptions(fuse=True, dequant_min_batch=1))
    with live_server(config) as (server, stub):
        epoch = bring_up(stub, tiny_dir)
        for name, path in tiny_adapters.items():
            stub.AddLora(pb.AddLoraRequest(name=name, path=str(path)))
        runner = server.worker.core.runner
        assert runner is not None and hasattr(runner.model, "_mlx_worker_decode_step")
        assert execute(stub, epoch, PROMPTS, NAMES, TOKENS, chunk=4).tokens == tiny_reference
        alone = [
            execute(stub, epoch, [p], [n], TOKENS, chunk=4).tokens[0]
            for p, n in zip(PROMPTS[:4], NAMES[:4], strict=True)
        ]
        assert alone == tiny_reference[:4]


SMOL_PROMPTS = [[1, 2, 3, 4], [100, 200, 300], [7, 7, 7, 7, 7], [42, 9]] * 2
SMOL_NAMES = ["", "a0", "a1", "a2"] * 2
SMOL_TOKENS = 3


def test_smollm_parity(smollm_dir: Path, tmp_path: Path) -> None:
    """SmolLM2 (4-bit): alone and in one batch of 8, Execute and Generate."""
    adapters = make_three(smollm_dir, tmp_path, layers=6)
    want = mlx_lm_reference(smollm_dir, adapters, SMOL_PROMPTS[:4], SMOL_NAMES[:4], SMOL_TOKENS)
    want += want
    assert len({tuple(w) for w in want}) > 1
    with live_server() as (_, stub):
        epoch = bring_up(stub, smollm_dir, num_blocks=256, profile_tokens=16)
        for name, path in adapters.items():
            stub.AddLora(pb.AddLoraRequest(name=name, path=str(path)))
        together = execute(stub, epoch, SMOL_PROMPTS, SMOL_NAMES, SMOL_TOKENS, chunk=2).tokens
        alone = [  # the base model and each adapter
            execute(stub, epoch, [p], [name], SMOL_TOKENS, chunk=2).tokens[0]
            for p, name in zip(SMOL_PROMPTS[:4], SMOL_NAMES[:4], strict=True)
        ]
        streamed = generate_all(stub, SMOL_PROMPTS, SMOL_NAMES, SMOL_TOKENS)
    assert together == want
    assert alone == want[:4]
    assert streamed == want
