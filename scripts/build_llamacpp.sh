#!/usr/bin/env bash
# Builds llama.cpp, the peer of `mtpserve bench peers --peers llamacpp`, outside the repository (nothing of it is
# committed): the llama.cpp that the llama-cpp-python source distribution vendors, from the package registry,
# built with cmake for this CPU (-DGGML_NATIVE=ON). Only the tools the benchmark runs are built. About 10-25
# minutes on 2 cores; run it once, in the background. Usage: scripts/build_llamacpp.sh [DIR]
set -euo pipefail
DIR=${1:-${MTPSERVE_LLAMACPP_DIR:-$HOME/.cache/mtpserve/llama.cpp}}
VERSION=0.3.36   # llama-cpp-python's version; it pins the llama.cpp it vendors
if [ ! -f "$DIR/CMakeLists.txt" ]; then
  work=$(mktemp -d)
  pip download --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$VERSION"
  tar xzf "$work"/llama_cpp_python-$VERSION.tar.gz -C "$work"
  mkdir -p "$(dirname "$DIR")"
  mv "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR"
  rm -rf "$work"
  # the vendored tree's .git file points into a parent repository that is not there (cmake would depend on its
  # index forever); the archive's file times may lie in the future (ninja would re-run cmake forever)
  rm -f "$DIR/.git"
  find "$DIR" -exec touch -h {} +
fi
cmake -S "$DIR" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$DIR/build" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server
echo "built: $DIR/build/bin (set MTPSERVE_LLAMACPP_DIR=$DIR if it is not the default)"
