"""Large decode batches of quantized models: matrix products on dequantized weights.

MLX's quantized matrix product is built for few rows: on an H200 a 4-bit
Llama-3.2-1B decodes 128 rows at about a ninth of the bf16 model's rate
(1,755 against 15,969 tokens/s), although it reads a quarter of the bytes.
For a decode forward of many rows it is faster to dequantize each weight
(a transient copy in the scales' dtype, one matrix at a time, freed once
used) and run an ordinary matrix product.

`install` switches a loaded model's affine-quantized layers to classes that
do so while a `rows(n)` block with n at or above `MIN_ROWS` is open around
the forward's construction; with fewer rows (single streams, small batches)
and in every prefill they run MLX's quantized kernel as before, so a single
stream computes exactly what mlx-lm computes. A model without quantized
layers is left as it is. On by default with MLX's CUDA backend only;
`MLX_WORKER_DEQUANT_MIN_BATCH` sets the threshold anywhere (0: never).
"""

from __future__ import annotations

import os
import threading
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

_state = threading.local()


def _active() -> bool:
    return bool(getattr(_state, "active", False))


def _dequantized(layer: Any) -> mx.array:
    return mx.dequantize(
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=layer.mode,
    )


class _SwitchableLinear(nn.QuantizedLinear):  # type: ignore[misc]
    def __call__(self, x: mx.array) -> mx.array:
        if not _active():
            out: mx.array = super().__call__(x)
            return out
        x = x @ _dequantized(self).T
        if "bias" in self:
            x = x + self["bias"]
        return x


class _SwitchableEmbedding(nn.QuantizedEmbedding):  # type: ignore[misc]
    def as_linear(self, x: mx.array) -> mx.array:
        if not _active():
            out: mx.array = super().as_linear(x)
            return out
        return x @ _dequantized(self).T


def install(model: nn.Module) -> int:
    """Makes the model's affine-quantized layers switchable; returns how many."""
    switched = 0
    for _, module in model.named_modules():
        if getattr(module, "mode", None) != "affine":
            continue
        if type(module) is nn.QuantizedLinear:
            module.__class__ = _SwitchableLinear
            switched += 1
        elif type(module) is nn.QuantizedEmbedding:
            module.__class__ = _SwitchableEmbedding
            switched += 1
    return switched


@contextmanager
def rows(count: int) -> Iterator[None]:
    """Builds the forwards inside for `count` rows (dequantized weights if enough)."""
    previous = _active()
    _state.active = 0 < MIN_ROWS <= count
    try:
        yield
    finally:
        _state.active = previous
