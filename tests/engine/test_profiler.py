"""The engine's profiler on its own: the Metal capture path (with a stand-in Metal) and names."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlx_worker_svc.core.errors import FailedPrecondition
from mlx_worker_svc.core.profiling import ProfileSort
from mlx_worker_svc.engine.profiler import EngineProfiler, profile_directory


class _Metal:
    """Records the capture calls; `refuse` makes start_capture fail as Metal does."""

    def __init__(self, refuse: str = "") -> None:
        self.calls: list[tuple[str, str]] = []
        self.refuse = refuse

    def is_available(self) -> bool:
        return True

    def start_capture(self, path: str) -> None:
        if self.refuse:
            raise RuntimeError(self.refuse)
        self.calls.append(("start", path))

    def stop_capture(self) -> None:
        self.calls.append(("stop", ""))


@pytest.fixture
def metal(monkeypatch: pytest.MonkeyPatch) -> _Metal:
    fake = _Metal()
    monkeypatch.setattr(mx, "metal", fake)  # the module engine/profiler.py calls
    return fake


def _work() -> None:
    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))


def test_on_metal_the_gpu_capture_brackets_the_profile(tmp_path: Path, metal: _Metal) -> None:
    profiler = EngineProfiler(tmp_path)
    started = profiler.start("gpu", gpu_capture=True)
    assert started.gpu_capture_path == started.path.removesuffix(".prof") + ".gputrace"
    assert metal.calls == [("start", started.gpu_capture_path)]
    _work()
    report = profiler.stop().report(5, ProfileSort.CUMULATIVE)
    assert metal.calls[-1] == ("stop", "")
    assert report.gpu_capture_path == started.gpu_capture_path and Path(report.path).is_file()
    # Without gpu_capture, Metal is left alone.
    profiler.start("cpu-only", gpu_capture=False)
    profiler.stop()
    assert len(metal.calls) == 2


def test_a_capture_metal_refuses_starts_nothing(tmp_path: Path, metal: _Metal) -> None:
    metal.refuse = "[metal::start_capture] Failed to start: Capturing is not supported"
    profiler = EngineProfiler(tmp_path)
    with pytest.raises(FailedPrecondition) as info:
        profiler.start("gpu", gpu_capture=True)
    assert "Capturing is not supported" in info.value.message
    assert "MTL_CAPTURE_ENABLED=1" in info.value.message
    with pytest.raises(FailedPrecondition):
        profiler.stop()  # nothing is running
    assert list(tmp_path.iterdir()) == []


def test_files_are_never_overwritten(tmp_path: Path) -> None:
    profiler = EngineProfiler(tmp_path)
    paths = []
    for _ in range(3):
        profiler.start("same", gpu_capture=False)
        paths.append(profiler.stop().report(1, ProfileSort.OWN).path)
    assert len(set(paths)) == 3 and all(Path(p).is_file() for p in paths)


def test_the_profile_directory_is_made_and_must_be_writable(tmp_path: Path) -> None:
    made = profile_directory(str(tmp_path / "a" / "b"))
    assert made.is_dir() and made.is_absolute()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"--profile-dir .*file: cannot create it"):
        profile_directory(str(tmp_path / "file"))


def test_a_directory_given_as_a_str_works_as_a_path(tmp_path: Path) -> None:
    # ServerConfig.profile_dir is written by embedders too, who may pass a str.
    profiler = EngineProfiler(str(tmp_path / "profiles"))
    profiler.start("str-dir", gpu_capture=False)
    path = profiler.stop().report(1, ProfileSort.OWN).path
    assert Path(path).parent == tmp_path / "profiles" and Path(path).is_file()
