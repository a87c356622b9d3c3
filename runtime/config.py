"""Engine configuration: frozen dataclasses, validated when built."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from .errors import InvalidRequest

# KV cache storage: the model's dtype (auto); bfloat16 (half a float32 model's KV bytes: a step that
# reads many streams' keys and values is bound by memory, and twice the tokens fit the budget); int8
# with a scale per block and kv head (llmd.export.quantize)
KV_DTYPES = ("auto", "bfloat16", "int8")
# Where the model runs: auto lets the weights decide (a Hugging Face directory, a torch or AOT engine:
# the CPU; an ONNX Runtime engine: its CUDA provider when onnxruntime-gpu is installed, else the CPU;
# a TensorRT engine: the GPU); cpu and cuda insist, and a model that cannot run there is refused.
DEVICES = ("auto", "cpu", "cuda")
# How a step runs (llmd.runtime.execution): auto picks cpu (llmd's kernels and the fused step), or an
# engine directory's compiled step; reference runs plain torch, the yardstick the others are held to.
EXECUTIONS = ("auto", "cpu", "reference")

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_bytes(value: str | int) -> int:
    """'1GiB', '512MiB', '300MB', 1048576 -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise InvalidRequest(f"cannot read a memory size from {value!r}; write e.g. 512MiB or 2GiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise InvalidRequest(f"memory size must be positive, got {value!r}")
    return n


DRAFT_K, NGRAM_K = 4, 8         # default most proposals per step, by proposer


@dataclass(frozen=True)
class EngineConfig:
    model: str                               # Hugging Face model directory or llmd engine directory
    dtype: str = "float32"                   # float32 | bfloat16
    kv_memory: str | int = "512MiB"          # budget for the paged KV pool (target and draft together)
    block_size: int = 16                     # tokens per KV block
    max_batch_tokens: int = 512              # per-step token budget shared by decodes and prompt chunks
    max_num_seqs: int = 64                   # running requests at most
    max_model_len: Optional[int] = None      # defaults to the model's context window
    max_queue: int = 1024                    # waiting requests at most; more raise CapacityError
    enable_prefix_cache: bool = True
    kv_dtype: str = "auto"                   # one of KV_DTYPES
    attention: str = "fast"                  # fast | reference
    threads: Optional[int] = None            # torch intra-op threads; None keeps torch's default
    device: str = "auto"                     # one of DEVICES
    execution: str = field(default="auto", metadata={
        "help": "how a step runs: auto (llmd's CPU kernels and fused step, or an engine directory's compiled "
                "step), cpu, or reference (plain torch: slow, the yardstick for checking the others)",
        "choices": EXECUTIONS})
    # None: an engine directory's own draft, if it has one; "auto": that, else n-gram lookup for greedy
    # requests only (their output cannot change; sampled ones keep their seeds' texts); "ngram" (every
    # request); "none"; or the path of a draft model directory. A sampled request with its own seed never
    # speculates (spec/controller.py: may_speculate)
    draft: Optional[str] = None
    num_speculative_tokens: Optional[int] = None  # maximum k; None: NGRAM_K for n-gram, DRAFT_K for a draft
                                                   # model (the engine resolves it once it knows which)
    adaptive_speculation: bool = True
    ngram_n: int = 3                         # n-gram match length for prompt lookup
    seed: int = 0                            # seeds requests that set no seed

    def __post_init__(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise InvalidRequest(msg)
        check(self.dtype in ("float32", "bfloat16"), f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), f"block_size must be a power of two up to 128, got {self.block_size}")
        check(1 <= self.max_batch_tokens <= 1 << 16, f"max_batch_tokens must be in [1, 65536], got {self.max_batch_tokens}")
        check(1 <= self.max_num_seqs <= 4096, f"max_num_seqs must be in [1, 4096], got {self.max_num_seqs}")
        check(1 <= self.max_queue <= 1 << 20, "max_queue must be positive")
        check(self.kv_dtype in KV_DTYPES, f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        check(self.device in DEVICES, f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        check(self.execution in EXECUTIONS, f"execution must be one of {', '.join(EXECUTIONS)}, got {self.execution!r}")
        check(self.attention in ("fast", "reference"), f"attention must be fast or reference, got {self.attention!r}")
        check(self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= 16,
              "num_speculative_tokens must be in [0, 16]")
        check(1 <= self.ngram_n <= 16, "ngram_n must be in [1, 16]")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be positive")
        parse_bytes(self.kv_memory)

    @property
    def kv_memory_bytes(self) -> int:
        return parse_bytes(self.kv_memory)
