#!/usr/bin/env bash
# GPU-machine side: runs the GPU benchmark with what install.sh installed.
#   run.sh [bench_gpu options]    results go to $BENCH_OUT (default benchmarks/results)
set -euo pipefail
MLXW=${MLXW:-/tmp/mlxw}
if [ ! -f "$MLXW/env.sh" ]; then
  echo "nothing installed in $MLXW: make the install calls first (README.md)" >&2
  exit 3
fi
# shellcheck disable=SC1091
. "$MLXW/env.sh"
cd "$(dirname "$0")/../.."
dest=${BENCH_OUT:-benchmarks/results}
mkdir -p "$dest"
set -o pipefail
PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu.bench_gpu --out "$dest" "$@" 2>&1 | tee "$dest/bench-gpu.log"
