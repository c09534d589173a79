#!/usr/bin/env bash
# Builds llama.cpp's llama-tokenize and llama-simple from the llama-cpp-python source distribution on PyPI
# (it vendors llama.cpp), gptpipe-llama-greedy (scripts/llamacpp_greedy.cpp: llama.cpp's greedy ids, which
# `gptpipe gguf` compares with the model's) and gptpipe-llama-tokenize (scripts/llamacpp_tokenize.cpp: many texts'
# ids in one process), for the `llamacpp` test tier and for checking a GGUF file by hand.
#   scripts/build_llamacpp.sh            # into ~/.cache/gptpipe-llamacpp (GPTPIPE_LLAMACPP overrides)
# Needs cmake and a C++ compiler; about 10 minutes with JOBS=2. Rerunning it reuses the finished build.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${GPTPIPE_LLAMACPP:-$HOME/.cache/gptpipe-llamacpp}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"

SDIST="$CACHE/src/llama_cpp_python-$VERSION"
if [ ! -d "$SDIST/vendor/llama.cpp" ]; then
    mkdir -p "$CACHE/src"
    "$PYTHON" -m pip download --no-binary :all: --no-deps --dest "$CACHE/src" "llama-cpp-python==$VERSION"
    tar -xzf "$CACHE/src/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/src"
fi

# Static libraries: the two tools run from the cache folder without an install step. On x86-64 the CPU
# features are named (AVX2/FMA/F16C) instead of -march=native: where cpuid advertises AMX but the kernel has not
# enabled its register state (seen in this workplace's VMs), native builds ran ggml's AMX q8_0 kernels and died
# with SIGILL. The tools check a model's numbers, not llama.cpp's speed.
CPU_FLAGS=()
if [ "$(uname -m)" = x86_64 ]; then
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
fi
cmake -S "$SDIST/vendor/llama.cpp" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF "${CPU_FLAGS[@]}"
cmake --build "$CACHE/build" -j "$JOBS" --target llama-tokenize llama-simple
# gptpipe's own tools, linked as llama-simple is (its link line: the static libraries, OpenMP, pthread).
LLAMA="$SDIST/vendor/llama.cpp"
LIBS="$CACHE/build/src/libllama.a $CACHE/build/ggml/src/libggml.a $CACHE/build/ggml/src/libggml-cpu.a"
LIBS="$LIBS $CACHE/build/ggml/src/libggml-base.a"
for tool in greedy tokenize; do
    # shellcheck disable=SC2086  # LIBS is a list of paths
    "${CXX:-c++}" -O3 -DNDEBUG -std=c++17 -I"$LLAMA/include" -I"$LLAMA/ggml/include" \
        "$(dirname "$0")/llamacpp_$tool.cpp" -o "$CACHE/build/bin/gptpipe-llama-$tool" $LIBS -ldl -lm -fopenmp -lpthread
done

# The vendored llama.cpp commit, as the sdist's changelog names it for this version.
COMMIT="$(sed -n "/^## \[$VERSION\]/,/^## /s/.*ggml-org\/llama.cpp@\([0-9a-f]*\).*/\1/p" "$SDIST/CHANGELOG.md" | head -n 1)"
printf 'llama-cpp-python %s\nllama.cpp %s\n' "$VERSION" "$COMMIT" > "$CACHE/build/bin/VERSION"
cat "$CACHE/build/bin/VERSION"
ls "$CACHE/build/bin"
