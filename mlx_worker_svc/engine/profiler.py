"""The profiler of the engine thread: a cProfile and, on Metal, MLX's GPU capture.

`EngineProfiler` owns one directory (`serve --profile-dir`) and at most one
running profile. `start` and `stop` run on the engine thread, the thread of
every forward: cProfile's `enable` profiles the thread that calls it (on
Python 3.11; from 3.12 cProfile rides `sys.monitoring`, which sees every
thread, so the gRPC threads' calls appear beside the engine's). `StoppedProfile.report`
writes the pstats file and reads its top entries off the engine thread.
Files are named `<label>-<UTC time>[-n].prof` (and `.gputrace`) under the
directory; a label is checked by core/profiling.py, so no name from the
network reaches a path. A profile still running when the worker stops is
discarded.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlx_worker_svc.core.errors import FailedPrecondition, Internal
from mlx_worker_svc.core.profiling import ProfileEntry, ProfileReport, ProfileSort, ProfileStarted

_SORT_KEY = {ProfileSort.CUMULATIVE: 3, ProfileSort.OWN: 2}  # pstats (cc, nc, tt, ct) index


def profile_directory(path: str) -> Path:
    """`path` made absolute and created if missing; ValueError when it cannot hold profiles."""
    directory = Path(path).expanduser().resolve()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--profile-dir {path}: cannot create it ({exc.strerror})") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"--profile-dir {path}: not writable")
    return directory


@dataclass
class _Running:
    started: ProfileStarted
    profile: cProfile.Profile
    began: float  # time.monotonic()


@dataclass(frozen=True)
class StoppedProfile:
    """A profile that has stopped and is not yet written."""

    started: ProfileStarted
    profile: cProfile.Profile
    seconds: float

    def report(self, top_entries: int, sort: ProfileSort) -> ProfileReport:
        """Writes the pstats file and returns the first `top_entries` functions by `sort`."""
        stats = pstats.Stats(self.profile)
        try:
            Path(self.started.path).parent.mkdir(parents=True, exist_ok=True)
            stats.dump_stats(self.started.path)
        except OSError as exc:
            raise Internal(
                f"StopProfile: the profile stopped but {self.started.path} cannot be written "
                f"({exc.strerror}); its data is lost"
            ) from exc
        rows = stats.stats  # type: ignore[attr-defined]
        key = _SORT_KEY[sort]
        ranked = sorted(rows.items(), key=lambda item: item[1][key], reverse=True)
        entries = tuple(
            ProfileEntry(
                function=name,
                file=file,
                line=line,
                calls=nc,
                primitive_calls=cc,
                cumulative_seconds=ct,
                own_seconds=tt,
            )
            for (file, line, name), (cc, nc, tt, ct, _callers) in ranked[:top_entries]
        )
        return ProfileReport(
            label=self.started.label,
            path=self.started.path,
            gpu_capture_path=self.started.gpu_capture_path,
            seconds=self.seconds,
            entries=entries,
            num_functions=len(rows),
        )


class EngineProfiler:
    """At most one profile of the engine thread at a time, written under `directory`."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)  # a str works too (in-process embedders pass one)
        self._running: _Running | None = None

    def start(self, label: str, gpu_capture: bool) -> ProfileStarted:
        """Starts profiling the calling (engine) thread; `label` is already checked."""
        if self._running is not None:
            raise FailedPrecondition(
                f"StartProfile: the profile {self._running.started.label!r} is running: "
                "call StopProfile first"
            )
        if gpu_capture and not mx.metal.is_available():
            raise FailedPrecondition(
                "StartProfileRequest.gpu_capture needs Metal (MLX's GPU capture); this "
                f"worker's device is {mx.default_device()}: leave gpu_capture false"
            )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FailedPrecondition(
                f"StartProfile: the profile directory {self.directory} (--profile-dir) cannot "
                f"be created ({exc.strerror})"
            ) from exc
        base = self._free_name(label)
        trace = f"{base}.gputrace" if gpu_capture else ""
        if trace:
            try:
                mx.metal.start_capture(trace)
            except RuntimeError as exc:
                raise FailedPrecondition(
                    f"StartProfile: the GPU capture did not start ({exc}); Metal captures "
                    "need the worker started with MTL_CAPTURE_ENABLED=1"
                ) from exc
        started = ProfileStarted(label, f"{base}.prof", trace)
        profile = cProfile.Profile()
        try:
            profile.enable()
        except ValueError as exc:  # Python 3.12+: another profiler holds sys.monitoring
            if trace:
                mx.metal.stop_capture()
            raise FailedPrecondition(f"StartProfile: cProfile did not start ({exc})") from exc
        self._running = _Running(started, profile, time.monotonic())
        return started

    def stop(self) -> StoppedProfile:
        """Stops the running profile (on the engine thread, which it profiles)."""
        running = self._running
        if running is None:
            raise FailedPrecondition("StopProfile: no profile is running: call StartProfile first")
        running.profile.disable()
        seconds = time.monotonic() - running.began
        self._running = None
        if running.started.gpu_capture_path:
            mx.metal.stop_capture()
        return StoppedProfile(running.started, running.profile, seconds)

    def _free_name(self, label: str) -> str:
        """`DIR/<label>-<UTC time>`, with `-2`, `-3`... when such files exist."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        base = self.directory / f"{label}-{stamp}"
        n = 1
        while any(Path(f"{base}{suffix}").exists() for suffix in (".prof", ".gputrace")):
            n += 1
            base = self.directory / f"{label}-{stamp}-{n}"
        return str(base)
