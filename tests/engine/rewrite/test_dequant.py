"""Quantized models: large decode batches on dequantized weights, the rest as before."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tiny_model import random_llama

from mlx_worker_svc.engine.rewrite import dequant


def tiny_llama(quantized: bool) -> llama.Model:
    return random_llama("4bit" if quantized else "float32", seed=5, tie_word_embeddings=True)


def test_install_switches_every_quantized_layer_and_nothing_else() -> None:
    # 2 layers x 7 projections, plus the tied embedding (also the output projection).
    assert dequant.install(tiny_llama(quantized=True), min_rows=32) == 15
    assert dequant.install(tiny_llama(quantized=False), min_rows=32) == 0
    # A threshold of 0 (never switch) registers nothing: forwards stay MLX's own.
    never = tiny_llama(quantized=True)
    assert dequant.install(never, min_rows=0) == 0
    with dequant.rows(never, 1024):
        assert nn.QuantizedLinear in {type(m) for _, m in never.named_modules()}


def test_few_rows_compute_exactly_as_before() -> None:
    plain, switched = tiny_llama(quantized=True), tiny_llama(quantized=True)
    dequant.install(switched, min_rows=4)
    tokens = mx.array([[1, 2, 3], [4, 5, 6]])
    with dequant.rows(switched, 2):
        assert mx.array_equal(switched(tokens), plain(tokens))


def test_many_rows_use_dequantized_weights() -> None:
    plain, switched = tiny_llama(quantized=True), tiny_llama(quantized=True)
    dequant.install(switched, min_rows=4)
    tokens = mx.array([[i] for i in range(8)])
    with dequant.rows(switched, 8):
        ours = switched(tokens)
    theirs = plain(tokens)
    # The same model: the same values up to the products' rounding.
    assert mx.allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    assert mx.array_equal(mx.argmax(ours, axis=-1), mx.argmax(theirs, axis=-1))
    # Outside the block the switched layers use the quantized kernel again.
    assert mx.array_equal(switched(tokens), theirs)


def test_the_switch_lasts_only_while_a_large_forward_is_built() -> None:
    model = tiny_llama(quantized=True)
    assert dequant.install(model, min_rows=4) == 15
    assert dequant.install(model, min_rows=4) == 15  # installing twice changes nothing

    def classes() -> set[type]:
        return {type(m) for _, m in model.named_modules() if hasattr(m, "group_size")}

    assert classes() == {nn.QuantizedLinear, nn.QuantizedEmbedding}  # MLX's own, untouched
    with pytest.raises(RuntimeError, match="mid-forward"), dequant.rows(model, 8):
        assert nn.QuantizedLinear not in classes()
        with dequant.rows(model, 2):  # a small forward inside: MLX's kernels again
            assert classes() == {nn.QuantizedLinear, nn.QuantizedEmbedding}
        assert nn.QuantizedLinear not in classes()
        raise RuntimeError("mid-forward")
    assert classes() == {nn.QuantizedLinear, nn.QuantizedEmbedding}
    # The model's parameters (what saving and sharding see) do not include the switch.
    assert all("dequant" not in name for name, _ in tree_flatten(model.parameters()))
