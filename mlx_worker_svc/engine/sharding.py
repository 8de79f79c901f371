"""Splitting a loaded model over a worker group, so each rank holds its share.

Tensor parallel (mlx-lm's `Model.shard`) where the attention and KV head
counts divide by the group size: every rank holds a slice of every layer and
the layers' own `all_sum` joins the slices. Pipeline (mlx-lm's
`model.pipeline`) otherwise, where the model supports it: each rank holds a
run of whole layers. mlx-lm leaves the embedding and the output head on every
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

from mlx_worker_svc.domain import Parallelism
from mlx_worker_svc.errors import InvalidArgument

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
    if hasattr(inner, "pipeline") and layers >= size:
        return Parallelism.PIPELINE
    model_type = getattr(getattr(model, "args", None), "model_type", type(model).__name__)
    raise InvalidArgument(
        f"the model ({model_type}, {heads} attention / {kv_heads} KV heads, {layers} layers) "
        f"cannot be split over {size} ranks: the head counts do not divide by {size} and "
        "mlx-lm has no pipeline mode for it; use a group size that divides the heads"
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
    else:
        model.model.pipeline(group)
    return mode
