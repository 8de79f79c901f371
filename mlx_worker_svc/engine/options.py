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

from mlx_worker_svc.core.domain import KVFormat
from mlx_worker_svc.core.errors import InvalidArgument

LookAhead = Literal["speculate", "after", "off"]
LOOK_AHEAD_MODES: tuple[str, ...] = get_args(LookAhead)
# Decode batches of a quantized model at least this large use dequantized weights by
# default with MLX's CUDA backend (where it was measured); elsewhere never.
CUDA_DEQUANT_MIN_BATCH = 32
# Quantized KV (DetermineMemory/InitCache kv_bits, `serve --kv-bits`): the widths and
# groups MLX's affine quantization takes (mx.quantize), and mlx-lm's default group.
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_GROUP_SIZE = 64
# Decode batches of at least this many rows attend quantized KV in float16 or bfloat16
# dequantized by default on the CPU (where it was measured: MLX's CPU quantized product
# is several times slower in those dtypes than the fused float attention); elsewhere never.
CPU_KV_DEQUANT_MIN_BATCH = 2
_HALF_DTYPES = ("float16", "bfloat16")


def kv_format(bits: int, group_size: int, fields: tuple[str, str]) -> KVFormat:
    """The KV format `bits`/`group_size` ask for (0, 0: float), or InvalidArgument.

    `fields` names the two in the message (("InitCache.kv_bits",
    "InitCache.kv_group_size"), or flags). A group size 0 means 64; one without bits is
    refused (it would quantize nothing). Whether the group divides the
    model's head_dim is checked where the model is (engine/cache/quantized.py).
    """
    if bits == 0:
        if group_size:
            raise InvalidArgument(
                f"{fields[1]} {group_size} needs {fields[0]} (0 keeps KV in float)"
            )
        return KVFormat()
    if bits not in KV_BITS:
        raise InvalidArgument(
            f"{fields[0]} {bits} is not a width MLX quantizes to: use one of "
            f"{', '.join(map(str, KV_BITS))} (or 0 for float KV)"
        )
    group = group_size or DEFAULT_KV_GROUP_SIZE
    if group not in KV_GROUP_SIZES:
        raise InvalidArgument(
            f"{fields[1]} {group}: use one of {', '.join(map(str, KV_GROUP_SIZES))}"
        )
    return KVFormat(bits, group)


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
    # LoRA adapters resident at once (AddLora evicts the least recently used unpinned one).
    max_loras: int = 8
    # Adapters loaded with the model (serve --lora-modules NAME=PATH): (name, path) pairs.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Decode batches with at least this many rows and quantized KV (kv_bits) attend it
    # dequantized, with MLX's fused float attention (engine/cache/quantized.py); 0: never;
    # None: 2 on the CPU for float16/bfloat16 KV, else 0. A single request always
    # attends with mlx-lm's quantized attention.
    kv_dequant_min_batch: int | None = None

    def __post_init__(self) -> None:
        if self.look_ahead not in LOOK_AHEAD_MODES:
            raise ValueError(f"look_ahead {self.look_ahead!r}: use one of {LOOK_AHEAD_MODES}")
        if self.dequant_min_batch is not None and self.dequant_min_batch < 0:
            raise ValueError(f"dequant_min_batch must be >= 0, got {self.dequant_min_batch}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        rows = self.kv_dequant_min_batch
        if rows is not None and rows < 0:
            raise ValueError(f"kv_dequant_min_batch must be >= 0, got {rows}")

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

    def kv_dequant_rows(self, gpu: bool, dtype: str) -> int:
        """The decode rows from which quantized KV of `dtype` ("float16") is attended
        dequantized, on a GPU backend or the CPU (0: never)."""
        if self.kv_dequant_min_batch is not None:
            return self.kv_dequant_min_batch
        # Measured on the CPU only. On a GPU MLX's quantized attention reads the packed
        # KV where a dequantized copy would be written and read again each step.
        return CPU_KV_DEQUANT_MIN_BATCH if not gpu and dtype in _HALF_DTYPES else 0
