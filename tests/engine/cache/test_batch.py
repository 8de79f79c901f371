"""The decode batch: its look-ahead and its mask-free aligned batches compute what was asked."""

from __future__ import annotations

from typing import cast

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
from tiny_model import tiny_config

from mlx_worker_svc.engine.cache.batch import (
    AlignedBatchKVCache,
    DecodeBatch,
    merge_caches,
    prefill_together,
)
from mlx_worker_svc.engine.sampling import greedy

VOCAB = 512


@pytest.fixture(scope="module")
def model() -> llama.Model:
    mx.random.seed(3)
    args = llama.ModelArgs.from_dict(tiny_config(vocab_size=VOCAB, tie_word_embeddings=True))
    return llama.Model(args)


def prefilled(model: llama.Model, prompt: list[int]) -> list[object]:
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def joined(model: llama.Model, prompts: list[list[int]]) -> DecodeBatch[str]:
    """A decode batch of the prompts, each prefilled alone (rows r0, r1, ...)."""
    batch: DecodeBatch[str] = DecodeBatch()
    batch.join([(f"r{i}", prefilled(model, p)) for i, p in enumerate(prompts)])
    return batch


def test_aligned_rows_need_no_mask(model: llama.Model) -> None:
    same = merge_caches([prefilled(model, [1, 2, 3]), prefilled(model, [4, 5, 6])])
    assert all(isinstance(c, AlignedBatchKVCache) and not c.padded for c in same)
    assert same[0].make_mask(1) is None
    ragged = merge_caches([prefilled(model, [1, 2, 3]), prefilled(model, [4, 5])])
    assert ragged[0].padded
    assert isinstance(ragged[0].make_mask(1), mx.array)


def test_aligned_batch_computes_what_the_masked_batch_computes(model: llama.Model) -> None:
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6], [5, 5, 5, 5]]
    ours = merge_caches([prefilled(model, p) for p in prompts])
    theirs = [
        BatchKVCache.merge([c[i] for c in [prefilled(model, p) for p in prompts]])
        for i in range(len(ours))
    ]
    step = mx.array([[11], [12], [13]])
    assert mx.array_equal(model(step, cache=ours), model(step, cache=theirs))


def test_extending_with_rows_of_another_length_pads(model: llama.Model) -> None:
    batch = merge_caches([prefilled(model, [1, 2]), prefilled(model, [3, 4])])
    batch[0].extend(merge_caches([prefilled(model, [5, 6, 7])])[0])
    assert batch[0].padded
    even = merge_caches([prefilled(model, [1, 2]), prefilled(model, [3, 4])])
    even[0].extend(merge_caches([prefilled(model, [5, 6])])[0])
    assert not even[0].padded


def greedy_rows(logits: mx.array) -> list[int]:
    return [int(t) for t in cast(list[int], mx.argmax(logits, axis=-1).tolist())]


def test_speculated_forward_equals_the_forward_it_stands_for(model: llama.Model) -> None:
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]

    plain, ahead = joined(model, prompts), joined(model, prompts)
    first = greedy_rows(plain.forward(model, [3, 6, 9]))
    logits = ahead.forward(model, [3, 6, 9])
    chosen = mx.argmax(logits, axis=-1)
    mx.async_eval(chosen)
    ahead.speculate(model, chosen)
    tokens = greedy_rows(logits)
    ahead.confirm(tokens)
    assert tokens == first
    # r1 leaves: the others keep their look-ahead, and it is what they would compute.
    plain.remove({"r1"})
    ahead.remove({"r1"})
    kept = [first[0], first[2]]
    expected = plain.forward(model, kept)
    assert mx.array_equal(ahead.forward(model, kept), expected)


def test_a_different_next_step_rolls_the_speculation_back(model: llama.Model) -> None:
    batch: DecodeBatch[str] = DecodeBatch()
    batch.join([("a", prefilled(model, [1, 2])), ("b", prefilled(model, [3, 4]))])
    reference: DecodeBatch[str] = DecodeBatch()
    reference.join([("a", prefilled(model, [1, 2])), ("b", prefilled(model, [3, 4]))])
    logits = batch.forward(model, [2, 4])
    chosen = mx.argmax(logits, axis=-1)
    batch.speculate(model, chosen)
    batch.confirm(greedy_rows(logits))
    reference.forward(model, [2, 4])
    # The scheduler asks for other tokens than the sampled ones: nothing speculative stays.
    assert mx.array_equal(batch.forward(model, [7, 7]), reference.forward(model, [7, 7]))
    # A row taken out carries no speculative token either.
    out = batch.extract({"a"})["a"]
    assert out[0].offset == reference.extract({"a"})["a"][0].offset


def test_rows_taken_out_during_a_speculation_leave_it_behind(model: llama.Model) -> None:
    prompts = [[1, 2], [3, 4], [5, 6]]

    plain, ahead = joined(model, prompts), joined(model, prompts)
    first = greedy_rows(plain.forward(model, [2, 4, 6]))
    logits = ahead.forward(model, [2, 4, 6])
    ahead.speculate(model, mx.argmax(logits, axis=-1))
    ahead.confirm(greedy_rows(logits))
    taken = ahead.extract({"r0"})["r0"]
    assert [c.offset for c in taken] == [c.offset for c in plain.extract({"r0"})["r0"]]
    kept = first[1:]
    assert mx.array_equal(ahead.forward(model, kept), plain.forward(model, kept))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_greedy_look_ahead_launches_the_next_choice_with_its_forward(
    model: llama.Model, rows: int
) -> None:
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]][:rows]
    last = [p[-1] for p in prompts]
    plain, ahead = joined(model, prompts), joined(model, prompts)
    first = plain.forward(model, last)
    assert plain.choice is None  # nothing was looked ahead
    tokens = greedy_rows(first)
    second = plain.forward(model, tokens)
    logits = ahead.forward(model, last)
    ahead.speculate(model, greedy(logits), greedy=True)
    ahead.confirm(tokens)
    assert mx.array_equal(ahead.forward(model, tokens), second)
    assert ahead.choice is not None
    assert ahead.choice.read()[0] == greedy(second).tolist()
    # The scheduler asks for other tokens: the choice goes with the look-ahead.
    ahead.speculate(model, greedy(second), greedy=True)
    ahead.confirm(greedy_rows(second))
    ahead.forward(model, [0] * rows)
    assert ahead.choice is None


def test_rows_leaving_a_greedy_look_ahead_have_their_choice_made_again(
    model: llama.Model,
) -> None:
    prompts = [[1, 2], [3, 4], [5, 6]]
    batch = joined(model, prompts)
    logits = batch.forward(model, [2, 4, 6])
    batch.speculate(model, greedy(logits), greedy=True)
    tokens = greedy_rows(logits)
    batch.confirm(tokens)
    batch.remove({"r1"})
    batch.forward(model, [tokens[0], tokens[2]])
    assert batch.choice is None


def test_prompts_prefilled_together_match_prompts_prefilled_alone(model: llama.Model) -> None:
    """The same KV and next logits up to rounding: a batched product may round differently
    from a single row's (OpenBLAS does, at float32's last digit), as in batched decode."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5], [5, 5, 5, 5, 5]]
    together = prefill_together(model, prompts)
    alone = [prefilled(model, p) for p in prompts]
    for mine, theirs in zip(together, alone, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            ours, ref = cast(KVCache, a), cast(KVCache, b)
            assert type(ours) is KVCache is type(ref) and ours.offset == ref.offset == 5
            for x, y in ((ours.keys, ref.keys), (ours.values, ref.values)):
                assert x.shape[2] == 5 and mx.allclose(x, y[..., :5, :], rtol=1e-4, atol=1e-5)
        step = mx.array([[11]])
        logits, expected = model(step, cache=mine), model(step, cache=theirs)
        assert mx.allclose(logits, expected, rtol=1e-4, atol=1e-4)
        assert mx.argmax(logits).item() == mx.argmax(expected).item()


def test_prefill_groups_take_equal_lengths_up_to_one_chunk() -> None:
    from mlx_worker_svc.core.domain import Origin
    from mlx_worker_svc.engine.admission import PREFILL_STEP, prefill_groups

    def key(name: str) -> tuple[Origin, str]:
        return (Origin.EXECUTE, name)

    ends = {key("a"): 3, key("b"): 3, key("c"): 5, key("d"): 3, key("e"): 0}
    assert prefill_groups(ends) == [[key("a"), key("b"), key("d")]]
    half = PREFILL_STEP // 2
    big = {key(str(i)): half for i in range(5)}
    assert prefill_groups(big) == [[key("0"), key("1")], [key("2"), key("3")]]
    assert prefill_groups({key("x"): PREFILL_STEP + 1, key("y"): PREFILL_STEP + 1}) == []
