"""Per-row LoRA deltas inside one batched forward.

What: `Deltas` holds, for every layer a resident adapter targets, a stack of
the adapters' matrices (slot 0 all zeros, for base rows; lower ranks padded
with zeros to the largest) and their scales. `rows(model, slots)`, open around
a forward's construction, switches those layers to subclasses of their own
class that add `scale * ((x @ a) @ b)` to the layer's output: with one
adapter for every row, its own matrices (mlx-lm's `LoRALinear` computation,
op for op); with rows of several adapters (or base rows beside them), one
`gather_mm` pair over the stacks indexed by each row's slot, so a batch of
many adapters is still one forward. Outside the block the layers are their
own classes again: a forward with no adapter row pays nothing.
Invariants: a base row's delta is exactly 0 (slot 0), so its output is the
base model's; the class switch nests inside `dequant.rows` (it keeps the class
it finds); only the engine thread builds forwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from mlx_worker_svc.engine.lora.files import AdapterWeights

_HOOK = "_mlx_worker_lora"
_SUBCLASSES: dict[type, type] = {}


def _lora_class(own: type) -> type:
    """A subclass of `own` whose output carries the active adapters' deltas."""
    sub = _SUBCLASSES.get(own)
    if sub is None:

        def __call__(self: Any, x: mx.array) -> mx.array:  # noqa: N807
            hook: _Hook = object.__getattribute__(self, _HOOK)
            return hook.deltas.apply(hook.path, x, own.__call__(self, x))

        sub = _SUBCLASSES[own] = type(f"Lora{own.__name__}", (own,), {"__call__": __call__})
    return sub


class _Hook:
    __slots__ = ("deltas", "path")

    def __init__(self, deltas: Deltas, path: str) -> None:
        self.deltas, self.path = deltas, path


class Deltas:
    """The resident adapters of one model, stacked per targeted layer."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.slots: list[AdapterWeights] = []  # slot i + 1
        self.layers: dict[str, Any] = {}
        self.stacks: dict[str, tuple[mx.array, mx.array]] = {}
        self.scales = mx.zeros((1,))
        self._single: AdapterWeights | None = None
        self._index: mx.array | None = None
        self._row_scales: dict[Any, mx.array] = {}

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) + int(b.nbytes) for a, b in self.stacks.values())

    def restack(self, slots: list[AdapterWeights]) -> None:
        """Rebuilds the stacks for these adapters (slot i + 1 is slots[i])."""
        stacks = build_stacks(slots)
        mx.eval(list(stacks.values()))
        self.slots, self.stacks = list(slots), stacks
        self.scales = mx.array([0.0] + [w.scale for w in slots], dtype=mx.float32)
        self.bind()

    def bind(self) -> None:
        """Finds the targeted layers in the model as it is now (a rewrite may have replaced
        some: a fused projection stands where its linear layer stood)."""
        modules = dict(self.model.named_modules())
        self.layers = {path: modules[path] for path in self.stacks}
        for path, layer in self.layers.items():
            object.__setattr__(layer, _HOOK, _Hook(self, path))

    def apply(self, path: str, x: mx.array, y: mx.array) -> mx.array:
        single = self._single
        if single is not None:
            a = single.a.get(path)
            if a is None:
                return y
            z = (x @ a) @ single.b[path]
            return y + (single.scale * z).astype(x.dtype)
        assert self._index is not None
        sa, sb = self.stacks[path]
        z = mx.gather_mm(mx.gather_mm(x, sa, rhs_indices=self._index), sb, rhs_indices=self._index)
        scale = self._row_scales.get(z.dtype)
        if scale is None:
            scale = self._row_scales[z.dtype] = (
                self.scales[self._index].astype(z.dtype).reshape(-1, 1, 1)
            )
        return y + (scale * z).astype(x.dtype)

    @contextmanager
    def rows(self, slots: Sequence[int]) -> Iterator[bool]:
        """Builds forwards inside for rows of these slots (0: base); yields whether any adapts."""
        used = set(slots)
        if not used - {0}:
            yield False
            return
        if len(used) == 1:
            self._single = self.slots[next(iter(used)) - 1]
        else:
            self._index = mx.array(list(slots), dtype=mx.uint32)
        own = {path: type(layer) for path, layer in self.layers.items()}
        for path, layer in self.layers.items():
            layer.__class__ = _lora_class(own[path])
        try:
            yield True
        finally:
            for path, layer in self.layers.items():
                layer.__class__ = own[path]
            self._single, self._index, self._row_scales = None, None, {}


def build_stacks(slots: list[AdapterWeights]) -> dict[str, tuple[mx.array, mx.array]]:
    """Per targeted layer: [1 + n, in, R] and [1 + n, R, out] (slot 0 and absent slots zero)."""
    paths = sorted({p for w in slots for p in w.a})
    stacks = {}
    for path in paths:
        mats = [(w.a[path], w.b[path]) for w in slots if path in w.a]
        inputs, out = mats[0][0].shape[0], mats[0][1].shape[1]
        rank = max(w.rank for w in slots if path in w.a)
        dtype = mats[0][0].dtype
        for a, b in mats:
            dtype = mx.result_type(dtype, a.dtype, b.dtype)
        za, zb = mx.zeros((inputs, rank), dtype), mx.zeros((rank, out), dtype)
        rows_a, rows_b = [za], [zb]
        for w in slots:
            if path not in w.a:
                rows_a.append(za)
                rows_b.append(zb)
                continue
            pad = rank - w.rank
            rows_a.append(mx.pad(w.a[path].astype(dtype), [(0, 0), (0, pad)]))
            rows_b.append(mx.pad(w.b[path].astype(dtype), [(0, pad), (0, 0)]))
        stacks[path] = (mx.stack(rows_a), mx.stack(rows_b))
    return stacks


def stack_bytes(slots: list[AdapterWeights]) -> int:
    """The bytes `build_stacks(slots)` would take, without building them."""
    total = 0
    for path in {p for w in slots for p in w.a}:
        mats = [(w, w.a[path], w.b[path]) for w in slots if path in w.a]
        inputs, out = mats[0][1].shape[0], mats[0][2].shape[1]
        rank = max(w.rank for w, _, _ in mats)
        size = max(max(a.dtype.size, b.dtype.size) for _, a, b in mats)
        total += (len(slots) + 1) * rank * (inputs + out) * size
    return total
