"""Device side: turns the carried files (pack.sh) into a site folder python3 can use.

`python3 unpack.py ROOT` expects ROOT/parts to hold both calls' files. It
checks them against MANIFEST, joins and extracts the mlx-cuda-13 tar.xz into
ROOT/site, unzips the mlx core wheel over it (its dist-info beside the CUDA
one's, as pip would leave them) and the other wheels beside it, links
ROOT/site/nvidia/* to the image's CUDA 13 packages (libmlx.so finds cuBLAS,
cuDNN, NCCL, NVRTC... at $ORIGIN/../../nvidia/*/lib, and NVRTC its headers
there), and writes ROOT/env.sh, which puts ROOT/site first on PYTHONPATH.
Standard library only: it runs under the image's python3 before anything
is installed. Exit code 3: files of an earlier call are missing (the machine
was given back between the calls; make the first call again).
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

TAR_PREFIX = "mlx-cuda-13.tar.xz.part"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check(parts: Path) -> list[str]:
    """Names listed in MANIFEST, all present with the right sha256 (else exits)."""
    manifest = parts / "MANIFEST"
    if not manifest.exists():
        sys.exit(f"{manifest} is missing: copy .gpupack/call2 (pack.sh makes it)")
    names, missing = [], []
    for line in manifest.read_text().splitlines():
        digest, name = line.split()
        names.append(name)
        path = parts / name
        if not path.exists():
            missing.append(name)
        elif _sha256(path) != digest:
            sys.exit(f"{path} is corrupt (sha256 differs from MANIFEST)")
    if missing:
        print(
            f"missing {missing}: part 1 is not staged in this machine's $MLXW; "
            "run `install.sh stage .gpupack/call1` again",
            file=sys.stderr,
        )
        sys.exit(3)
    return names


def image_nvidia_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def install(root: Path) -> None:
    parts, site = root / "parts", root / "site"
    stamp = site / ".complete"
    names = check(parts)
    if stamp.exists() and stamp.read_text() == "\n".join(names):
        print(f"{site} is already installed")
        return
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    joined = root / "mlx-cuda-13.tar.xz"
    with joined.open("wb") as out:
        for name in sorted(n for n in names if n.startswith(TAR_PREFIX)):
            with (parts / name).open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
    with tarfile.open(joined, "r:xz") as tar:
        tar.extractall(site, filter="data")
    joined.unlink()
    wheels = sorted(n for n in names if n.endswith(".whl"))
    # The mlx core wheel goes over the CUDA wheel's content (pip refuses to merge them).
    for name in sorted(wheels, key=lambda n: not n.startswith("mlx-")):
        with zipfile.ZipFile(parts / name) as whl:
            whl.extractall(site)
    links = site / "nvidia"
    links.mkdir(exist_ok=True)
    for location in image_nvidia_dirs():
        if location.resolve() == links.resolve():
            continue
        for entry in location.iterdir():
            target = links / entry.name
            if entry.is_dir() and not target.exists():
                target.symlink_to(entry)
    # The links are what libmlx.so's RPATH finds; the library path is a second way.
    libs = sorted(str(d) for d in links.glob("*/lib") if d.is_dir())
    if not libs:
        print("warning: the image has no nvidia CUDA packages; MLX relies on system paths")
    env = [
        f'export PYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}"',
        f'export MLX_PTX_CACHE_DIR="{root}/ptx"',
    ]
    if libs:
        paths = ":".join(libs)
        env.append(f'export LD_LIBRARY_PATH="{paths}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"')
    (root / "env.sh").write_text("\n".join(env) + "\n")
    stamp.write_text("\n".join(names))
    linked = sorted(p.name for p in links.iterdir())
    print(f"installed into {site}; nvidia packages linked from the image: {linked}")


if __name__ == "__main__":
    install(Path(sys.argv[1]))
