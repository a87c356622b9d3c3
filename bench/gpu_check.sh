#!/usr/bin/env bash
# The CUDA backend's check on an NVIDIA machine, in at most 8 minutes:
#
#   bench/gpu_check.sh RESULTS_DIR               on the GPU machine (make gpu-bundle builds what to copy there)
#   bench/gpu_check.sh --rehearse RESULTS_DIR    the same stages on a CPU (tests/cuda/test_gpu_check.py, in make bench)
#
# For a machine whose Python (3.12; PYTHON=... to choose another) has torch with CUDA, triton, numpy and
# transformers but no network. Stages, each under `timeout -s INT` (pytest still prints its summary) and
# each run whatever the ones before gave; RESULTS/check.json is written again after every stage:
#   0. step 0 (bench/gpu_preflight.py, about 20 s, before anything is installed): a C compiler and
#      Python.h, a one-line Triton kernel, llmd's two custom ops captured in a CUDA graph at Qwen2-0.5B shapes;
#   1. install: a venv over the machine's packages; the wheels of bench/gpu_wheels.txt whose modules do not
#      import, from gpu-wheels/ beside the tree (all at once, else one by one); llmd with --no-deps;
#   2. llmd bench --device cuda against transformers on the same GPU (Qwen2-0.5B shape, random weights,
#      bfloat16, 1,000-token prompt, 64 streams): tok/s, ttft, graphs on or not;
#   3. pytest -m gpu: agreement figures recorded first (bfloat16 and float32 tokens against the CPU engine),
#      then kernels at real shapes, graph replay against eager steps, the device sampler, exact float32 parity;
#   4. the step lint on fake cuda tensors.
# --rehearse: CPU torch, Triton's interpreter and the graph stand-in (llmd.bench.gpu_rehearse), this
# Python with llmd installed, nothing installed, a tiny random model and a few tokens.
# RESULTS gets env.json, step0.json, bench.json, pytest.log, pytest.xml, agreement_*.json, lint.log,
# *.err, check.json and summary.txt. The exit status is 1 when any stage failed.
set -uo pipefail
REHEARSE=0
if [ "${1:-}" = "--rehearse" ]; then REHEARSE=1; shift; fi
RESULTS=${1:?usage: bench/gpu_check.sh [--rehearse] RESULTS_DIR}
cd "$(dirname "$0")/.."
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
rm -f "$RESULTS/check.json" "$RESULTS/env.json"
PY=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-.gpu-venv}
START=$SECONDS
DEADLINE=$((START + ${GPU_CHECK_SECONDS:-470}))
status=0
say() { echo "gpu_check [$((SECONDS - START))s]: $*" | tee -a "$RESULTS/summary.txt"; }

# stage NAME LIMIT_S STDOUT_FILE CMD...: CMD under `timeout -s INT` (at most LIMIT_S, and never past the
# deadline), stdout to RESULTS/STDOUT_FILE, stderr to RESULTS/NAME.err; recorded in check.json
stage() {
    local name=$1 limit=$2 out=$3 t0=$SECONDS rc
    shift 3
    local left=$((DEADLINE - SECONDS))
    [ "$limit" -gt "$left" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        say "$name: skipped, the 8 minutes are spent"; rc=124
    elif declare -F "$1" > /dev/null; then          # a function of this script (no timeout: it cannot exec one)
        "$@" > "$RESULTS/$out" 2> "$RESULTS/$name.err"; rc=$?
    else
        timeout -s INT -k 15 "$limit" "$@" > "$RESULTS/$out" 2> "$RESULTS/$name.err"; rc=$?
    fi
    [ $rc -eq 0 ] || status=1
    local line
    line=$("$PY" bench/gpu_check_report.py "$RESULTS" "$name" "$rc" "$((SECONDS - t0))")
    say "$name: exit $rc${line:+ ($line)}"
    [ $rc -eq 0 ] || say "$name: $(grep -v '^\s*$' "$RESULTS/$name.err" | tail -1)"
    return $rc
}

# -- 0. the machine, and step 0: it can build and capture, before anything is installed -----------------------
if [ $REHEARSE -eq 1 ]; then
    export TRITON_INTERPRET=1
    PRE=(--rehearse)
else
    PRE=()
fi
stage step0 60 step0.json "$PY" bench/gpu_preflight.py "${PRE[@]}" --env "$RESULTS/env.json"
[ -s "$RESULTS/env.json" ] || { say "$PY needs torch and triton (and a CUDA GPU): $(cat "$RESULTS/step0.err")"; exit 2; }
say "$(tr -d '\n' < "$RESULTS/env.json")"
{ git rev-parse HEAD 2>/dev/null || cat BUNDLE_COMMIT 2>/dev/null; } > "$RESULTS/commit.txt"

# -- 1. install: the missing wheels, then llmd without dependencies ------------------------------------------
wheels() { grep -v '^#' bench/gpu_wheels.txt; }
install() {
    local missing=() req failed=()
    read -r -a missing < <(wheels | "$VPY" -c '
import importlib.util, sys
print(" ".join(req for mod, req in (line.split() for line in sys.stdin if line.strip())
               if importlib.util.find_spec(mod) is None))')
    if [ $REHEARSE -eq 1 ]; then
        echo "rehearsal: nothing installed; not importable: ${missing[*]:-none}"
        [ ${#missing[@]} -eq 0 ]; return
    fi
    echo "installing from gpu-wheels/: ${missing[*]:-nothing} setuptools>=70.1"
    # one call for all; where it fails, one by one, so that a bad wheel costs only its own module
    if ! "$VPY" -m pip install -q --no-index --find-links gpu-wheels "${missing[@]}" "setuptools>=70.1"; then
        for req in "${missing[@]}" "setuptools>=70.1"; do
            "$VPY" -m pip install -q --no-index --find-links gpu-wheels "$req" || failed+=("$req")
        done
    fi
    # (setuptools >= 70.1 builds the editable install without the wheel package)
    "$VPY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || failed+=(llmd)
    echo "not installed: ${failed[*]:-none}"
    [ ${#failed[@]} -eq 0 ]
}
if [ $REHEARSE -eq 1 ]; then
    VPY=$PY
    RUN=("$VPY" -m llmd.bench.gpu_rehearse)
    export LLMD_REHEARSE_IMPORTS="$RESULTS/imports.txt"        # what the stages import, for the wheel list's test
else
    test -x "$VENV/bin/python" || "$PY" -m venv --system-site-packages "$VENV"
    VPY="$VENV/bin/python"
    RUN=("$VPY" -m)
fi
stage install 90 install.log install
cat "$RESULTS/install.log" >> "$RESULTS/summary.txt"

# -- 2. llmd bench --device cuda against transformers on the same GPU ----------------------------------------
if [ $REHEARSE -eq 1 ]; then
    SIZE=(--shape tiny --dtype float32 --prompt-len 20 --gen 3 --concurrency 2 --repeat 1 --kv-memory 8MiB
          --max-batch-tokens 64 --max-num-seqs 2 --max-model-len 64)     # (tiny: one layer when rehearsed)
else
    SIZE=(--shape qwen2-0.5b --dtype bfloat16 --prompt-len 1000 --gen 64 --concurrency 64 --repeat 2 --kv-memory 4GiB
          --max-batch-tokens 2048)
fi
stage bench 150 bench.json "${RUN[@]}" llmd.cli bench --device cuda --against hf --shared-prefix 0 --json "${SIZE[@]}"

# -- 3. the gpu tests: agreement recorded first, then exact parity and the kernels at real shapes ------------
export LLMD_GPU_RESULTS="$RESULTS"
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1          # the plugins named here only, wherever the tests run
stage pytest_gpu 170 pytest.log "${RUN[@]}" pytest -q -m gpu -p no:cacheprovider -p pytest_timeout \
    --timeout 120 --junitxml "$RESULTS/pytest.xml" tests/cuda/test_cuda_gpu.py
say "pytest -m gpu: $(tail -1 "$RESULTS/pytest.log")"

# -- 4. the step lint on fake cuda tensors -------------------------------------------------------------------
LINT=(); [ $REHEARSE -eq 1 ] && LINT=(--collect-only)          # (make test runs it on the CPU anyway)
stage lint 40 lint.log "$VPY" -m pytest -q -p no:cacheprovider -p pytest_timeout "${LINT[@]}" tests/cuda/test_cuda_lint.py

say "done: exit $status (results in $RESULTS)"
exit $status
