#!/usr/bin/env bash
# Installs NVRTC (the CUDA runtime compiler, PyPI wheel nvidia-cuda-nvrtc, no GPU needed) and
# prints the directory holding libnvrtc.so.13: with it in SLUICE_NVRTC_DIR (or on
# LD_LIBRARY_PATH), the CUDA backend's kernel source compiles on a machine without a GPU
# (`no_gpu::kernels_compile_with_nvrtc`).
# Everything lives under ${SLUICE_CACHE:-$HOME/.cache/sluice}; nothing goes in the repo.
set -euo pipefail
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
version=13.2.86
dir="$cache/nvrtc-$version"
if [ -e "$dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  echo "$dir/nvidia/cu13/lib"
  exit 0
fi
# pip from a small venv of our own (a system python3 may have no pip module).
venv="$cache/venv-tools"
if [ ! -x "$venv/bin/pip" ]; then
  python3 -m venv "$venv" >&2
fi
tmp="$dir.tmp.$$"
mkdir -p "$tmp"
"$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  "nvidia-cuda-nvrtc==$version" -d "$tmp" >&2
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$tmp"/*.whl "$tmp" >&2
rm -f "$tmp"/*.whl
rm -rf "$dir"
mv "$tmp" "$dir"
echo "$dir/nvidia/cu13/lib"
