"""Splitting a loaded model over a worker group, so each rank holds its share.

Tensor parallel (mlx-lm's `Model.shard`) where the attention and KV head
counts divide by the group size: every rank holds a slice of every layer and
the layers' own `all_sum` joins the slices. Pipeline otherwise: each rank
holds a run of whole layers, through mlx-lm's `model.pipeline` where the
model has it, and through `LlamaStage` for llama models (the embedded
SmolLM2 among them: 9 heads do not divide by 2), which mlx-lm cannot
pipeline. mlx-lm leaves the embedding and the output head on every
rank, and with a large vocabulary they are a large part of a small model, so
in tensor parallel mode they are split too: each rank holds a slice of the
vocabulary rows; a lookup is a masked lookup plus an `all_sum` (exact: one rank
contributes the row, the others zeros) and the logits are an `all_gather` of
the slices, identical on every rank. (Not in pipeline mode: there only the
first stage embeds, so a collective inside the embedding would never pair up.)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from mlx_worker_svc.core.errors import InvalidArgument
from mlx_worker_svc.core.reports import Parallelism

_VOCAB_MODULES = (nn.Embedding, nn.QuantizedEmbedding, nn.Linear, nn.QuantizedLinear)


def _count(model: nn.Module, *names: str) -> int:
    args = getattr(model, "args", None)
    for name in names:
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def choose(model: nn.Module, size: int) -> Parallelism:
    """Tensor parallel where the head counts divide by `size`, else pipeline."""
    heads = _count(model, "num_attention_heads", "n_heads")
    kv_heads = _count(model, "num_key_value_heads", "n_kv_heads") or heads
    if hasattr(model, "shard") and heads and heads % size == 0 and kv_heads % size == 0:
        return Parallelism.TENSOR
    inner = getattr(model, "model", None)
    layers = len(getattr(model, "layers", None) or [])
    if (hasattr(inner, "pipeline") or LlamaStage.fits(model)) and layers >= size:
        return Parallelism.PIPELINE
    model_type = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
    raise InvalidArgument(
        f"the model ({model_type}, {heads} attention / {kv_heads} KV heads, {layers} layers) "
        f"cannot be split over {size} ranks: the head counts do not divide by {size}, and "
        "it has no pipeline mode (mlx-lm's, or a llama's) with a layer for every rank; "
        "use a group size that divides the heads"
    )


def _copy(value: mx.array) -> mx.array:
    # A slice is a view that would keep the whole tensor alive: copy it out.
    return mx.contiguous(mx.concatenate([value]))


class _VocabSlice(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped
    """Rows [start, start + rows) of a vocabulary-sized embedding or head."""

    def __init__(self, inner: nn.Module, vocab: int, group: Any) -> None:
        super().__init__()
        size, rank = group.size(), group.rank()
        self.per_rank = -(-vocab // size)
        self.start = min(rank * self.per_rank, vocab)
        self.rows = min(vocab, self.start + self.per_rank) - self.start
        self.vocab = vocab
        self.group = group
        end = self.start + self.rows
        inner.update({k: _copy(v[self.start : end]) for k, v in inner.parameters().items()})
        self.inner = inner

    def gather_logits(self, part: mx.array) -> mx.array:
        """The full [..., vocab] logits from this rank's [..., rows] slice."""
        if self.rows < self.per_rank:
            pad = [(0, 0)] * (part.ndim - 1) + [(0, self.per_rank - self.rows)]
            part = mx.pad(part, pad)
        rows_first = mx.moveaxis(part, -1, 0)
        gathered = mx.distributed.all_gather(rows_first, group=self.group)
        return mx.moveaxis(gathered, 0, -1)[..., : self.vocab]


class VocabShardedEmbedding(_VocabSlice):
    def __call__(self, ids: mx.array) -> mx.array:
        local = ids.astype(mx.int32) - self.start
        inside = (local >= 0) & (local < self.rows)
        rows: mx.array = self.inner(mx.where(inside, local, 0))
        rows = mx.where(inside[..., None], rows, mx.zeros_like(rows))
        return mx.distributed.all_sum(rows, group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.gather_logits(self.inner.as_linear(x))


class VocabShardedLinear(_VocabSlice):
    def __call__(self, x: mx.array) -> mx.array:
        return self.gather_logits(self.inner(x))


def _rows(module: nn.Module) -> int:
    weight = module.parameters().get("weight")
    return int(weight.shape[0]) if isinstance(weight, mx.array) else 0


def shard_vocab(model: nn.Module, group: Any) -> int:
    """Splits the embedding and output head rows over `group`; returns how many."""
    vocab = _count(model, "vocab_size")
    replaced = 0
    for path, module in list(model.named_modules()):
        if not path or not isinstance(module, _VOCAB_MODULES) or _rows(module) != vocab:
            continue
        embedding = isinstance(module, nn.Embedding | nn.QuantizedEmbedding)
        if not embedding and not path.endswith("lm_head"):
            continue
        *parents, name = path.split(".")
        parent: Any = model
        for part in parents:
            parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
        wrapper = (VocabShardedEmbedding if embedding else VocabShardedLinear)(module, vocab, group)
        setattr(parent, name, wrapper)
        replaced += 1
    return replaced


def shard(model: nn.Module, group: Any) -> Parallelism:
    """Splits `model` (lazily loaded) over `group` in place; returns how."""
    mode = choose(model, group.size())
    if mode is Parallelism.TENSOR:
        model.shard(group)
        shard_vocab(model, group)
    elif hasattr(model.model, "pipeline"):
        model.model.pipeline(group)
    else:
        model.model = LlamaStage(model.model, group)
    return mode


class LlamaStage(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped
    """One rank's run of a llama model's layers, in mlx-lm's pipeline order.

    Rank 0 runs the last layers and rank N-1 the first: each rank receives the
    hidden state from the rank above it, runs its layers and sends the result
    down; rank 0's final state is then gathered to every rank, which all
    compute the same logits. The other layers' weights are dropped before
    they are read.
    """

    def __init__(self, inner: Any, group: Any) -> None:
        super().__init__()
        self.rank, self.size, self.group = group.rank(), group.size(), group
        base, extra = divmod(len(inner.layers), self.size)
        counts = [base + (1 if r < extra else 0) for r in range(self.size)]
        start = sum(counts[self.rank + 1 :])
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers[start : start + counts[self.rank]]
        self.norm = inner.norm
        # What a layer hands the next one (float32 after float16 embeddings, say): the
        # state crosses ranks in it. Found from the graph of two layers, never computed.
        probe = self.embed_tokens(mx.zeros((1, 1), dtype=mx.uint32))
        for _ in range(2):
            probe = self.layers[0](probe, None, cache=None)
        self.hidden_dtype = probe.dtype

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """A llama model with no sliding-window layers (one attention mask for all)."""
        inner = getattr(model, "model", None)
        if not isinstance(inner, llama.LlamaModel):
            return False
        return not any(getattr(layer, "use_sliding", False) for layer in inner.layers)

    def __call__(
        self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None
    ) -> mx.array:
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        if self.rank < self.size - 1:
            h = mx.distributed.recv(h.shape, self.hidden_dtype, self.rank + 1, group=self.group)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, mask, cache=layer_cache)
        h = h.astype(self.hidden_dtype)
        if self.rank > 0:
            h = mx.distributed.send(h, self.rank - 1, group=self.group)
            if cache[-1] is not None:
                # Evaluating the cache (a prefill) must run the send too.
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        h = mx.distributed.all_gather(h, group=self.group)[: h.shape[0]]
        out: mx.array = self.norm(h)
        return out
