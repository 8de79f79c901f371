"""SmolLM2 with 8-bit KV: the worker's greedy tokens are mlx-lm's own with the same KV."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from driver import drive, greedy, live_server
from mlx_lm import load
from mlx_lm.generate import generate_step

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
