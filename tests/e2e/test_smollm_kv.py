"""SmolLM2 with 8-bit KV: the worker's greedy tokens are mlx-lm's own with the same KV."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from driver import drive, greedy, live_server, share_equal
from mlx import nn
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from tiny_model import dequantized_copy

from mlx_worker_svc.core.domain import KVFormat
from mlx_worker_svc.engine.cache import quantized
from mlx_worker_svc.engine.cache.batch import DecodeBatch
from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

pytestmark = pytest.mark.smollm
TOKENS = 16


def test_8bit_kv_matches_mlx_lm_on_smollm2(smollm_dir: Path) -> None:
    model, tokenizer = load(str(smollm_dir))
    chat = [{"role": "user", "content": "Write a haiku about the sea."}]
    prompt = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))
    kv = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0}
    expected = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=TOKENS, **kv)]
    with live_server() as (_, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        epoch = int(stub.LoadModel(pb.LoadModelRequest(model=str(smollm_dir))).worker_epoch)
        memory = stub.DetermineMemory(
            pb.DetermineMemoryRequest(max_num_batched_tokens=16, kv_bits=8, kv_group_size=64)
        )
        # 30 layers x 3 KV heads x 16 tokens x (keys + values) x (64 bytes + a float32
        # scale and bias): SmolLM2's KV is float32 (its norms are).
        assert memory.bytes_per_block == 30 * 3 * 16 * 2 * (64 + 8)
        stub.InitCache(pb.InitCacheRequest(num_blocks=512, kv_bits=8, kv_group_size=64))
        params = greedy(TOKENS, ignore_eos=True)
        got = drive(stub, epoch, [prompt], max_tokens=TOKENS, params=params)[0]
    assert got == expected


# float16 runs without BLAS on a CPU (about 0.4 s a decode step): two short prompts,
# the least batch that attends dequantized, keep it short.
QUESTIONS = ["The capital of France is", "Write a haiku about the sea:"]


def _forced_share(model: nn.Module, prompts: list[list[int]], alone: list[list[int]]) -> float:
    """Share of positions where a dequantized batch picks the alone run's token, fed them."""
    rows: list[tuple[int, list[Any]]] = []
    for prompt in prompts:  # prefilled as mlx-lm's generate does, then quantized
        cache = make_prompt_cache(model)
        model(mx.array(prompt[:-1])[None], cache=cache)
        rows.append((len(rows), quantized.quantize(cache, KVFormat(8, 64))))
    batch: DecodeBatch[int] = DecodeBatch(
        dequant_rows=partial(EngineOptions().kv_dequant_rows, False)
    )
    batch.join(rows)
    inputs, same = [p[-1] for p in prompts], 0
    for position in range(TOKENS):
        chosen = mx.argmax(batch.forward(model, inputs), axis=-1).tolist()
        assert batch.state() and batch._cache[0].dequantizing()
        inputs = [a[position] for a in alone]
        same += sum(c == a for c, a in zip(chosen, inputs, strict=True))  # type: ignore[arg-type]
    return same / (TOKENS * len(prompts))


def test_a_float16_batch_attends_dequantized_and_agrees_with_alone(
    smollm_dir: Path, tmp_path: Path
) -> None:
    # SmolLM2 in float16: its KV is float16, so on the CPU a batch of 2 rows or more
    # attends dequantized by default (EngineOptions.kv_dequant_min_batch), where a
    # request alone keeps mlx-lm's quantized attention.
    source = dequantized_copy(smollm_dir, tmp_path / "smollm-f16", mx.float16)
    model, tokenizer = load(str(source))
    prompts = [list(tokenizer.encode(q)) for q in QUESTIONS]
    kv = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": 0}
    alone = [
        [t for t, _ in generate_step(mx.array(p), model, max_tokens=TOKENS, **kv)] for p in prompts
    ]
    with live_server() as (_, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        epoch = int(stub.LoadModel(pb.LoadModelRequest(model=str(source))).worker_epoch)
        stub.DetermineMemory(
            pb.DetermineMemoryRequest(max_num_batched_tokens=16, kv_bits=8, kv_group_size=64)
        )
        stub.InitCache(pb.InitCacheRequest(num_blocks=512, kv_bits=8, kv_group_size=64))
        params = greedy(TOKENS, ignore_eos=True)
        one = drive(stub, epoch, [prompts[0]], max_tokens=TOKENS, params=params)[0]
        batched = drive(stub, epoch, prompts, max_tokens=TOKENS, params=params)
    assert one == alone[0]  # one row: exactly mlx-lm's quantized attention
    # Free-running, a token that differs changes all that follow; fed the alone run's
    # tokens, each position shows whether the batch's kernel picks the same one.
    free = share_equal(batched, alone)
    forced = _forced_share(model, prompts, alone)
    print(
        f"float16 batch of {len(prompts)}, dequantized, tokens equal alone's: {free:.3f} "
        f"free-running, {forced:.3f} teacher-forced"
    )
    assert forced >= 0.95, f"fed the alone run's tokens, the batch agrees on {forced:.3f}"
    assert free >= 0.6, f"free-running, the batch agrees with alone on {free:.3f}"
