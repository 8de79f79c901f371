#!/usr/bin/env bash
# Packs what a GPU machine without a package index lacks into two folders of
# this checkout, each small enough for a transfer limited to 64 MiB with the tree:
#   .gpupack/call1/  part 1 of the unpacked mlx-cuda-13 wheel (tar.xz, split)
#   .gpupack/call2/  the rest of it, the mlx (cp312) and mlx-lm wheels, and
#                    grpcio, grpcio-health-checking, grpcio-reflection, protobuf
#                    at the versions the generated code needs, prometheus-client,
#                    llguidance (structured outputs)
# plus MANIFEST (sha256 of every file) in both. Run it on a machine that reaches
# PyPI, in the checkout you copy to the GPU machine. `.gpupack/` is ignored through
# the repository's info/exclude: the wheels are never committed.
# Downloads and the tar.xz are cached under $MLX_WORKER_CACHE/gpu-pack (default
# ~/.cache/mlx-worker-svc/gpu-pack), so a second run (another checkout) is quick.
# The GPU machine must already have Python 3.12, the CUDA 13 libraries, numpy,
# transformers, tokenizers, jinja2, pyyaml, sentencepiece, safetensors and
# huggingface-hub; see benchmarks/gpu/README.md.
set -euo pipefail

MLX_VERSION=${MLX_VERSION:-0.32.4}
MLX_LM_VERSION=${MLX_LM_VERSION:-0.32.2}
GRPC_VERSION=${GRPC_VERSION:-1.85.3}
GRPC_PLUGINS_VERSION=${GRPC_PLUGINS_VERSION:-1.85.1}
PROTOBUF_VERSION=${PROTOBUF_VERSION:-7.36.2}
PROMETHEUS_VERSION=${PROMETHEUS_VERSION:-0.26.0}
LLGUIDANCE_VERSION=${LLGUIDANCE_VERSION:-1.9.1}   # the grammar engine the engine imports
PYTHON_VERSION=${PYTHON_VERSION:-3.12}   # the GPU machine's python3
PART_SIZE=${PART_SIZE:-48m}              # the tar.xz is split into parts of this size
LIMIT=$((64 * 1024 * 1024))              # the largest transfer: one part and the tree
PY=${PYTHON:-python3}

repo=$(git rev-parse --show-toplevel)
exclude="$(git rev-parse --path-format=absolute --git-common-dir)/info/exclude"
grep -qxF '/.gpupack/' "$exclude" 2>/dev/null || echo '/.gpupack/' >>"$exclude"

key="mlx-${MLX_VERSION}-lm-${MLX_LM_VERSION}-grpc-${GRPC_VERSION}-pb-${PROTOBUF_VERSION}-llg-${LLGUIDANCE_VERSION}-py${PYTHON_VERSION}"
cache="${MLX_WORKER_CACHE:-$HOME/.cache/mlx-worker-svc}/gpu-pack/$key"
mkdir -p "$cache/wheels"

platforms=()
for p in manylinux_2_35_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
echo "== downloading wheels into $cache/wheels"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
  --python-version "$PYTHON_VERSION" "${platforms[@]}" -d "$cache/wheels" \
  "mlx-cuda-13==$MLX_VERSION" "mlx==$MLX_VERSION" "mlx-lm==$MLX_LM_VERSION" \
  "grpcio==$GRPC_VERSION" "grpcio-health-checking==$GRPC_PLUGINS_VERSION" \
  "grpcio-reflection==$GRPC_PLUGINS_VERSION" "protobuf==$PROTOBUF_VERSION" \
  "prometheus-client==$PROMETHEUS_VERSION" "llguidance==$LLGUIDANCE_VERSION"

if [ ! -s "$cache/mlx-cuda-13.tar.xz" ]; then
  echo "== unpacking mlx-cuda-13 and compressing it (xz -9, a few minutes)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m zipfile -e "$cache"/wheels/mlx_cuda_13-"$MLX_VERSION"-*.whl "$tmp/site"
  tar -C "$tmp/site" -cf - . | xz -9 -T0 >"$cache/mlx-cuda-13.tar.xz.tmp"
  mv "$cache/mlx-cuda-13.tar.xz.tmp" "$cache/mlx-cuda-13.tar.xz"
fi

dest="$repo/.gpupack"
rm -rf "$dest"
mkdir -p "$dest/call1" "$dest/call2" "$dest/split"
split -b "$PART_SIZE" -d -a 2 "$cache/mlx-cuda-13.tar.xz" "$dest/split/mlx-cuda-13.tar.xz.part"
parts=("$dest"/split/*.part*)
if [ "${#parts[@]}" -ne 2 ]; then
  echo "expected 2 parts of $PART_SIZE, got ${#parts[@]}: set PART_SIZE" >&2
  exit 1
fi
mv "${parts[0]}" "$dest/call1/"
mv "${parts[1]}" "$dest/call2/"
rmdir "$dest/split"
for w in "$cache"/wheels/*.whl; do
  case "$(basename "$w")" in mlx_cuda_13-*) continue ;; esac
  cp "$w" "$dest/call2/"
done
(cd "$dest" && sha256sum call1/* call2/* | sed 's# call[12]/#  #' >MANIFEST)
cp "$dest/MANIFEST" "$dest/call1/MANIFEST"
cp "$dest/MANIFEST" "$dest/call2/MANIFEST"
rm "$dest/MANIFEST"

# What each transfer holds: the tree (tracked + untracked files git does not
# ignore) plus that part's folder.
tree=$(cd "$repo" && { git ls-files -z; git ls-files -z --others --exclude-standard; } |
  xargs -0 -r stat -c %s -- 2>/dev/null | awk '{s += $1} END {print s + 0}')
echo "== the tree (tracked + untracked, not ignored): $((tree / 1024)) KiB"
status=0
for call in call1 call2; do
  size=$(du -sb "$dest/$call" | cut -f1)
  total=$((size + tree))
  awk -v c="$call" -v s="$size" -v t="$total" 'BEGIN {
    printf "%s: .gpupack/%s = %d bytes (%.1f MiB); with the tree %.1f MiB of 64 MiB\n",
      c, c, s, s / 1048576, t / 1048576 }'
  ls -l "$dest/$call" | tail -n +2 | awk '{printf "    %10d  %s\n", $5, $9}'
  if [ "$total" -gt "$LIMIT" ]; then
    echo "    OVER THE 64 MiB LIMIT" >&2
    status=1
  fi
done
exit $status
