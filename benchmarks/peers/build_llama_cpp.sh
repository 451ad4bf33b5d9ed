#!/usr/bin/env bash
# Build llama.cpp's llama-batched-bench from source with native CPU flags (the peer of
# BENCHMARKS.md's side-by-side table). The source comes from the llama-cpp-python sdist on
# PyPI, which vendors a llama.cpp tree, so nothing but the package registry is needed.
#
#   benchmarks/peers/build_llama_cpp.sh [WORKDIR]      (default: ~/.cache/moelight-peers)
#
# Prints the path of the built binary on its last line. Not a dependency of moelight.
# LLAMA_CMAKE_ARGS adds cmake options: on a host whose llama.cpp AMX kernels die (SIGILL in
# tinygemm_kernel_amx on a KVM guest with amx_int8), build the same ISA without them:
#   LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
#   -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON"
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
WORK="${1:-$HOME/.cache/moelight-peers}"
mkdir -p "$WORK"
cd "$WORK"
SDIST="llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  # pip downloads the sdist before it prepares metadata; that later step may fail without the
  # sdist's build tools, which is fine here: only the archive is wanted.
  pip download --no-deps --no-binary :all: -d "$WORK" "llama-cpp-python==$VERSION" >download.log 2>&1 || true
  [ -f "$SDIST" ] || { echo "could not download $SDIST (see $WORK/download.log)" >&2; exit 1; }
fi
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar xzf "$SDIST"
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON ${LLAMA_CMAKE_ARGS:-} >cmake.log 2>&1
cmake --build "$SRC/build" --target llama-batched-bench -j "$(nproc)" >build.log 2>&1
echo "$SRC/build/bin/llama-batched-bench"
