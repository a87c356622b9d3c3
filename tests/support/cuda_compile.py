"""Compile the CUDA backend's Triton kernels for an H200 (sm_90) without a GPU: Triton's front end and
ptxas run on the CPU, so type errors and unsupported constructs, which the interpreter lets through,
fail here. Run as a script without TRITON_INTERPRET (tests/cuda/test_cuda_compile.py does)."""
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmd.runtime.execution.cuda import kernels as K
from llmd.runtime.execution.cuda.ops import BLOCK_SIZE, decode_splits, query_tile

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, types: dict, consts: dict) -> None:
    sig = {n: types.get(n, "i32") for n in fn.arg_names}
    sig.update({c: "constexpr" for c in consts})
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET)


def attention_variants():
    """(dtype, consts) for the launches ops.paged_attention makes for Qwen2-0.5B (14/2 heads of 64):
    decode with and without key splits, verification rows, prompt chunks, bfloat16 and float32 pools."""
    heads, kv_heads, d = 14, 2, 64
    group = heads // kv_heads
    gpad = triton.next_power_of_2(group)
    for dtype in ("bf16", "fp32"):
        for max_q, seqs in ((1, 1), (1, 64), (5, 8), (512, 1)):
            splits = decode_splits(seqs, kv_heads, 64) if max_q <= 5 else 1
            yield dtype, dict(GROUP=group, GROUP_PAD=gpad, HEAD_DIM=d, HEAD_PAD=d, BLOCK_Q=query_tile(max_q, gpad),
                              BLOCK_SIZE=BLOCK_SIZE, NUM_SPLITS=splits, DOT_F32=dtype == "fp32")


def main() -> int:
    n = 0
    for dtype, consts in attention_variants():
        ptrs = {p: f"*{dtype}" for p in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
        compile_kernel(K.paged_attention_kernel, {**ptrs, "part_ptr": "*fp32", "stats_ptr": "*fp32", "scale": "fp32",
                                                  "query_start_ptr": "*i64", "seq_lens_ptr": "*i64",
                                                  "block_table_ptr": "*i64"}, consts)
        n += 1
    compile_kernel(K.combine_splits_kernel, {"part_ptr": "*fp32", "stats_ptr": "*fp32", "out_ptr": "*bf16",
                                             "query_start_ptr": "*i64"}, dict(HEAD_DIM=64, HEAD_PAD=64, NUM_SPLITS=8))
    compile_kernel(K.store_kv_kernel, {p: "*bf16" for p in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
                   | {"slot_ptr": "*i64"}, dict(ROW=128, ROW_PAD=128))
    print(f"compiled {n + 2} kernels for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
