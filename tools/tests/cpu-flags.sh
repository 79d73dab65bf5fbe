#!/usr/bin/env bash
# Checks tools/get-llama-cpp.sh's CPU flag detection on fake /proc/cpuinfo files (no
# download, no build): AVX-512 only where the CPU has it, AMX always off, GGML_NATIVE off.
#
#   tools/tests/cpu-flags.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fails=0

# check NAME FLAGS_LINE EXPECTED_OPTION...
check() {
  local name="$1" flags="$2" got opt
  shift 2
  printf 'processor\t: 0\nvendor_id\t: test\nmodel name\t: %s\nflags\t\t: %s\n\nprocessor\t: 1\nflags\t\t: %s\n' \
    "$name" "$flags" "$flags" > "$tmp/cpuinfo"
  got="$(SLUICE_CPUINFO="$tmp/cpuinfo" SLUICE_CACHE="$tmp/cache" tools/get-llama-cpp.sh --print-flags)"
  for opt in "$@"; do
    if [[ " $got " != *" $opt "* ]]; then
      echo "FAIL $name: expected $opt in: $got" >&2
      fails=$((fails + 1))
    fi
  done
  echo "ok   $name: $got"
}

base="fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid extd_apicid aperfmperf pni pclmulqdq monitor ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand lahf_lm cmp_legacy svm extapic cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw skinit wdt tce topoext perfctr_core bmi1 avx2 smep bmi2 erms invpcid cqm rdt_a rdseed adx smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves"

# AMD EPYC (Zen 3, Milan): AVX2 only.
check "AMD EPYC 7B13 (AVX2 only)" "$base vaes vpclmulqdq rdpid fsrm" \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

# Intel Sapphire Rapids: AVX-512 with VNNI/BF16/VBMI, and AMX listed (AMX must stay OFF).
check "Intel Xeon (AVX-512 + AMX listed)" \
  "$base avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg avx512_vpopcntdq avx_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8" \
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
  -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

# Intel Ice Lake: AVX-512 and VNNI/VBMI, but no BF16.
check "Intel Xeon (Ice Lake, no avx512_bf16)" \
  "$base avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512vbmi avx512_vbmi2 avx512_vnni" \
  -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=OFF

# Xeon Phi-like: avx512f but no BW/VL/DQ: ggml's AVX-512 build would not run, so OFF (and its subsets).
check "AVX-512F without BW/VL" "$base avx512f avx512cd avx512_vnni" \
  -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX2=ON

# An old CPU without AVX2/FMA/BMI2.
check "SSE4-only" "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt" \
  -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_AVX512=OFF

# No flags line at all: an error, not a guess.
printf 'processor\t: 0\n' > "$tmp/cpuinfo"
if SLUICE_CPUINFO="$tmp/cpuinfo" tools/get-llama-cpp.sh --print-flags >/dev/null 2>&1; then
  echo "FAIL: a cpuinfo without flags must be an error" >&2
  fails=$((fails + 1))
else
  echo "ok   no flags line: error"
fi

# The stamp: a build made for another CPU is redone, a matching one is kept. A fake source
# tree and a fake cmake (in the venv the script uses) stand in for the real ones.
check_stamp() {
  local cache="$tmp/stamp-cache"
  local src="$cache/llama-cpp-python/llama_cpp_python-0.3.36/vendor/llama.cpp"
  local venv="$cache/llama-cpp-python/venv"
  rm -rf "$cache"
  mkdir -p "$src/build/bin" "$venv/bin"
  touch "$src/CMakeLists.txt" "$venv/bin/python"
  chmod +x "$venv/bin/python"
  cat > "$venv/bin/cmake" <<'SH'
#!/usr/bin/env bash
echo "cmake $*" >> "$(dirname "$0")/cmake.log"
if [ "$1" = --build ]; then
  shift 4  # --build DIR -jN --target
  mkdir -p "$src_build/bin"
  for t in "$@"; do printf '#!/bin/sh\n' > "$src_build/bin/$t"; chmod +x "$src_build/bin/$t"; done
fi
SH
  sed -i "2i src_build='$src/build'" "$venv/bin/cmake"
  chmod +x "$venv/bin/cmake"
  for t in llama-bench llama-cli llama-completion llama-quantize llama-perplexity llama-tokenize llama-debug; do
    printf '#!/bin/sh\n' > "$src/build/bin/$t"; chmod +x "$src/build/bin/$t"
  done
  # Built on an AVX-512 machine (the old unconditional flags), now run on the AVX2-only one.
  echo "-DGGML_NATIVE=OFF -DGGML_AVX512=ON" > "$src/build/sluice-cpu-flags"
  printf 'processor\t: 0\nflags\t\t: %s\n' "$base" > "$tmp/cpuinfo"
  local want
  want="$(SLUICE_CPUINFO="$tmp/cpuinfo" tools/get-llama-cpp.sh --print-flags)"
  SLUICE_CPUINFO="$tmp/cpuinfo" SLUICE_CACHE="$cache" tools/get-llama-cpp.sh --build > /dev/null 2> "$tmp/err"
  if [ "$(grep -c '^cmake -S' "$venv/bin/cmake.log" 2>/dev/null)" != 1 ] \
    || ! grep -q -- "-DGGML_AVX512=OFF" "$venv/bin/cmake.log" \
    || [ "$(cat "$src/build/sluice-cpu-flags")" != "$want" ]; then
    echo "FAIL stamp: a build for another CPU was not redone with this CPU's flags" >&2
    cat "$tmp/err" "$venv/bin/cmake.log" >&2 || true
    fails=$((fails + 1))
  else
    echo "ok   stamp mismatch: rebuilt with $want"
  fi
  # Same CPU again: nothing to do.
  rm -f "$venv/bin/cmake.log"
  SLUICE_CPUINFO="$tmp/cpuinfo" SLUICE_CACHE="$cache" tools/get-llama-cpp.sh --build > /dev/null
  if [ -f "$venv/bin/cmake.log" ]; then
    echo "FAIL stamp: a build matching this CPU was redone" >&2
    fails=$((fails + 1))
  else
    echo "ok   stamp match: build kept"
  fi
  if [ "$(SLUICE_CACHE="$cache" tools/get-llama-cpp.sh --built-flags)" != "$want" ]; then
    echo "FAIL --built-flags does not print the stamp" >&2
    fails=$((fails + 1))
  fi
}
check_stamp

[ "$fails" = 0 ] || { echo "$fails failure(s)" >&2; exit 1; }
echo "cpu-flags: all ok"
