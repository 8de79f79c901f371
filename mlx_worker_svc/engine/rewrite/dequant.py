"""Large decode batches of quantized models: matrix products on dequantized weights.

What: `install` registers a loaded model's affine-quantized layers; inside a
`rows(model, n)` block with n >= `MIN_ROWS`, open around a forward's
construction, they switch to classes that dequantize each weight (a transient
copy in the scales' dtype, one matrix at a time) and run an ordinary product,
and back when it closes. Why: MLX's quantized product is built for few rows and
is slow for large decode batches on CUDA.
Invariants: with fewer rows and in every prefill the layers are MLX's own
classes, so single streams compute exactly what mlx-lm computes and pay no
per-layer check (the class changes once per forward); a model without
quantized layers is left alone; only the engine thread builds forwards. On by
default on CUDA only (`MLX_WORKER_DEQUANT_MIN_BATCH`: the threshold, 0 never).
Measurements: BENCHMARKS.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
from mlx import nn


def _default_min_rows() -> int:
    # Measured on CUDA only. On Apple silicon MLX's quantized kernels handle many
    # rows well, and a transient full-precision copy of every weight each step
    # would cost more bandwidth than it saves: off unless asked for.
    return 32 if mx.cuda.is_available() else 0


# Decode batches of at least this many rows use dequantized weights; 0 turns it off.
MIN_ROWS = int(os.environ.get("MLX_WORKER_DEQUANT_MIN_BATCH", _default_min_rows()))

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

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = [(layer, type(layer)) for layer in layers]
        self.dequantized = False

    def switch(self, dequantized: bool) -> None:
        if dequantized == self.dequantized:
            return
        for layer, own in self.layers:
            layer.__class__ = _SWITCHED[own] if dequantized else own
        self.dequantized = dequantized


def install(model: nn.Module) -> int:
    """Registers the model's affine-quantized layers for `rows`; returns how many."""
    known: _Layers | None = getattr(model, _ATTRIBUTE, None)
    if known is not None:
        return len(known.layers)
    layers = [
        module
        for _, module in model.named_modules()
        if type(module) in _SWITCHED and getattr(module, "mode", None) == "affine"
    ]
    if layers:
        # A plain attribute (not a child module): parameters and saving ignore it.
        object.__setattr__(model, _ATTRIBUTE, _Layers(layers))
    return len(layers)


@contextmanager
def rows(model: nn.Module, count: int) -> Iterator[None]:
    """Builds the model's forwards inside for `count` rows (dequantized weights if enough)."""
    layers: _Layers | None = getattr(model, _ATTRIBUTE, None)
    if layers is None:
        yield
        return
    previous = layers.dequantized
    layers.switch(0 < MIN_ROWS <= count)
    try:
        yield
    finally:
        layers.switch(previous)
