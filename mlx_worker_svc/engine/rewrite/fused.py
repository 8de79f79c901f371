"""Decode forwards: a layer's sibling projections of one input as one product.

A decode step on a GPU is bound by the host: building the model's graph and
launching its few hundred small kernels takes longer than the device needs
to run them (an H200 runs a Llama-3.2-1B step's kernels in well under a
millisecond at one row; the host takes about two to build and launch them,
and at 32 rows its launch alone takes about 2.5 ms, most of it the matrix
products). Llama-style attention projects its input three times (q, k, v)
and its MLP twice (gate, up); vLLM and TGI multiply by the concatenated
weights once. Here `install` does the same for a loaded mlx-lm model without
touching its code:

- Each group of sibling layers (`q_proj`, `k_proj`, `v_proj`; `gate_proj`,
  `up_proj`) of the same kind (plain or affine-quantized linear layers with
  the same input size, dtype, bias and quantization) gets its parameters
  concatenated along the output rows, once. Each original layer keeps its
  own rows of them as a view: no parameter is held twice.
- Each layer is wrapped. For a forward of one row, and for a decode step (one
  token per row) of a plain group, the group's first projection multiplies by
  the concatenated weights and hands its siblings their columns of the
  product (keyed by the identity of the input array). Otherwise (prompts;
  decode batches of quantized groups, which switch to dequantized weights
  for large batches, `engine/rewrite/dequant.py`) every layer runs as it
  did, on its own rows of the concatenated weights.

Two layers fewer per attention group, one fewer per MLP: in a 16-layer model,
48 fewer matrix products to build and launch per decode step. The products
are the same rows times the same vectors. Where the kernel computes each
output of a matrix-vector product on its own, whatever the number of
outputs, single-row results match the unfused model's bit for bit: checked
for float32, bfloat16, float16 and 4-bit on MLX's CPU backend by
`tests/engine/rewrite/test_fused.py`, and on CUDA for bf16 and 4-bit on a Llama-3.2-1B shape
by `benchmarks/gpu/profile_step.py --anatomy --fuse` and the GPU benchmark's
parity check. A matrix product of several rows by a wider weight could pick
another kernel and round differently; on CUDA (cuBLAS) bf16 decode batches
of 8 to 128 rows gave mlx-lm's tokens exactly for 128 steps
(`--anatomy --fuse`), and the launch of a step at 32 and 128 rows got about
a fifth shorter (benchmarks/gpu/NOTES.md).

Whether a runner installs it is an engine option (`EngineOptions.fuse`): on
by default with MLX's CUDA backend only, where it was measured and checked.
MLX's Metal matrix-vector kernels are tuned by the product's shape, so there
a concatenated product may round differently from the separate ones, and
single streams must stay exactly mlx-lm's: off on Apple silicon (and on
CPUs, where a step is not bound by the host) unless asked for.
Like `engine/rewrite/dequant.py`, this assumes one thread builds the model's
forwards (the engine thread); another thread's forward would still compute
the right values (parts are keyed by their input), only without the saving.
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
