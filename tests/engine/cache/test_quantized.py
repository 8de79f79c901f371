"""Quantized KV (kv_bits): parity with mlx-lm, batches, the prefix cache, preemption, sleep, errors.

One worker on a tiny llama with head_dim 64 (so mlx-lm's default group of 64
divides it), brought up with kv_bits 8 and driven through Execute. The
anchor is mlx-lm's own generation with the same kv_bits and kv_group_size
and quantized_kv_start=0.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import mlx.core as mx
import pytest
from driver import code_of, details_of, drive, greedy, live_server, mlx_lm_tokens, share_equal
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from structured_driver import failing_beside
from tiny_model import build_tiny_model, random_llama

from mlx_worker_svc.client.execute_loop import run_prompts
from mlx_worker_svc.core.domain import KVFormat
from mlx_worker_svc.engine.cache import quantized
from mlx_worker_svc.engine.cache.batch import merge_caches
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc
from mlx_worker_svc.rpc.server import ServerConfig, WorkerServer

Stub = pb_grpc.WorkerServiceStub
BITS, GROUP = 8, 64
PROMPTS = [
    [1, 2, 3, 4, 5],
    [100, 200, 300],
    [7] * 20,
    list(range(500, 537)),
    [9, 8, 7, 6, 5, 4, 3, 2],
    [31000, 17, 4242, 12],
]
TOKENS = 24


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-kv") / "model", smollm_dir, head_dim=64)


def mlx_lm_quantized(model: Path, prompts: list[list[int]], bits: int) -> list[list[int]]:
    """mlx-lm's greedy tokens with quantized KV from the start (EOS not stopping)."""
    loaded, _ = load(str(model))
    kv = {"kv_bits": bits, "kv_group_size": GROUP, "quantized_kv_start": 0}
    return [
        [t for t, _ in generate_step(mx.array(p), loaded, max_tokens=TOKENS, **kv)] for p in prompts
    ]


@pytest.fixture(scope="module")
def reference(kv_model: Path) -> list[list[int]]:
    return mlx_lm_quantized(kv_model, PROMPTS, BITS)


def bring_up(stub: Stub, model: Path, bits: int = BITS, num_blocks: int = 4096) -> int:
    stub.InitDevice(pb.InitDeviceRequest())
    epoch = int(stub.LoadModel(pb.LoadModelRequest(model=str(model))).worker_epoch)
    group = GROUP if bits else 0
    profile = pb.DetermineMemoryRequest(max_num_batched_tokens=64, kv_bits=bits)
    profile.kv_group_size = group
    stub.DetermineMemory(profile)
    stub.InitCache(pb.InitCacheRequest(num_blocks=num_blocks, kv_bits=bits, kv_group_size=group))
    return epoch


@pytest.fixture(scope="module")
def server(kv_model: Path) -> Iterator[tuple[WorkerServer, Stub, int]]:
    with live_server(ServerConfig(port=0, metrics_port=0)) as (srv, stub):
        yield srv, stub, bring_up(stub, kv_model)


@pytest.fixture(scope="module")
def worker(server: tuple[WorkerServer, Stub, int]) -> tuple[Stub, int]:
    return server[1], server[2]


def params() -> pb.SamplingParams:
    return greedy(TOKENS, ignore_eos=True)


def test_a_single_request_gives_mlx_lms_tokens(
    worker: tuple[Stub, int], reference: list[list[int]], kv_model: Path
) -> None:
    stub, epoch = worker
    got = []
    for p in PROMPTS:
        stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
        got.append(drive(stub, epoch, [p], max_tokens=TOKENS, params=params())[0])
    assert got == reference
    # The anchor is quantized KV indeed: float KV gives other tokens here.
    assert mlx_lm_tokens(kv_model, PROMPTS, TOKENS) != reference


def test_batched_and_prefix_cached_requests_agree_with_alone(
    worker: tuple[Stub, int], reference: list[list[int]]
) -> None:
    stub, epoch = worker
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    assert drive(stub, epoch, PROMPTS, max_tokens=TOKENS, params=params()) == reference
    # Again: the prompts of 20 and 37 tokens now start from their cached blocks.
    hits: dict[str, int] = {}

    def execute(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        response: pb.ExecuteResponse = stub.Execute(request)
        for out in response.outputs:
            hits[out.req_id] = max(hits.get(out.req_id, 0), out.num_cached_prompt_tokens)
        return response

    again = run_prompts(execute, epoch, PROMPTS, params()).tokens
    assert again == reference
    assert hits["req-2"] == 19 and hits["req-3"] == 36
    health = stub.CheckHealth(pb.CheckHealthRequest())
    assert health.kv.prefix_cache_blocks > 0


def test_a_shared_prefix_reuses_quantized_blocks(worker: tuple[Stub, int], kv_model: Path) -> None:
    stub, epoch = worker
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    first = list(range(600, 640))
    second = [*first[:35], 9, 9, 9]
    drive(stub, epoch, [first], max_tokens=2, params=greedy(2, ignore_eos=True))
    hits: list[int] = []

    def execute(request: pb.ExecuteRequest) -> pb.ExecuteResponse:
        response: pb.ExecuteResponse = stub.Execute(request)
        hits.extend(out.num_cached_prompt_tokens for out in response.outputs)
        return response

    got = run_prompts(execute, epoch, [second], params()).tokens
    # Two whole blocks came from the cache, in quantized form; the rest attends to them
    # quantized: as mlx-lm continuing its quantized cache of those 32 tokens.
    assert max(hits) == 32
    loaded, _ = load(str(kv_model))
    cache = quantized_cache(loaded, second[:32])
    rest = mx.array(second[32:])
    expected = [t for t, _ in generate_step(rest, loaded, max_tokens=TOKENS, prompt_cache=cache)]
    assert got == [expected]


def quantized_cache(model: object, prompt: list[int]) -> list[object]:
    """mlx-lm's cache for `prompt` with kv_bits 8 from the start (generate's own steps)."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)  # type: ignore[operator]
    maybe_quantize_kv_cache(cache, 0, GROUP, BITS)
    mx.eval([c.state for c in cache])
    return cache


def _step(stub: Stub, epoch: int, step_id: int, **fields: object) -> pb.ExecuteResponse:
    request = pb.ExecuteRequest(step_id=step_id, worker_epoch=epoch, **fields)  # type: ignore[arg-type]
    response: pb.ExecuteResponse = stub.Execute(request)
    return response


def test_preempted_and_resumed_request(
    worker: tuple[Stub, int], reference: list[list[int]]
) -> None:
    stub, epoch = worker
    stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
    prompt = PROMPTS[3]
    new = pb.NewRequest(req_id="p", prompt_token_ids=prompt, sampling_params=params())
    out = _step(stub, epoch, 1, new_requests=[new], num_scheduled_tokens={"p": len(prompt)})
    tokens = list(out.outputs[0].sampled_token_ids)
    for step in range(2, 8):
        computed = len(prompt) + len(tokens) - 1
        cached = pb.CachedRequest(req_id="p", num_computed_tokens=computed)
        out = _step(stub, epoch, step, cached_requests=[cached], num_scheduled_tokens={"p": 1})
        tokens += out.outputs[0].sampled_token_ids
    _step(stub, epoch, 8, preempted_req_ids=["p"])
    health = stub.CheckHealth(pb.CheckHealthRequest())
    assert health.num_preempted_requests == 1 and health.kv.used_blocks == 0
    resumed = pb.CachedRequest(req_id="p", num_computed_tokens=0, resumed_from_preemption=True)
    total = len(prompt) + len(tokens)
    step = 9
    out = _step(stub, epoch, step, cached_requests=[resumed], num_scheduled_tokens={"p": total})
    tokens += out.outputs[0].sampled_token_ids
    while out.outputs[0].finish_reason == pb.FINISH_REASON_UNSPECIFIED:
        step += 1
        computed = len(prompt) + len(tokens) - 1
        cached = pb.CachedRequest(req_id="p", num_computed_tokens=computed)
        out = _step(stub, epoch, step, cached_requests=[cached], num_scheduled_tokens={"p": 1})
        tokens += out.outputs[0].sampled_token_ids
    # The resumed request recomputes its 44 tokens as one prompt (the first chunk attends
    # in float, as mlx-lm's prefill does): here every token still agrees.
    assert tokens == reference[3]


def test_the_format_is_reported_and_survives_sleep(
    server: tuple[WorkerServer, Stub, int], reference: list[list[int]]
) -> None:
    srv, stub, _ = server
    url = f"http://127.0.0.1:{srv.metrics_port}/metrics"

    def shown() -> None:  # awake and asleep alike: the format in force
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        assert "\nmlx_worker_kv_bits 8.0\n" in text
        assert "\nmlx_worker_kv_group_size 64.0\n" in text
        for kv in (
            stub.GetInfo(pb.GetInfoRequest()).kv,
            stub.CheckHealth(pb.CheckHealthRequest()).kv,
        ):
            assert (kv.kv_bits, kv.kv_group_size) == (BITS, GROUP)

    shown()
    stub.Sleep(pb.SleepRequest(level=1))
    assert stub.GetInfo(pb.GetInfoRequest()).state == pb.WORKER_STATE_SLEEPING
    shown()
    epoch = int(stub.WakeUp(pb.WakeUpRequest()).worker_epoch)
    assert stub.GetInfo(pb.GetInfoRequest()).kv.kv_bits == BITS
    assert drive(stub, epoch, PROMPTS[:2], max_tokens=TOKENS, params=params()) == reference[:2]


def test_a_dequantized_batch_gives_each_row_its_tokens_alone(
    kv_model: Path, reference: list[list[int]]
) -> None:
    # The tiny llama is float32, which the default leaves on mlx-lm's quantized
    # attention: ask for the dequantized one from 2 rows.
    config = ServerConfig(port=0, engine=EngineOptions(kv_dequant_min_batch=2))
    with live_server(config) as (_, stub):
        epoch = bring_up(stub, kv_model)
        params = greedy(TOKENS, ignore_eos=True)
        batched = drive(stub, epoch, PROMPTS, max_tokens=TOKENS, params=params)
        # Alone (one row: mlx-lm's quantized attention), through the same worker.
        stub.ResetPrefixCache(pb.ResetPrefixCacheRequest())
        alone = [drive(stub, epoch, [p], max_tokens=TOKENS, params=params)[0] for p in PROMPTS]
    assert alone == reference
    share = share_equal(batched, reference)
    print(f"dequantized batch of {len(PROMPTS)}: share of tokens equal alone's {share:.3f}")
    assert share >= 0.95, f"batched rows agree with alone on {share:.3f} of tokens"


def _refused(call: object, request: object) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(request)  # type: ignore[operator]
    assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    return details_of(info.value)


def test_bytes_per_block_and_refusals(kv_model: Path) -> None:
    with live_server() as (_, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        stub.LoadModel(pb.LoadModelRequest(model=str(kv_model)))
        memory = stub.DetermineMemory
        for bits, group, says in (
            (7, 0, "DetermineMemory.kv_bits 7 is not a width MLX quantizes to"),
            (16, 0, "DetermineMemory.kv_bits 16 is not a width MLX quantizes to"),
            (
                8,
                128,
                "DetermineMemory.kv_group_size 128 does not divide the model's head_dim 64: "
                "use 32 or 64",
            ),
            (8, 48, "DetermineMemory.kv_group_size 48: use one of 32, 64, 128"),
            (0, 32, "DetermineMemory.kv_group_size 32 needs DetermineMemory.kv_bits"),
        ):
            request = pb.DetermineMemoryRequest(max_num_batched_tokens=16, kv_bits=bits)
            request.kv_group_size = group
            assert says in _refused(memory, request)
            assert stub.GetInfo(pb.GetInfoRequest()).state == pb.WORKER_STATE_MODEL_LOADED
        figures = {}
        for bits in (0, 8, 4):
            request = pb.DetermineMemoryRequest(max_num_batched_tokens=16, kv_bits=bits)
            profile = memory(request)
            assert profile.kv_bits == bits and profile.kv_group_size == (GROUP if bits else 0)
            figures[bits] = (profile.bytes_per_block, profile.suggested_num_blocks)
        # 2 layers x 2 KV heads x 16 tokens x (keys + values) x head_dim 64: float32 is
        # 256 bytes a head; 8 bits 64 bytes plus a float32 scale and bias, 4 bits 32 + 8.
        assert {b: f[0] for b, f in figures.items()} == {0: 32768, 8: 9216, 4: 5120}
        assert figures[8][1] >= 3 * figures[0][1] and figures[4][1] >= 6 * figures[0][1]
        # The last profile was 4-bit: InitCache must ask for that.
        says = _refused(stub.InitCache, pb.InitCacheRequest(num_blocks=64, kv_bits=8))
        assert "call DetermineMemory with kv_bits 8" in says
        says = _refused(stub.InitCache, pb.InitCacheRequest(num_blocks=64, kv_bits=7))
        assert "InitCache.kv_bits 7" in says
        # A group the model cannot take: named, not sent to a DetermineMemory that refuses it.
        init = pb.InitCacheRequest(num_blocks=64, kv_bits=8, kv_group_size=128)
        assert _refused(stub.InitCache, init).endswith(
            "InitCache.kv_group_size 128 does not divide the model's head_dim 64: use 32 or 64"
        )
        assert stub.GetInfo(pb.GetInfoRequest()).state == pb.WORKER_STATE_MEMORY_PROFILED
        done = stub.InitCache(pb.InitCacheRequest(num_blocks=64, kv_bits=4))
        assert (done.kv_bits, done.kv_group_size) == (4, GROUP)


def test_quantized_rows_merge_as_aligned_batches_unless_turned_off() -> None:
    model = random_llama("float32", head_dim=64)

    def row(prompt: list[int]) -> list[object]:
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        return quantized.quantize(cache, KVFormat(BITS, GROUP))

    same = merge_caches([row([1, 2, 3]), row([4, 5, 6])])
    assert isinstance(same[0], quantized.QuantizedBatchKVCache) and not same[0].padded
    assert same[0].make_mask(1) is None
    masked = merge_caches([row([1, 2, 3]), row([4, 5, 6])], aligned=False)
    assert masked[0].padded and isinstance(masked[0].make_mask(1), mx.array)
    ragged = merge_caches([row([1, 2, 3]), row([4, 5])])
    assert ragged[0].padded
    # Two rows of 3 tokens' triplets: 2 KV heads x (64 bytes + float32 scale and bias).
    assert ragged[0].nbytes == 2 * 3 * 2 * 2 * (64 + 8)


def test_a_failed_step_keeps_the_kv_of_a_row_it_did_not_schedule(
    worker: tuple[Stub, int],
) -> None:
    """A decode row left out of a step that fails keeps its quantized KV as it was: its
    logprobs are the very ones of a run without the failure (a rebuild, its first chunk
    attended in float, once changed them)."""
    stub, _ = worker
    assert failing_beside(stub, fail=True) == failing_beside(stub, fail=False)
