"""`fleet --kv-bits`: the workers the fleet brings up store quantized KV, and Status says so."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from processes import Fleet, WorkerPool
from tiny_model import build_tiny_model

from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb


def test_a_fleet_brings_a_bare_worker_up_with_8bit_kv(
    tmp_path_factory: pytest.TempPathFactory,
    smollm_dir: Path,
    start_fleet: Callable[..., Fleet],
) -> None:
    model = build_tiny_model(tmp_path_factory.mktemp("kv") / "model", smollm_dir, head_dim=64)
    pool = WorkerPool(model, 1, auto_init=False)
    try:
        pool.start()
        fleet = start_fleet(pool.targets, "--model", str(model), "--kv-bits", "8")
        kv = fleet.worker(pool.targets[0]).kv
        assert (kv.kv_bits, kv.kv_group_size) == (8, 64) and kv.num_blocks > 0
        request = pb.GenerateRequest(
            prompt_token_ids=[1, 2, 3],
            sampling_params=pb.SamplingParams(max_tokens=4, ignore_eos=True),
        )
        assert sum(len(r.token_ids) for r in fleet.generate(request)) == 4
    finally:
        pool.reap()
