"""One-token decode steps of a llama model, built from fewer graph nodes.

What: `install` builds, for an mlx-lm llama whose projections
`engine/rewrite/fused.py` fused, a decode step that keeps the residual stream
`[B, D]` and makes heads by one reshape, where mlx-lm's modules treat the step
as a prompt of length 1 (flattening, unflattening and transposing around every
product). `logits(model, tokens, cache)` runs it, or the model itself where
none is installed (other architectures; quantized, biased or sharded layers;
sliding windows; fused products off). Why: a GPU decode step is bound by the
host, node by node.
Invariants: the same primitives on the same values in the same order as the
model's forward (its rope, its cache's `update_and_fetch` and mask, mlx-lm's
attention), so the logits equal the model's bit for bit
(`tests/engine/rewrite/test_decode_step.py`); the step holds the weights the
model had at install, which do not change under a runner. Measurements:
BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import mlx.core as mx
from mlx import nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_worker_svc.engine.rewrite import fused, transposed

_ATTRIBUTE = "_mlx_worker_decode_step"
_PLAIN_LINEAR = (nn.Linear, transposed.TransposedLinear)
_PLAIN_EMBEDDING = (nn.Embedding, transposed.TransposedEmbedding)


class _Layer(NamedTuple):
    attention_norm: mx.array
    attention_eps: float
    qkv: mx.array  # transposed views, [in, out]
    qkv_splits: list[int]
    heads: int
    kv_heads: int
    scale: float
    rope: Callable[..., mx.array]
    output: mx.array
    mlp_norm: mx.array
    mlp_eps: float
    gate_up: mx.array
    gate_rows: int
    down: mx.array


class LlamaDecodeStep:
    """A llama model's one-token decode step: `[B]` tokens to `[B, vocab]` logits."""

    def __init__(
        self, embed: mx.array, layers: list[_Layer], norm: tuple[mx.array, float], head: mx.array
    ) -> None:
        self.embed = embed
        self.layers = layers
        self.norm, self.eps = norm
        self.head = head

    def __call__(self, tokens: mx.array, cache: Sequence[Any]) -> mx.array:
        rows = tokens.shape[0]
        h = self.embed[tokens]
        first = cache[0]
        # As create_attention_mask for one token: the cache's mask, if it makes one.
        mask = None
        if first and hasattr(first, "make_mask"):
            mask = first.make_mask(1, return_array=False, window_size=None)
        for layer, c in zip(self.layers, cache, strict=True):
            x = mx.fast.rms_norm(h, layer.attention_norm, layer.attention_eps)
            q, k, v = mx.split(x @ layer.qkv, layer.qkv_splits, axis=-1)
            q = layer.rope(q.reshape(rows, layer.heads, 1, -1), offset=c.offset)
            k = layer.rope(k.reshape(rows, layer.kv_heads, 1, -1), offset=c.offset)
            k, v = c.update_and_fetch(k, v.reshape(rows, layer.kv_heads, 1, -1))
            o = scaled_dot_product_attention(q, k, v, cache=c, scale=layer.scale, mask=mask)
            h = h + o.reshape(rows, -1) @ layer.output
            x = mx.fast.rms_norm(h, layer.mlp_norm, layer.mlp_eps)
            gate, up = mx.split(x @ layer.gate_up, [layer.gate_rows], axis=-1)
            h = h + swiglu(gate, up) @ layer.down
        out: mx.array = mx.fast.rms_norm(h, self.norm, self.eps) @ self.head
        return out


def logits(
    model: nn.Module, tokens: mx.array, cache: Sequence[Any], *, adapted: bool = False
) -> mx.array:
    """A decode step's logits `[B, vocab]` for `tokens` `[B]` (one token per cache row).

    `adapted`: some row runs a LoRA adapter (engine/lora), whose deltas live in
    the model's layers, so the model runs itself.
    """
    step: LlamaDecodeStep | None = getattr(model, _ATTRIBUTE, None)
    if step is not None and not adapted:
        return step(tokens, cache)
    out: mx.array = model(tokens[:, None], cache=cache)
    return out[:, -1, :]


def _plain(layer: Any) -> mx.array | None:
    """A bias-free plain linear layer's transposed weight (a view); else None."""
    if type(layer) not in _PLAIN_LINEAR or "bias" in layer:
        return None
    view: mx.array = layer["weight"].T
    return view


def _group(first: Any, count: int) -> tuple[mx.array, list[int]] | None:
    """The fused group `first` leads: its weight's view and its split points."""
    if type(first) is not fused.FusedProjection or first.index != 0:
        return None
    if len(first.group.splits) != count - 1:
        return None
    view = _plain(first.group.fused)
    return None if view is None else (view, first.group.splits)


def _layer(block: Any) -> _Layer | None:
    attention, mlp = block.self_attn, block.mlp
    norms = (block.input_layernorm, block.post_attention_layernorm)
    if any(type(n) is not nn.RMSNorm for n in norms) or getattr(block, "use_sliding", False):
        return None
    qkv, gate_up = _group(attention.q_proj, 3), _group(mlp.gate_proj, 2)
    output, down = _plain(attention.o_proj), _plain(mlp.down_proj)
    if qkv is None or gate_up is None or output is None or down is None:
        return None
    return _Layer(
        norms[0]["weight"],
        norms[0].eps,
        qkv[0],
        qkv[1],
        attention.n_heads,
        attention.n_kv_heads,
        attention.scale,
        attention.rope,
        output,
        norms[1]["weight"],
        norms[1].eps,
        gate_up[0],
        gate_up[1][0],
        down,
    )


def _llama_step(model: nn.Module) -> LlamaDecodeStep | None:
    if type(model).__module__ != "mlx_lm.models.llama" or type(model).__name__ != "Model":
        return None
    inner = model.model
    if type(inner.embed_tokens) not in _PLAIN_EMBEDDING or type(inner.norm) is not nn.RMSNorm:
        return None
    layers = []
    for block in inner.layers:
        layer = _layer(block)
        if layer is None:
            return None
        layers.append(layer)
    if model.args.tie_word_embeddings:
        head: mx.array | None = inner.embed_tokens["weight"].T
    else:
        head = _plain(model.lm_head)
    if not layers or head is None:
        return None
    # The views, made once: later steps read them as evaluated arrays.
    mx.eval(head, [(layer.qkv, layer.output, layer.gate_up, layer.down) for layer in layers])
    norm = (inner.norm["weight"], inner.norm.eps)
    return LlamaDecodeStep(inner.embed_tokens["weight"], layers, norm, head)


def install(model: nn.Module) -> bool:
    """Gives `model` its own decode step where it qualifies (see above); whether it did."""
    step = _llama_step(model)
    if step is not None:
        object.__setattr__(model, _ATTRIBUTE, step)
    return step is not None
