#!/usr/bin/env bash
# Fetches the llama.cpp source vendored in the llama-cpp-python 0.3.36 sdist (PyPI) and
# prints the source dir (use it as SLUICE_LLAMA_CPP). Idempotent: a second run only prints.
#
#   tools/get-llama-cpp.sh           # download + extract, print <src>
#   tools/get-llama-cpp.sh --build   # also build the peer binaries into <src>/build/bin
#
# Everything lives under ${SLUICE_CACHE:-$HOME/.cache/sluice}/llama-cpp-python; nothing in the repo.
# Build flags follow /work/shared/REFERENCES.md: no native tuning and AMX OFF (AMX faults here).
# Env: JOBS (default 2) for the build.
set -euo pipefail

version=0.3.36
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
dir="$cache/llama-cpp-python"
src="$dir/llama_cpp_python-$version/vendor/llama.cpp"
venv="$dir/venv"

build=0
for arg in "$@"; do
  case "$arg" in
    --build) build=1 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "get-llama-cpp.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done

ensure_venv() {
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" >&2
  fi
}

if [ ! -f "$src/CMakeLists.txt" ]; then
  mkdir -p "$dir"
  sdist="$dir/llama_cpp_python-$version.tar.gz"
  if [ ! -f "$sdist" ]; then
    ensure_venv
    # The sdist is the only distribution on PyPI, so a plain --no-deps download fetches it
    # (do not pass --no-binary :all:, it makes pip try to build metadata).
    "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps \
      -d "$dir" "llama-cpp-python==$version" >&2
  fi
  tmp="$dir/extract.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  tar xzf "$sdist" -C "$tmp"
  rm -rf "$dir/llama_cpp_python-$version"
  mv "$tmp/llama_cpp_python-$version" "$dir/"
  rmdir "$tmp"
fi

if [ "$build" = 1 ]; then
  targets=(llama-bench llama-cli llama-completion llama-quantize llama-perplexity llama-tokenize llama-debug)
  have_all=1
  for t in "${targets[@]}"; do
    [ -x "$src/build/bin/$t" ] || have_all=0
  done
  if [ "$have_all" = 0 ]; then
    ensure_venv
    if [ ! -x "$venv/bin/cmake" ]; then
      "$venv/bin/pip" install --quiet --disable-pip-version-check cmake >&2
    fi
    cmake="$venv/bin/cmake"
    "$cmake" -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF >&2
    "$cmake" --build "$src/build" -j"${JOBS:-2}" --target "${targets[@]}" >&2
  fi
fi

echo "$src"
