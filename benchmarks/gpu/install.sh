#!/usr/bin/env bash
# GPU-machine side of the GPU benchmark's install (README.md beside this file).
#   install.sh stage DIR    part 1: keep DIR's files in $MLXW/parts (default
#                           /tmp/mlxw, outside the checkout) and describe the machine
#   install.sh finish DIR   part 2: add DIR's files, unpack everything into
#                           $MLXW/site (unpack.py) and check that MLX runs on the GPU
# Both parts may come in one session (stage .gpupack/call1, then finish .gpupack/call2).
set -euo pipefail
MLXW=${MLXW:-/tmp/mlxw}
export MLXW
here=$(cd "$(dirname "$0")" && pwd)
mode=${1:?usage: install.sh stage|finish DIR}
dir=${2:?usage: install.sh stage|finish DIR}

probe() {
  echo "== machine"
  nproc
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvidia-smi | grep -o 'CUDA Version: [0-9.]*' || true
  ldd --version 2>&1 | sed -n 1p  # sed reads it all: no SIGPIPE under pipefail
  command -v python3 && python3 -V
  ls -d /usr/local/cuda* 2>/dev/null || true
  df -h /tmp | tail -1
  echo "== python packages the benchmark takes from the image"
  python3 - <<'PY'
import importlib.metadata as md
import importlib.util
for name in ("numpy", "transformers", "tokenizers", "huggingface-hub", "jinja2", "pyyaml",
             "sentencepiece", "safetensors", "grpcio", "protobuf", "prometheus-client",
             "nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13", "nvidia-cufft", "nvidia-cuda-nvrtc",
             "nvidia-cuda-runtime", "nvidia-cusolver"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
spec = importlib.util.find_spec("nvidia")
print("nvidia package dirs:", list(spec.submodule_search_locations or []) if spec else None)
PY
}

mkdir -p "$MLXW/parts"
cp "$dir"/* "$MLXW/parts/"
case $mode in
  stage)
    echo "kept $(ls "$MLXW/parts" | wc -l) files in $MLXW/parts"
    probe
    ;;
  finish)
    env -u PYTHONPATH python3 "$here/unpack.py" "$MLXW"
    # shellcheck disable=SC1091
    . "$MLXW/env.sh"
    python3 - <<'PY'
import importlib.metadata as md
import time
import mlx.core as mx
print("mlx", md.version("mlx"), "mlx-lm", md.version("mlx-lm"), "grpcio", md.version("grpcio"),
      "protobuf", md.version("protobuf"), "device", mx.default_device(), mx.device_info())
a = mx.random.normal((4096, 4096))
mx.eval(a @ a)
start = time.perf_counter()
for _ in range(10):
    mx.eval(a @ a)
print(f"4096^2 fp32 matmul: {10 * 2 * 4096**3 / (time.perf_counter() - start) / 1e12:.0f} TFLOP/s")
import google.protobuf, grpc, grpc_health, grpc_reflection, mlx_lm  # importable, and ours
print("protobuf", google.protobuf.__version__, google.protobuf.__file__)
print("grpc", grpc.__version__, grpc.__file__)
import os
if not google.protobuf.__file__.startswith(os.environ["MLXW"]):
    version = tuple(int(x) for x in google.protobuf.__version__.split(".")[:2])
    assert version >= (7, 35), "an older protobuf of the image shadows the carried one"
    print("note: the image's protobuf is imported (new enough for the generated code)")
PY
    ;;
  *)
    echo "usage: install.sh stage|finish DIR" >&2
    exit 2
    ;;
esac
