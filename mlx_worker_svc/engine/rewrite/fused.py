"""Decode forwards: a layer's sibling projections of one input as one product.

What: `install` concatenates, once, the weights of each group of sibling layers
of a loaded mlx-lm model (`q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`, of
one kind, size, dtype, bias and quantization); each layer keeps its rows as a
view. For a one-row forward, and for a decode step of a plain group, the
first projection multiplies by the concatenation and hands its
siblings their columns (keyed by the input array); otherwise every layer runs
on its own rows. Why: a GPU decode step is bound by the host's graph building
and kernel launches, and this removes three products per layer.
Invariants: no parameter is held twice; single-row results are the unfused
model's bit for bit where a kernel computes each output on its own (checked by
`tests/engine/rewrite/test_fused.py` on the CPU and the GPU benchmark's parity
check); prompts and quantized batches are untouched. Whether a runner installs
it is an engine option (`EngineOptions.fuse`: on by default on CUDA only); one
thread builds forwards.
Measurements: BENCHMARKS.md.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx import nn

from mlx_worker_svc.engine.rewrite import transposed

# Sibling layers that project one input, in the order mlx-lm's models call them.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_PARAMETERS = ("weight", "scales", "biases", "bias")


def _kind(layer: Any) -> tuple[Any, ...] | None:
    """What must agree for layers to share one product (None: not fusable)."""
    if type(layer) in (nn.Linear, transposed.TransposedLinear):
        weight = layer["weight"]
        return ("linear", weight.shape[1], weight.dtype, "bias" in layer)
    if type(layer) is nn.QuantizedLinear and layer.mode == "affine":
        return (
            "quantized",
            layer["weight"].shape[1],
            layer["scales"].dtype,
            "bias" in layer,
            "biases" in layer,
            layer.group_size,
            layer.bits,
        )
    return None


class _Group:
    """One group's concatenated layer and the product being handed out."""

    def __init__(self, fused: nn.Module, bounds: list[tuple[int, int]], batched: bool) -> None:
        self.fused = fused
        self.batched = batched  # decode steps of several rows fused too
        self.splits = [stop for _, stop in bounds[:-1]]
        self._input: mx.array | None = None
        self._parts: list[mx.array | None] = []
        self._left = 0

    def take(self, x: mx.array, index: int) -> mx.array:
        """Layer `index`'s columns of x times the concatenated weights."""
        parts = self._parts
        if x is not self._input or parts[index] is None:
            parts = self._parts = list(mx.split(self.fused(x), self.splits, axis=-1))
            self._input, self._left = x, len(parts)
        part = parts[index]
        assert part is not None
        parts[index] = None
        self._left -= 1
        if not self._left:
            self._input = None  # every part handed out: nothing held between forwards
        return part


class FusedProjection(nn.Module):  # type: ignore[misc]  # mlx.nn is untyped
    """One layer of a group: its share of the group's product (one row, or a decode step)."""

    def __init__(self, inner: nn.Module, group: _Group, index: int) -> None:
        super().__init__()
        self.inner = inner
        self.index = index
        self.group = group  # a plain attribute: the parameters stay listed once (in inner)

    def __call__(self, x: mx.array) -> mx.array:
        if x.size == x.shape[-1] or (self.group.batched and x.ndim == 3 and x.shape[1] == 1):
            return self.group.take(x, self.index)
        out: mx.array = self.inner(x)
        return out


def _fuse(parent: nn.Module, names: tuple[str, ...]) -> bool:
    layers = [parent.get(name) for name in names]
    kinds = {_kind(layer) for layer in layers}
    kind = kinds.pop() if len(kinds) == 1 else None
    if kind is None:
        return False
    concatenated = {
        key: mx.concatenate([layer[key] for layer in layers])
        for key in _PARAMETERS
        if key in layers[0]
    }
    mx.eval(concatenated)
    rows = [int(layer["weight"].shape[0]) for layer in layers]
    fused = copy.copy(layers[0])  # same class and settings (group size, bits, mode)
    fused.update(concatenated)
    transposed.adopt(fused)  # its own view of the concatenated weight
    bounds, start = [], 0
    for count in rows:
        bounds.append((start, start + count))
        start += count
    group = _Group(fused, bounds, batched=kind[0] == "linear")
    for index, (name, layer, (first, last)) in enumerate(zip(names, layers, bounds, strict=True)):
        views = {key: value[first:last] for key, value in concatenated.items()}
        mx.eval(views)  # the layer's rows of the concatenated arrays: shared, not copied
        layer.update(views)
        parent[name] = FusedProjection(layer, group, index)
    return True


def install(model: nn.Module) -> int:
    """Fuses the model's sibling projections (see above); returns how many groups."""
    # A module without all of a group's names gets None for the missing ones: not fusable.
    return sum(_fuse(module, names) for _, module in model.named_modules() for names in GROUPS)
