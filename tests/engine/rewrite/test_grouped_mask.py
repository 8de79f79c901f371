"""gemma2's batches (engine/rewrite/grouped_mask.py): every row attends with its own mask.

mlx-lm's gemma2 attention puts the query heads a KV head serves in an axis of
their own, and a batch cache's mask, (B, 1, L, S), lined its rows up with the KV
heads: two requests of different lengths together got wrong tokens, four failed
with a broadcast error. Requests run together must give each one's tokens alone.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from driver import bring_up, code_of, details_of, drive, fresh_stub, greedy, mlx_lm_tokens
from tiny_model import build_tiny_gemma2

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb

PROMPTS = [
    [5, 9, 3],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],
    [7, 1, 4, 1, 5, 9, 2, 6, 5],
    [42] * 6,
]


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return build_tiny_gemma2(tmp_path_factory.mktemp("gemma2") / "model", smollm_dir)


@pytest.mark.parametrize("rows", [2, 4])
def test_gemma2_requests_batched_give_each_ones_tokens_alone(gemma2_dir: Path, rows: int) -> None:
    prompts = PROMPTS[:rows]
    expected = mlx_lm_tokens(gemma2_dir, prompts, 10)
    with fresh_stub() as stub:
        epoch = bring_up(stub, gemma2_dir)
        got = drive(stub, epoch, prompts, max_tokens=10, params=greedy(10, ignore_eos=True))
    assert got == expected


def test_quantized_kv_on_gemma2_is_refused_naming_kv_bits(gemma2_dir: Path) -> None:
    """mlx-lm's gemma2 does not run on a quantized cache (mlx-lm's `kv_bits` fails in it
    too): DetermineMemory refuses it, INVALID_ARGUMENT, before anything changes."""
    with fresh_stub() as stub:
        stub.InitDevice(pb.InitDeviceRequest())
        stub.LoadModel(pb.LoadModelRequest(model=str(gemma2_dir)))
        with pytest.raises(grpc.RpcError) as info:
            stub.DetermineMemory(pb.DetermineMemoryRequest(kv_bits=8))
        assert code_of(info.value) == grpc.StatusCode.INVALID_ARGUMENT
        assert details_of(info.value).startswith(
            "DetermineMemory.kv_bits 8: this model's attention (mlx_lm.models.gemma2) does "
            "not run on a quantized KV cache (TypeError: expand_dims(): incompatible function "
            "arguments); leave kv_bits 0"
        )
        assert stub.GetInfo(pb.GetInfoRequest()).state == pb.WORKER_STATE_MODEL_LOADED
        assert stub.DetermineMemory(pb.DetermineMemoryRequest()).bytes_per_block > 0
