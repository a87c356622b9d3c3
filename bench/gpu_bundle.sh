#!/usr/bin/env bash
# The folder to copy to a GPU machine that has no network (`make gpu-bundle`):
#
#   bench/gpu_bundle.sh OUT_DIR         (PIP=... the pip to download with; default: pip)
#
# OUT_DIR gets this tree (the files git tracks or would track: the working tree as it is), BUNDLE_COMMIT
# (the commit, and how many files differ from it), and gpu-wheels/ with bench/gpu_wheels.txt's wheels for
# CPython 3.12 on manylinux x86_64, each downloaded without its dependencies (the list names them). It is
# checked at <= 60 MiB (GPU_BUNDLE_LIMIT_MIB), which one device run carries; over that it exits 1.
# On the GPU machine, in the copy: bench/gpu_check.sh RESULTS_DIR.
set -euo pipefail
OUT=${1:?usage: bench/gpu_bundle.sh OUT_DIR}
PIP=${PIP:-pip}
LIMIT_MIB=${GPU_BUNDLE_LIMIT_MIB:-60}
cd "$(dirname "$0")/.."
rm -rf "$OUT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
inside=${OUT#"$PWD"/}                  # OUT's path in the tree, when it is inside it (never copied into itself)

# -- the tree ---------------------------------------------------------------------------------------------------
git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do
        [ -f "$f" ] && [ "${f#"$inside"/}" = "$f" ] && printf '%s\0' "$f"
      done \
    | tar --null -T - -cf - | tar -C "$OUT" -xf -
echo "$(git rev-parse HEAD) ($(git status --porcelain | wc -l) files differ)" > "$OUT/BUNDLE_COMMIT"

# -- the wheels: all in one call, else one by one (a wheel that cannot be had is reported, the rest still come) --
mapfile -t wheels < <(grep -v '^#' bench/gpu_wheels.txt | awk 'NF { print $2 }')
download() {
    "$PIP" download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp --abi cp312 \
        --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform any -d "$OUT/gpu-wheels" "$@"
}
failed=()
if ! download "${wheels[@]}"; then
    for w in "${wheels[@]}"; do download "$w" || failed+=("$w"); done
fi
[ ${#failed[@]} -eq 0 ] || echo "gpu_bundle: no cp312 manylinux wheel of: ${failed[*]}" >&2

# -- the size ---------------------------------------------------------------------------------------------------
bytes=$(du -sb "$OUT" | cut -f1)
wheel_bytes=$(du -sb "$OUT/gpu-wheels" | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "gpu_bundle: $OUT: $(mib "$bytes") MiB ($(mib "$wheel_bytes") MiB of $(ls "$OUT/gpu-wheels" | wc -l) wheels; limit $LIMIT_MIB MiB)"
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "gpu_bundle: over $LIMIT_MIB MiB: one device run carries 64 MiB; leave out what the GPU check does not read" >&2
    exit 1
fi
[ ${#failed[@]} -eq 0 ]
