"""A worker group with quantized KV: every rank keeps InitCache's format.

`serve --world-size 2 --kv-bits 4` on a tiny llama whose heads are 64 wide (so
mlx-lm's default group of 64 divides them), tensor parallel: each rank holds
the KV of its own heads. Its tokens must equal a single worker's with the same
KV format. A rank left with float KV would compute half the heads from other
keys and values, so the test first checks that this model's 4-bit tokens
differ from float KV's: equal tokens then show both ranks quantize.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from driver import drive, epoch_of, greedy, live_server
from engine.group.ranks import Group
from processes import distinct_prompts
from tiny_model import build_tiny_model

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

BITS, GROUP = 4, 64
TOKENS = 16


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("group-kv") / "model", smollm_dir, head_dim=64)


def _single_tokens(model: Path, prompts: list[list[int]], bits: int) -> list[list[int]]:
    """A single in-process worker's greedy tokens with `bits`-bit KV (0: float)."""
    with live_server() as (_, stub):
        stub.InitDevice(pb.InitDeviceRequest())
        epoch = int(stub.LoadModel(pb.LoadModelRequest(model=str(model))).worker_epoch)
        group = GROUP if bits else 0
        stub.DetermineMemory(
            pb.DetermineMemoryRequest(
                max_num_batched_tokens=64, block_size=16, kv_bits=bits, kv_group_size=group
            )
        )
        stub.InitCache(pb.InitCacheRequest(num_blocks=2048, kv_bits=bits, kv_group_size=group))
        return _tokens(stub, epoch, prompts)


def _tokens(
    stub: pb_grpc.WorkerServiceStub, epoch: int, prompts: list[list[int]]
) -> list[list[int]]:
    params = greedy(TOKENS, ignore_eos=True)
    return drive(stub, epoch, prompts, max_tokens=TOKENS, params=params)


def test_a_group_with_quantized_kv_gives_a_single_workers_tokens(
    start_group: Callable[..., Group], wide_heads: Path
) -> None:
    prompts = distinct_prompts(4, 20, seed=31)
    expected = _single_tokens(wide_heads, prompts, BITS)
    assert expected != _single_tokens(wide_heads, prompts, 0), "4-bit KV changes no token here"
    group = start_group("--kv-bits", str(BITS), model=wide_heads)
    kv = group.stub.GetInfo(pb.GetInfoRequest()).kv
    assert (kv.kv_bits, kv.kv_group_size) == (BITS, GROUP)
    assert group.stub.GetInfo(pb.GetInfoRequest()).device.world_size == 2
    assert _tokens(group.stub, epoch_of(group.stub), prompts) == expected
    # Chunked again, each prompt's first block from every rank's quantized prefix cache.
    got = drive(
        group.stub,
        epoch_of(group.stub),
        prompts,
        max_tokens=TOKENS,
        chunk=5,
        params=greedy(TOKENS, ignore_eos=True),
    )
    assert group.stub.GetInfo(pb.GetInfoRequest()).kv.prefix_cache_blocks >= len(prompts)
    assert got == expected
