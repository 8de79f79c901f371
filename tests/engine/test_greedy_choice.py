"""The CPU's greedy choice: the raw argmax where it is mlx-lm's pick, mlx-lm's rule elsewhere."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import pytest

from mlx_worker_svc.client.execute_loop import run_prompts
from mlx_worker_svc.engine import sampling
from mlx_worker_svc.engine.sampling import Choice, greedy, greedy_choice
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2 as pb
from mlx_worker_svc.gen.mlx_worker.v1 import worker_pb2_grpc as pb_grpc

DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _read(choice: Choice) -> tuple[list[int], list[int], list[bool]]:
    mx.eval(choice.arrays())
    chosen, held = choice.read()
    assert choice.unsure is not None
    return chosen, held, [bool(u) for u in cast(list[bool], choice.unsure.tolist())]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_random_logits_get_mlx_lms_greedy_tokens(dtype: mx.Dtype, rows: int) -> None:
    mx.random.seed(rows)
    for scale in (0.5, 4.0, 40.0):
        logits = (mx.random.normal((rows, 5000)) * scale).astype(dtype)
        chosen, held, _ = _read(greedy_choice(logits))
        assert chosen == greedy(logits).tolist()
        assert held == mx.argmax(logits, axis=-1).tolist()


def test_float32_rows_with_a_clear_top_take_the_argmax_without_the_logsumexp() -> None:
    mx.random.seed(0)
    logits = mx.random.normal((32, 49152))
    chosen, held, unsure = _read(greedy_choice(logits))
    assert not any(unsure)
    assert chosen == held == greedy(logits).tolist()


def test_a_lower_id_that_rounds_level_with_the_top_wins_as_in_mlx_lm() -> None:
    # bf16: 1 - 2**-7 and 1 both minus a logsumexp near 7.9 round to one value,
    # so mlx-lm's argmax picks id 5, the raw argmax id 9.
    row = [0.0] * 1000
    row[5], row[9] = 1.0 - 2**-7, 1.0
    clear = [0.0] * 1000
    clear[3] = 6.0
    logits = mx.array([row, clear], dtype=mx.bfloat16)
    assert greedy(logits).tolist() == [5, 3]
    chosen, held, unsure = _read(greedy_choice(logits))
    assert unsure == [True, False]
    assert held == [9, 3] and chosen == [5, 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_and_non_finite_rows_follow_mlx_lms_rule(dtype: mx.Dtype) -> None:
    vocab = 64
    masked = [-float("inf")] * vocab
    masked[40], masked[50] = 2.0, 2.5
    big = [0.0] * vocab
    big[7], big[8] = 30000.0, 30000.0 + 32.0  # fp16's top half: the logsumexp may overflow
    rows = [masked, [-float("inf")] * vocab, big]
    logits = mx.array(rows).astype(dtype)
    chosen, _, unsure = _read(greedy_choice(logits))
    assert chosen == greedy(logits).tolist()
    assert unsure[0] is False and unsure[1] is True


def test_tokens_hold_when_every_queued_forward_ran_on_other_tokens(
    tiny_stub: pb_grpc.WorkerServiceStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step's look-ahead is queued on wrong tokens and rolled back: the tokens equal
    a run without that, so a row whose unsure choice changes loses nothing."""
    epoch = int(tiny_stub.GetInfo(pb.GetInfoRequest()).worker_epoch)
    prompts = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 20, [42]]
    params = pb.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def tokens(prefix: str) -> list[list[int]]:
        ids = [f"{prefix}{i}" for i in range(len(prompts))]
        result = run_prompts(tiny_stub.Execute, epoch, prompts, params, req_ids=ids)
        return [[t for m in out for t in m.sampled_token_ids] for out in result.outputs]

    want = tokens("plain")

    def wrong_then_right(logits: mx.array) -> Choice:
        right = greedy(logits)
        wrong = (right + 1) % logits.shape[-1]
        return Choice(wrong, mx.ones(right.shape, dtype=mx.bool_), logits)

    monkeypatch.setattr(sampling, "greedy_choice", wrong_then_right)
    assert tokens("rolled") == want
    assert all(len(t) == 12 for t in want)
