"""gemma2's batches (engine/rewrite/grouped_mask.py): every row attends with its own mask.

mlx-lm's gemma2 attention puts the query heads a KV head serves in an axis of
their own, and a batch cache's mask, (B, 1, L, S), lined its rows up with the KV
heads: two requests of different lengths together got wrong tokens, four failed
with a broadcast error. Requests run together must give each one's tokens alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from driver import bring_up, drive, fresh_stub, greedy, mlx_lm_tokens
from tiny_model import build_tiny_gemma2

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
