"""Regenerates the committed Python code for protos/ (run by `make proto`).

protoc writes `import mlx_worker.v1...` lines that only resolve when the output
folder is on sys.path; we rewrite them to absolute imports inside the package,
so the generated code imports like any other module. The output is a pure
function of the .proto files and the pinned grpcio-tools version, so CI can
check that the committed code is current with `git diff --exit-code`.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "mlx_worker_svc" / "gen"
PACKAGE = "mlx_worker_svc.gen"
HEADER = "# Generated from protos/ by `make proto`. DO NOT EDIT.\n"


def main() -> int:
    sources = sorted(str(p.relative_to(PROTOS)) for p in PROTOS.rglob("*.proto"))
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={OUT}",
        f"--pyi_out={OUT}",
        f"--grpc_python_out={OUT}",
        *sources,
    ]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for path in sorted(OUT.rglob("*.py*")):
        text = path.read_text()
        text = re.sub(r"^from (mlx_worker\.)", rf"from {PACKAGE}.\1", text, flags=re.M)
        path.write_text(HEADER + text)
    for folder in [OUT, *sorted(p for p in OUT.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").write_text(HEADER)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
