"""Linear layers with their weight's transposed view kept: the unchanged model's results."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from tiny_model import random_llama

from mlx_worker_svc.engine.rewrite import fused, transposed


def decode(
    model: llama.Model, rows: list[list[int]], steps: int
) -> tuple[list[mx.array], list[object]]:
    """Greedy decode of `rows` together: every step's logits, and the tokens."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(rows), cache=cache)[:, -1, :]
    seen, tokens = [logits], list[object]()
    for _ in range(steps):
        chosen = mx.argmax(logits, axis=-1)
        tokens.append(chosen.tolist())
        logits = model(chosen[:, None], cache=cache)[:, -1, :]
        seen.append(logits)
    return seen, tokens


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tied", [False, True])
def test_every_forward_is_bit_identical_to_the_unchanged_model(kind: str, tied: bool) -> None:
    plain = random_llama(kind, tie_word_embeddings=tied)
    fast = random_llama(kind, tie_word_embeddings=tied)
    # 2 layers x 7 projections, the embedding, and the output head unless tied.
    assert transposed.install(fast) == 15 + (0 if tied else 1)
    for rows in ([[3, 1, 4, 1, 5]], [[2, 7], [1, 8], [2, 8]]):
        ours, our_tokens = decode(fast, rows, 6)
        theirs, their_tokens = decode(plain, rows, 6)
        assert our_tokens == their_tokens
        for a, b in zip(ours, theirs, strict=True):
            assert mx.array_equal(a, b)


def test_parameters_and_their_names_are_untouched() -> None:
    plain, fast = random_llama(), random_llama()
    transposed.install(fast)
    assert type(fast.model.layers[0].self_attn.q_proj) is transposed.TransposedLinear
    assert type(fast.model.embed_tokens) is transposed.TransposedEmbedding
    ours, theirs = tree_flatten(fast.parameters()), tree_flatten(plain.parameters())
    assert [k for k, _ in ours] == [k for k, _ in theirs]
    assert sum(v.nbytes for _, v in ours) == sum(v.nbytes for _, v in theirs)


def test_a_replaced_weight_is_used_from_the_next_call_on() -> None:
    layer = nn.Linear(8, 4)
    transposed.adopt(layer)
    x = mx.random.normal((2, 8))
    assert mx.array_equal(layer(x), x @ layer.weight.T + layer.bias)
    layer.update({"weight": layer.weight * 3})
    assert mx.array_equal(layer(x), mx.addmm(layer.bias, x, layer.weight.T))
    assert mx.array_equal(layer(x), x @ layer.weight.T + layer.bias)


def test_a_copy_gets_its_own_view() -> None:
    layer = nn.Linear(8, 4, bias=False)
    transposed.adopt(layer)
    twin = copy.copy(layer)
    transposed.adopt(twin)
    twin.update({"weight": mx.zeros_like(layer.weight)})
    x = mx.random.normal((1, 8))
    for _ in range(2):  # alternating calls: each keeps its own view
        assert mx.array_equal(layer(x), x @ layer.weight.T)
        assert not mx.any(twin(x)).item()


def test_quantized_layers_are_left_alone() -> None:
    quantized = random_llama("4bit")
    assert transposed.install(quantized) == 0
    assert type(quantized.model.layers[0].mlp.down_proj) is nn.QuantizedLinear


def test_fused_single_row_products_use_views_of_their_own() -> None:
    plain, fast = random_llama("bfloat16"), random_llama("bfloat16")
    fused.install(fast)
    transposed.install(fast)
    group = fast.model.layers[0].self_attn.q_proj.group
    assert type(group.fused) is transposed.TransposedLinear
    inner = fast.model.layers[0].self_attn.q_proj.inner
    assert group.fused._transposed is not inner._transposed
    for rows in ([[9, 8, 7]], [[1, 2], [3, 4]]):
        ours, our_tokens = decode(fast, rows, 6)
        theirs, their_tokens = decode(plain, rows, 6)
        assert our_tokens == their_tokens
        assert all(mx.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
