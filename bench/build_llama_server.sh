#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) from the source vendored in the llama-cpp-python
# source distribution, and print the binary's path on the last line of stdout. Its tools llmd compares
# with go into the same bin/ folder: `llama-quantize`, `llama-bench`, `llama-tokenize`, and llmd's `llama-windows`
# (bench/llama_windows.cpp, linked against the same static libraries: teacher-forced token windows for
# the export's and bench's quality tables).
#
#   bench/build_llama_server.sh                  # builds once into .cache/llama-server/, then reuses it
#   LLMD_LLAMA_SERVER_DIR=/tmp/ls bench/build_llama_server.sh
#   LLAMA_SERVER=$(bench/build_llama_server.sh | tail -n1)
#
# Environment:
#   LLMD_LLAMA_SERVER_DIR   cache directory (default: <repo>/.cache/llama-server; gitignored)
#   LLMD_LLAMA_CPP_PYTHON   llama-cpp-python version whose sdist is used (default below)
#   LLMD_BUILD_JOBS         parallel compile jobs (default 2)
#   PIP                     pip command (default: <repo>/.venv/bin/pip if present, else pip)
#
# Idempotent: when every program is in <dir>/bin nothing is downloaded or built.
# Progress goes to stderr; only the path goes to stdout.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${LLMD_LLAMA_CPP_PYTHON:-0.3.36}"
dir="${LLMD_LLAMA_SERVER_DIR:-$repo/.cache/llama-server}"
jobs="${LLMD_BUILD_JOBS:-2}"
binary="$dir/bin/llama-server"
programs=(llama-server llama-quantize llama-bench llama-tokenize llama-windows)
if [[ -z "${PIP:-}" ]]; then
    if [[ -x "$repo/.venv/bin/pip" ]]; then PIP="$repo/.venv/bin/pip"; else PIP=pip; fi
fi

say() { echo "[build_llama_server] $*" >&2; }

all_built() {
    for p in "${programs[@]}"; do [[ -x "$dir/bin/$p" ]] || return 1; done
}
if all_built; then
    say "cached: $dir/bin"
    echo "$binary"
    exit 0
fi

mkdir -p "$dir/src"
sdist=$(ls "$dir"/src/llama_cpp_python-"$version".tar.gz 2>/dev/null || true)
if [[ -z "$sdist" ]]; then
    # pip prepares an sdist's metadata even for `download`; its build backend comes from a wheel
    # into a side folder (with build isolation, --no-binary :all: would compile cmake itself)
    say "installing the sdist's build backend (scikit-build-core) into $dir/tools"
    $PIP install -q --target "$dir/tools" scikit-build-core >&2
    say "downloading llama-cpp-python==$version source distribution"
    PYTHONPATH="$dir/tools" $PIP download --no-binary :all: --no-deps --no-build-isolation -d "$dir/src" \
        "llama-cpp-python==$version" >&2
    sdist=$(ls "$dir"/src/llama_cpp_python-"$version".tar.gz)
fi

src="$dir/src/llama_cpp_python-$version"
if [[ ! -d "$src/vendor/llama.cpp" ]]; then
    say "unpacking $sdist"
    tar -xzf "$sdist" -C "$dir/src"
fi

# On a CPU with AMX, a native build compiles llama.cpp's AMX matrix products, which crash here
# (SIGSEGV in ggml_backend_amx_mul_mat on the first prompt of a Q8_0 or Q4_0 model; reported upstream
# as machine-dependent and unfixed). So there the build names the CPU's other instruction sets one by
# one and leaves AMX out; LLMD_LLAMA_AMX=1 keeps the native build.
isa=()
if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && [[ "${LLMD_LLAMA_AMX:-0}" != 1 ]]; then
    has() { grep -qw "$1" /proc/cpuinfo; }
    isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
    has bmi2 && isa+=(-DGGML_BMI2=ON)
    has avx_vnni && isa+=(-DGGML_AVX_VNNI=ON)
    if has avx512f && has avx512bw && has avx512vl && has avx512dq; then
        isa+=(-DGGML_AVX512=ON)
        has avx512vbmi && isa+=(-DGGML_AVX512_VBMI=ON)
        has avx512_vnni && isa+=(-DGGML_AVX512_VNNI=ON)
        has avx512_bf16 && isa+=(-DGGML_AVX512_BF16=ON)
    fi
fi

if [[ ! -f "$dir/build/CMakeCache.txt" ]]; then
    say "configuring $src/vendor/llama.cpp (CPU only, no curl${isa:+, without AMX})"
    cmake -S "$src/vendor/llama.cpp" -B "$dir/build" \
        -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF \
        -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DGGML_SYCL=OFF -DGGML_OPENCL=OFF \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON "${isa[@]}" >&2
fi

say "building llama-server, llama-quantize, llama-bench and llama-tokenize with -j$jobs (several minutes on two cores)"
cmake --build "$dir/build" --target llama-server llama-quantize llama-bench llama-tokenize -j "$jobs" >&2

mkdir -p "$dir/bin"
for p in llama-server llama-quantize llama-bench llama-tokenize; do
    found=$(find "$dir/build/bin" "$dir/build" -type f -name "$p" -perm -u+x 2>/dev/null | head -n1)
    if [[ -z "$found" ]]; then
        say "build finished but no $p binary was found under $dir/build"
        exit 1
    fi
    cp "$found" "$dir/bin/$p.tmp" && mv "$dir/bin/$p.tmp" "$dir/bin/$p"
done

say "linking llama-windows against the same static libraries"
b="$dir/build"
${CXX:-g++} -O2 -std=c++17 -I"$src/vendor/llama.cpp/include" -I"$src/vendor/llama.cpp/ggml/include" \
    "$repo/bench/llama_windows.cpp" -Wl,--start-group "$b/src/libllama.a" "$b/ggml/src/libggml.a" \
    "$b/ggml/src/libggml-cpu.a" "$b/ggml/src/libggml-base.a" -Wl,--end-group -fopenmp -lpthread -ldl \
    -o "$dir/bin/llama-windows.tmp"
mv "$dir/bin/llama-windows.tmp" "$dir/bin/llama-windows"
say "built: $dir/bin (${programs[*]})"
echo "$binary"
