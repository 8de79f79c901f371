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


@dataclass(frozen=True)
class AdapterAdded:
    """What AddLora did."""

    info: AdapterInfo
    already_loaded: bool = False  # the same name and path were resident: nothing done
    evicted: str = ""  # the adapter evicted for it under --max-loras, if any
