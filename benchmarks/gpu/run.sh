#!/usr/bin/env bash
# Device side: runs the GPU benchmark with what install.sh installed.
#   run.sh [bench_gpu options]    results go to $OUT (the device tool's folder) when set
set -euo pipefail
MLXW=${MLXW:-/tmp/mlxw}
if [ ! -f "$MLXW/env.sh" ]; then
  echo "nothing installed in $MLXW: make the install calls first (README.md)" >&2
  exit 3
fi
# shellcheck disable=SC1091
. "$MLXW/env.sh"
cd "$(dirname "$0")/../.."
out=${OUT:-benchmarks/results}
mkdir -p "$out"
set -o pipefail
PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu.bench_gpu --out "$out" "$@" 2>&1 | tee "$out/bench-gpu.log"
