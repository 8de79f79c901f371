"""What a profile of the engine thread is made of: its names, limits and report.

StartProfile and StopProfile (worker.proto) carry a label and a count, never a
path: `check_label` keeps a label to a file-name fragment, `check_top` bounds
the entries a StopProfile returns. The profiler itself is engine/profiler.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from mlx_worker_svc.core.errors import InvalidArgument

DEFAULT_LABEL = "profile"
DEFAULT_TOP_ENTRIES = 30
MAX_TOP_ENTRIES = 1000
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ProfileSort(Enum):
    CUMULATIVE = "cumulative"  # time in the function and what it called
    OWN = "own"  # time in the function's own code


@dataclass(frozen=True)
class ProfileEntry:
    """One function of a profile, as pstats counts it."""

    function: str
    file: str  # "~" for built-ins
    line: int
    calls: int
    primitive_calls: int  # calls that were not recursive
    cumulative_seconds: float
    own_seconds: float


@dataclass(frozen=True)
class ProfileStarted:
    label: str
    path: str  # where the cProfile will be written
    gpu_capture_path: str  # "" without a GPU capture


@dataclass(frozen=True)
class ProfileReport:
    label: str
    path: str
    gpu_capture_path: str
    seconds: float
    entries: tuple[ProfileEntry, ...]
    num_functions: int


def check_label(label: str) -> str:
    """The label to name a profile's files by (the default for ""); InvalidArgument if unfit."""
    if not label:
        return DEFAULT_LABEL
    if not _LABEL.fullmatch(label):
        shown = label if len(label) <= 80 else label[:80] + "..."
        raise InvalidArgument(
            f"StartProfileRequest.label {shown!r} is not a profile label: use 1 to 64 "
            "characters from A-Z a-z 0-9 . _ - starting with a letter or digit (it names "
            "a file under --profile-dir; paths are not accepted)"
        )
    return label


def check_top(top_entries: int) -> int:
    """The number of top entries to return (the default for 0); InvalidArgument past the cap."""
    if top_entries == 0:
        return DEFAULT_TOP_ENTRIES
    if top_entries > MAX_TOP_ENTRIES:
        raise InvalidArgument(
            f"StopProfileRequest.top_entries {top_entries} is over the limit of "
            f"{MAX_TOP_ENTRIES}; the profile file holds every entry"
        )
    return top_entries
