"""Single-row forwards through fused sibling projections: the unfused model's results."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from driver import bring_up, drive, greedy, live_server, mlx_lm_tokens
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from tiny_model import random_llama

from mlx_worker_svc.engine.options import EngineOptions
from mlx_worker_svc.engine.rewrite import decode_step, dequant, fused
from mlx_worker_svc.rpc.server import ServerConfig

KINDS = ["float32", "bfloat16", "float16", "4bit"]


tiny_llama = random_llama


def greedy_run(model: llama.Model, prompt: list[int], steps: int) -> tuple[list[int], mx.array]:
    """Greedy tokens of single-row decode steps, and the last step's logits."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits, axis=-1).item()))  # type: ignore[arg-type]
        logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1, :]
    return tokens, logits


@pytest.mark.parametrize("kind", KINDS)
def test_single_row_decode_is_bit_identical_to_the_unfused_model(kind: str) -> None:
    plain, fast = tiny_llama(kind), tiny_llama(kind)
    # 2 layers: (q, k, v) and (gate, up) in each.
    assert fused.install(fast) == 4
    ours, our_logits = greedy_run(fast, [3, 1, 4, 1, 5], 12)
    theirs, their_logits = greedy_run(plain, [3, 1, 4, 1, 5], 12)
    assert ours == theirs
    assert mx.array_equal(our_logits, their_logits)


@pytest.mark.parametrize("kind", ["float32", "4bit"])
def test_batched_and_prompt_forwards_run_the_layers_as_before(kind: str) -> None:
    plain, fast = tiny_llama(kind), tiny_llama(kind)
    fused.install(fast)
    for tokens in ([[1, 2, 3, 4]], [[1], [2], [3]], [[5, 6], [7, 8]]):
        assert mx.array_equal(fast(mx.array(tokens)), plain(mx.array(tokens)))


def fused_products(model: llama.Model, tokens: list[list[int]]) -> int:
    """How many fused products one forward of `tokens` multiplies."""
    groups = {id(p.group): p.group for _, p in model.named_modules() if hasattr(p, "group")}
    originals = {key: group.fused for key, group in groups.items()}
    calls = []

    def counting(inner: nn.Module) -> object:
        def call(x: mx.array) -> mx.array:
            calls.append(x.shape)
            return inner(x)

        return call

    for key, group in groups.items():
        group.fused = counting(originals[key])
    try:
        mx.eval(model(mx.array(tokens)))
    finally:
        for key, group in groups.items():
            group.fused = originals[key]
    return len(calls)


def test_decode_steps_of_plain_groups_are_fused_at_any_batch_size() -> None:
    plain, fast = tiny_llama("bfloat16"), tiny_llama("bfloat16")
    fused.install(fast)
    # 2 layers x (q/k/v, gate/up): 4 products a forward, when fused.
    assert fused_products(fast, [[1]]) == 4
    assert fused_products(fast, [[1], [2], [3]]) == 4
    assert fused_products(fast, [[1, 2, 3]]) == 0  # a prompt runs the layers as before
    assert fused_products(fast, [[1, 2], [3, 4]]) == 0
    ours, _ = greedy_run(fast, [3, 1, 4], 4)
    assert ours == greedy_run(plain, [3, 1, 4], 4)[0]


def test_quantized_groups_fuse_single_rows_only() -> None:
    model = tiny_llama("4bit")
    fused.install(model)
    assert fused_products(model, [[1]]) == 4
    # Their decode batches switch to dequantized weights at large sizes (dequant.py).
    assert fused_products(model, [[1], [2]]) == 0


def test_parameters_are_listed_once_and_shared_not_copied() -> None:
    plain, fast = tiny_llama("4bit"), tiny_llama("4bit")
    fused.install(fast)

    def nbytes(model: nn.Module) -> int:
        return sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    assert nbytes(fast) == nbytes(plain)
    names = {k for k, _ in tree_flatten(fast.parameters())}
    assert "model.layers.0.self_attn.k_proj.inner.scales" in names
    assert not any("group" in name or "fused" in name for name in names)
    # Each layer keeps its own rows of the group's arrays.
    attention = fast.model.layers[0].self_attn
    group = attention.k_proj.group
    start = attention.q_proj.inner.weight.shape[0]
    stop = start + attention.k_proj.inner.weight.shape[0]
    assert mx.array_equal(attention.k_proj.inner.weight, group.fused.weight[start:stop])
    assert mx.array_equal(
        attention.k_proj.inner.weight, plain.model.layers[0].self_attn.k_proj.weight
    )


def test_any_call_order_gets_each_layers_own_columns() -> None:
    plain, fast = tiny_llama("float32"), tiny_llama("float32")
    fused.install(fast)
    x = mx.random.normal((1, 1, plain.args.hidden_size))
    mine, theirs = fast.model.layers[1].self_attn, plain.model.layers[1].self_attn
    # v first, k twice, then q: every call is that layer's product.
    for name in ("v_proj", "k_proj", "k_proj", "q_proj", "v_proj"):
        assert mx.array_equal(getattr(mine, name)(x), getattr(theirs, name)(x)), name
    # Another input for q while k and v of the first are still owed.
    y = mx.random.normal((1, 1, plain.args.hidden_size))
    assert mx.array_equal(mine.q_proj(x), theirs.q_proj(x))
    assert mx.array_equal(mine.q_proj(y), theirs.q_proj(y))
    assert mx.array_equal(mine.k_proj(x), theirs.k_proj(x))


def test_nothing_is_held_once_every_part_is_taken() -> None:
    model = tiny_llama("float32")
    fused.install(model)
    greedy_run(model, [1, 2], 2)
    for layer in model.model.layers:
        for projection in (layer.self_attn.q_proj, layer.mlp.gate_proj):
            assert projection.group._input is None
            assert all(part is None for part in projection.group._parts)


def test_only_layers_of_one_kind_are_fused() -> None:
    model = tiny_llama("float32")
    attention = model.model.layers[0].self_attn
    # A different input dtype for one sibling: that group stays as it is.
    attention.k_proj.set_dtype(mx.float16)
    assert fused.install(model) == 3
    assert type(attention.q_proj) is nn.Linear
    assert type(model.model.layers[0].mlp.up_proj) is fused.FusedProjection
    assert fused.install(model) == 0  # installing twice changes nothing


def test_biases_are_concatenated_with_the_weights() -> None:
    plain = tiny_llama("float32", attention_bias=True)
    fast = tiny_llama("float32", attention_bias=True)
    assert fused.install(fast) == 4
    ours, our_logits = greedy_run(fast, [9, 8, 7], 6)
    theirs, their_logits = greedy_run(plain, [9, 8, 7], 6)
    assert ours == theirs
    assert mx.array_equal(our_logits, their_logits)


def test_large_quantized_batches_still_switch_to_dequantized_weights() -> None:
    plain, fast = tiny_llama("4bit"), tiny_llama("4bit")
    fused.install(fast)
    # The fused layers' own (inner) layers: 2 layers x 7 projections, and the embedding.
    assert dequant.install(fast, min_rows=4) == 15
    dequant.install(plain, min_rows=4)
    tokens = mx.array([[i] for i in range(8)])
    with dequant.rows(fast, 8), dequant.rows(plain, 8):
        assert mx.array_equal(fast(tokens), plain(tokens))


def test_the_worker_decodes_through_fused_layers_and_its_own_step_with_mlx_lm_tokens(
    tiny_dir: Path,
) -> None:
    prompts = [[1, 2, 3], [7] * 9, [300, 5, 11, 12]]
    reference = mlx_lm_tokens(tiny_dir, prompts, 12)
    # On here whatever the backend (the default is on with CUDA only).
    with live_server(ServerConfig(port=0, engine=EngineOptions(fuse=True))) as (server, stub):
        epoch = bring_up(stub, tiny_dir)
        loaded = server.worker.core.loaded
        assert loaded is not None
        model = loaded.model  # the runner fused it at InitCache
        assert type(model.model.layers[0].self_attn.q_proj) is fused.FusedProjection
        assert getattr(model, decode_step._ATTRIBUTE, None) is not None  # its own decode step
        params = greedy(12, ignore_eos=True)
        alone = [drive(stub, epoch, [p], max_tokens=12, params=params)[0] for p in prompts]
        together = drive(stub, epoch, prompts, max_tokens=12, params=params)
    assert alone == reference
    assert together == reference
