#!/usr/bin/env bash
# The CUDA backend's check on an NVIDIA machine, in at most 8 minutes:
#
#   bench/gpu_check.sh RESULTS_DIR
#
# For a machine whose Python (3.12; PYTHON=... to choose another) has torch with CUDA, triton, numpy and
# transformers but no network: llmd is installed from this tree with --no-deps into a virtual environment
# that sees those packages, with the wheels of anything else it needs from gpu-wheels/ beside the tree
# (`make gpu-wheels` fetches them where there is a network). Then:
#   1. pytest -m gpu: the kernels at real shapes against the float32 reference, graph replay against eager
#      steps, sampling against the CPU sampler, greedy parity between the GPU and CPU engines on the
#      bundled pair and a random-weight Qwen2-0.5B shape, with draft and n-gram speculation; and the
#      fake-tensor step lint, here on fake cuda tensors;
#   2. llmd bench --device cuda against transformers on the same GPU (Qwen2-0.5B shape, random weights,
#      bfloat16, 1,000-token prompt, 64 streams).
# Everything lands in RESULTS_DIR: env.json, pytest.log, pytest.xml, agreement_*.json, bench_*.json, summary.txt.
set -uo pipefail
RESULTS=${1:?usage: bench/gpu_check.sh RESULTS_DIR}
cd "$(dirname "$0")/.."
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
PY=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-.gpu-venv}
START=$SECONDS
status=0
say() { echo "gpu_check [$((SECONDS - START))s]: $*" | tee -a "$RESULTS/summary.txt"; }

"$PY" - <<'PY' > "$RESULTS/env.json" || { echo "gpu_check: $PY needs torch with a CUDA GPU, and triton" >&2; exit 2; }
import json, platform, sys
try:
    import torch, triton
except ImportError as e:
    sys.exit(f"gpu_check: {e}")
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA GPU")
print(json.dumps({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                  "triton": triton.__version__, "gpu": torch.cuda.get_device_name(0)}, indent=1))
PY
say "$(tr -d '\n' < "$RESULTS/env.json")"

# -- install: a venv over the system's packages, the missing ones from gpu-wheels/, llmd without deps --------
test -x "$VENV/bin/python" || "$PY" -m venv --system-site-packages "$VENV"
VPY="$VENV/bin/python"
missing=()
for pair in safetensors:safetensors tokenizers:tokenizers zmq:pyzmq msgpack:msgpack pydantic:pydantic \
            jinja2:jinja2 tqdm:tqdm pytest:pytest pytest_timeout:pytest-timeout; do
    "$VPY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
# cffi (the CPU kernels' loader, imported through runtime/engine.py and tests/conftest.py) and aiohttp
# (imported by llmd/cli.py through the clients) are needed too: their wheels (with pycparser, and
# aiohttp's multidict, yarl, propcache, frozenlist, aiosignal, aiohappyeyeballs, attrs) belong in
# gpu-wheels/; where a wheel is not there the script says so and goes on
for pair in cffi:cffi aiohttp:aiohttp; do
    "$VPY" -c "import ${pair%%:*}" 2>/dev/null && continue
    if ls gpu-wheels/"${pair#*:}"-*.whl > /dev/null 2>&1; then missing+=("${pair#*:}")
    else say "warning: ${pair#*:} is not importable and gpu-wheels/ has no wheel of it"; fi
done
say "installing from gpu-wheels/: ${missing[*]} setuptools>=70.1"
# (setuptools >= 70.1 builds the editable install without the wheel package; a venv starts with an older one)
"$VPY" -m pip install -q --no-index --find-links gpu-wheels "${missing[@]}" "setuptools>=70.1" \
    || { say "wheel install failed"; exit 2; }
"$VPY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || { say "llmd install failed"; exit 2; }
git rev-parse HEAD > "$RESULTS/commit.txt" 2>/dev/null

# -- 1. the gpu tests and the lint (at most 240 + 40 s) -------------------------------------------------------
LLMD_GPU_RESULTS="$RESULTS" timeout 240 "$VPY" -m pytest -q -m gpu -p no:cacheprovider --timeout 120 \
    --junitxml "$RESULTS/pytest.xml" tests/test_cuda_gpu.py > "$RESULTS/pytest.log" 2>&1
rc=$?; say "pytest -m gpu: exit $rc ($(tail -1 "$RESULTS/pytest.log"))"; [ $rc -eq 0 ] || status=1
timeout 40 "$VPY" -m pytest -q -p no:cacheprovider tests/test_cuda_lint.py >> "$RESULTS/pytest.log" 2>&1
rc=$?; say "step lint on fake cuda tensors: exit $rc"; [ $rc -eq 0 ] || status=1

# -- 2. llmd bench --device cuda against transformers on the same GPU (at most 140 s) ---------------------
timeout 140 "$VPY" -m llmd.cli bench --shape qwen2-0.5b --device cuda --dtype bfloat16 --against hf \
    --prompt-len 1000 --gen 64 --concurrency 64 --repeat 2 --shared-prefix 0 --kv-memory 4GiB \
    --max-batch-tokens 2048 --json > "$RESULTS/bench_qwen2-0.5b.json" 2> "$RESULTS/bench.log"
rc=$?; say "llmd bench --device cuda: exit $rc"; [ $rc -eq 0 ] || status=1
if [ $rc -eq 0 ]; then
    "$VPY" - "$RESULTS/bench_qwen2-0.5b.json" <<'PY' | tee -a "$RESULTS/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))
one, hf, many = r["llmd_single"], r.get("hf_single", {}), r["llmd_concurrent"]
print(f"single stream {one['decode_tok_s']:.0f} tok/s (goal >= 1,500), {r.get('ratio_decode_vs_hf', 0):.2f}x "
      f"transformers (goal >= 3x); 1,000-token ttft {1000 * one['ttft_s']:.1f} ms (goal <= 15 ms); "
      f"{many['streams']} streams {many['decode_aggregate_tok_s']:.0f} tok/s (goal >= 20,000)")
PY
fi
say "done: exit $status (results in $RESULTS)"
exit $status
