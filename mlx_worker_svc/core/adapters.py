"""What the worker reports about a resident LoRA adapter (ListLoras, AddLora)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str  # the resolved adapter directory
    rank: int
    scale: float
    nbytes: int  # its matrices and its share of the batched stacks
    pinned: bool
    num_requests: int  # live requests using it now
    num_modules: int  # layers it applies to
    load_seconds: float  # how long its AddLora took to read and stack it
