"""Large decode batches of quantized models: matrix products on dequantized weights.

What: `install` registers a loaded model's affine-quantized layers; inside a
`rows(model, n)` block with n >= the `min_rows` it was installed with, open around a forward's
construction, they switch to classes that dequantize each weight (a transient
copy in the scales' dtype, one matrix at a time) and run an ordinary product,
and back when it closes. Why: MLX's quantized product is built for few rows and
is slow for large decode batches on CUDA.
Invariants: with fewer rows and in every prefill the layers are MLX's own
classes, so single streams compute exactly what mlx-lm computes and pay no
per-layer check (the class changes once per forward); a model without
quantized layers, or `min_rows` 0, is left alone; only the engine thread builds
forwards. The threshold is an engine option (`EngineOptions.dequant_min_batch`:
32 rows by default on CUDA only, 0 never).
Measurements: BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx import nn

_ATTRIBUTE = "_mlx_worker_dequant"


def _dequantized(layer: Any) -> mx.array:
    return mx.dequantize(
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    )


class _DequantizedLinear(nn.QuantizedLinear):  # type: ignore[misc]
    def __call__(self, x: mx.array) -> mx.array:
        x = x @ _dequantized(self).T
        if "bias" in self:
            x = x + self["bias"]
        return x


class _DequantizedEmbedding(nn.QuantizedEmbedding):  # type: ignore[misc]
    def as_linear(self, x: mx.array) -> mx.array:
        return x @ _dequantized(self).T


_SWITCHED = {nn.QuantizedLinear: _DequantizedLinear, nn.QuantizedEmbedding: _DequantizedEmbedding}


class _Layers:
    """One model's affine-quantized layers and which classes they have now."""

    def __init__(self, layers: list[nn.Module], min_rows: int) -> None:
        self.layers = [(layer, type(layer)) for layer in layers]
        self.min_rows = min_rows  # forwards of at least this many rows switch
        self.dequantized = False

    def switch(self, dequantized: bool) -> None:
        if dequantized == self.dequantized:
            return
        for layer, own in self.layers:
            layer.__class__ = _SWITCHED[own] if dequantized else own
        self.dequantized = dequantized


def install(model: nn.Module, min_rows: int) -> int:
    """Registers the model's affine-quantized layers for `rows`; returns how many.

    Forwards of at least `min_rows` rows switch them (0: never, and nothing is
    registered). Installing again only sets the threshold.
    """
    known: _Layers | None = getattr(model, _ATTRIBUTE, None)
    if known is not None:
        known.min_rows = min_rows
        return len(known.layers)
    if min_rows <= 0:
        return 0
    layers = [
        module
        for _, module in model.named_modules()
        if type(module) in _SWITCHED and getattr(module, "mode", None) == "affine"
    ]
    if layers:
        # A plain attribute (not a child module): parameters and saving ignore it.
        object.__setattr__(model, _ATTRIBUTE, _Layers(layers, min_rows))
    return len(layers)


@contextmanager
def rows(model: nn.Module, count: int) -> Iterator[None]:
    """Builds the model's forwards inside for `count` rows (dequantized weights if enough)."""
    layers: _Layers | None = getattr(model, _ATTRIBUTE, None)
    if layers is None:
        yield
        return
    previous = layers.dequantized
    layers.switch(0 < layers.min_rows <= count)
    try:
        yield
    finally:
        layers.switch(previous)
