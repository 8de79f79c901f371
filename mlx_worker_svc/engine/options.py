"""Engine options: the engine's behaviour switches, as one frozen value built at start.

The command line builds one `EngineOptions` from its flags (cli/engine_flags.py)
and the worker passes it to every runner it builds, which applies it to the
model's rewrites and its decode batch; nothing in the engine reads the
environment. Each option exists because the GPU benchmark still compares
both sides of it (benchmarks/gpu/README.md, worker variants); the defaults
are the engine as it ships. `None` means the backend's default, resolved by
the methods below when a runner is built (this module imports no MLX, so
every layer can hold options). Invalid values raise `ValueError` naming the
option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

LookAhead = Literal["speculate", "after", "off"]
LOOK_AHEAD_MODES: tuple[str, ...] = get_args(LookAhead)
# Decode batches of a quantized model at least this large use dequantized weights by
# default with MLX's CUDA backend (where it was measured); elsewhere never.
CUDA_DEQUANT_MIN_BATCH = 32


@dataclass(frozen=True)
class EngineOptions:
    # When the next decode forward is queued (batch.DecodeBatch): "speculate" on the
    # sampled tokens before the host reads them, "after" once the step is done, "off" never.
    look_ahead: LookAhead = "speculate"
    # Batches whose rows are all equally long decode without an attention mask
    # (batch.AlignedBatchKVCache), and equally long prompts prefill together.
    aligned_decode: bool = True
    # Sibling projections as one product in decode steps (rewrite/fused.py, and with it
    # the llama decode step); None: on with MLX's CUDA backend only.
    fuse: bool | None = None
    # Decode batches of a quantized model with at least this many rows multiply by
    # dequantized weights (rewrite/dequant.py); 0: never; None: 32 with CUDA, else 0.
    dequant_min_batch: int | None = None

    def __post_init__(self) -> None:
        if self.look_ahead not in LOOK_AHEAD_MODES:
            raise ValueError(f"look_ahead {self.look_ahead!r}: use one of {LOOK_AHEAD_MODES}")
        if self.dequant_min_batch is not None and self.dequant_min_batch < 0:
            raise ValueError(f"dequant_min_batch must be >= 0, got {self.dequant_min_batch}")

    def fused(self, cuda: bool) -> bool:
        """Whether runners fuse sibling projections, on a CUDA backend or not."""
        return cuda if self.fuse is None else self.fuse

    def dequant_rows(self, cuda: bool) -> int:
        """The decode rows from which quantized models use dequantized weights (0: never)."""
        if self.dequant_min_batch is not None:
            return self.dequant_min_batch
        # Measured on CUDA only. On Apple silicon MLX's quantized kernels handle many
        # rows well, and a transient full-precision copy of every weight each step
        # would cost more bandwidth than it saves.
        return CUDA_DEQUANT_MIN_BATCH if cuda else 0
