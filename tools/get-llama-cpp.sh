#!/usr/bin/env bash
# Fetches the llama.cpp source vendored in the llama-cpp-python 0.3.36 sdist (PyPI) and
# prints the source dir (use it as SLUICE_LLAMA_CPP). Idempotent: a second run only prints.
#
#   tools/get-llama-cpp.sh                # download + extract, print <src>
#   tools/get-llama-cpp.sh --build        # also build the peer binaries into <src>/build/bin
#   tools/get-llama-cpp.sh --print-flags  # only print the CPU cmake flags for this CPU
#   tools/get-llama-cpp.sh --built-flags  # only print the flags the current build used
#
# Everything lives under ${SLUICE_CACHE:-$HOME/.cache/sluice}/llama-cpp-python; nothing in the repo.
# The build is tuned from this CPU's /proc/cpuinfo flags with GGML_NATIVE=OFF (AVX2, FMA,
# F16C, BMI2, AVX-512 only when F/BW/VL/DQ/CD are all there, VNNI, BF16, VBMI), AMX always
# OFF (it is listed but faults on some hosts). The flags are recorded in <src>/build/sluice-cpu-flags;
# a build whose stamp differs from this CPU's flags (cache made on another machine kind) is redone.
# Env: JOBS (default 2) for the build; SLUICE_CPUINFO (default /proc/cpuinfo) for the CPU flags.
set -euo pipefail

version=0.3.36
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
dir="$cache/llama-cpp-python"
src="$dir/llama_cpp_python-$version/vendor/llama.cpp"
venv="$dir/venv"
stamp="$src/build/sluice-cpu-flags"

# The ggml CPU cmake options for the CPU described by $SLUICE_CPUINFO (one line, space separated).
cpu_cmake_flags() {
  local cpuinfo="${SLUICE_CPUINFO:-/proc/cpuinfo}" line
  line="$(grep -m1 '^flags[[:space:]]*:' "$cpuinfo" || true)"
  if [ -z "$line" ]; then
    echo "get-llama-cpp.sh: no 'flags' line in $cpuinfo" >&2
    return 1
  fi
  local -A have=()
  local f
  for f in ${line#*:}; do have[$f]=1; done
  on() {
    local x
    for x in "$@"; do [ -n "${have[$x]:-}" ] || { echo OFF; return; }; done
    echo ON
  }
  # ggml's GGML_AVX512 compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw.
  local avx512 vbmi=OFF vnni=OFF bf16=OFF
  avx512="$(on avx512f avx512bw avx512vl avx512dq avx512cd)"
  if [ "$avx512" = ON ]; then
    vbmi="$(on avx512vbmi)" vnni="$(on avx512_vnni)" bf16="$(on avx512_bf16)"
  fi
  echo "-DGGML_NATIVE=OFF -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma)" \
    "-DGGML_F16C=$(on f16c) -DGGML_BMI2=$(on bmi2) -DGGML_AVX512=$avx512" \
    "-DGGML_AVX512_VBMI=$vbmi -DGGML_AVX512_VNNI=$vnni -DGGML_AVX512_BF16=$bf16" \
    "-DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

build=0
for arg in "$@"; do
  case "$arg" in
    --build) build=1 ;;
    --print-flags) cpu_cmake_flags; exit 0 ;;
    --built-flags) if [ -f "$stamp" ]; then cat "$stamp"; else echo "(not built)"; fi; exit 0 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
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
  flags="$(cpu_cmake_flags)"
  targets=(llama-bench llama-cli llama-completion llama-quantize llama-perplexity llama-tokenize llama-debug)
  have_all=1
  for t in "${targets[@]}"; do
    [ -x "$src/build/bin/$t" ] || have_all=0
  done
  if [ "$have_all" = 1 ] && [ "$(cat "$stamp" 2>/dev/null)" != "$flags" ]; then
    # Built for another CPU (or before the stamp existed): its binaries may SIGILL here.
    echo "get-llama-cpp.sh: build flags '$(cat "$stamp" 2>/dev/null || echo none)' do not match this CPU;" \
      "rebuilding with '$flags'" >&2
    rm -rf "$src/build"
    have_all=0
  fi
  if [ "$have_all" = 0 ]; then
    ensure_venv
    if [ ! -x "$venv/bin/cmake" ]; then
      "$venv/bin/pip" install --quiet --disable-pip-version-check cmake >&2
    fi
    cmake="$venv/bin/cmake"
    rm -f "$stamp"
    # shellcheck disable=SC2086 # $flags is a list of -D options
    "$cmake" -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF $flags >&2
    "$cmake" --build "$src/build" -j"${JOBS:-2}" --target "${targets[@]}" >&2
    echo "$flags" > "$stamp"
  fi
fi

echo "$src"
