"""Linear layers multiply by a transposed view of their weight made once.

What: `install` switches a loaded model's plain linear layers (and a plain
embedding, for tied heads) to subclasses that keep `weight.T`, made once with
the weight it came from, instead of adding a transpose to the graph in every
call. Why: a GPU decode step is bound by the host's graph building
(`engine/rewrite/fused.py`), and those views never change.
Invariants: the product is the same operation on the same arrays (buffer,
shape, strides), so results are the unchanged model's bit for bit
(`tests/engine/rewrite/test_transposed.py`); a replaced weight (`model.update`,
a reload) gets a new view on the next call; parameters, their names and saving
are untouched, and the view shares the weight's memory. Always installed: it
computes what the unchanged model computes. Measurements: BENCHMARKS.md.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn


class _View:
    """A weight and its transposed view (a plain object: no parameter, not saved)."""

    __slots__ = ("view", "weight")

    def __init__(self) -> None:
        self.weight: mx.array | None = None
        self.view: mx.array | None = None

    def of(self, weight: mx.array) -> mx.array:
        if weight is not self.weight or self.view is None:
            self.weight, self.view = weight, weight.T
        return self.view


class TransposedLinear(nn.Linear):  # type: ignore[misc]  # mlx.nn is untyped
    """`nn.Linear`, multiplying by the kept view of its weight."""

    _transposed: _View

    def __call__(self, x: mx.array) -> mx.array:
        weight_t = self._transposed.of(self["weight"])
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight_t)
        return x @ weight_t


class TransposedEmbedding(nn.Embedding):  # type: ignore[misc]
    """`nn.Embedding` whose `as_linear` (a tied output head) uses the kept view."""

    _transposed: _View

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self._transposed.of(self["weight"])


_SWITCHED: dict[type, type] = {nn.Linear: TransposedLinear, nn.Embedding: TransposedEmbedding}


def adopt(layer: Any) -> bool:
    """Switches one plain `nn.Linear` or `nn.Embedding` (with a view of its own)."""
    switched = _SWITCHED.get(type(layer))
    if switched is None and type(layer) not in _SWITCHED.values():
        return False
    if switched is not None:
        layer.__class__ = switched
    # Always a fresh view holder: a shallow copy of a switched layer must not share one.
    object.__setattr__(layer, "_transposed", _View())
    return True


def install(model: nn.Module) -> int:
    """Switches the model's plain linear and embedding layers; returns how many."""
    return sum(adopt(module) for _, module in model.named_modules())
