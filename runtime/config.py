"""Engine configuration: the one place an engine setting is declared.

Each field of ``EngineConfig`` carries its help text (and unit and choices where it has them) in
its metadata. The command-line flags of ``llmd generate``, ``llmd bench`` and ``llmd serve``, the
keys of llmd.toml, the ``LLMD_*`` variables and the keywords of ``LLM(...)`` are all derived from
these fields (llmd.options), so a setting has one name and one default everywhere.
"""
from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional

from .errors import InvalidRequest

KV_DTYPES = ("auto", "bfloat16", "int8")
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


def setting(default=MISSING, *, help: str, unit: str | None = None, choices: tuple | None = None):
    """A settings field: its default and what the flags, files and variables derived from it say."""
    meta = {"help": help}
    if unit:
        meta["unit"] = unit
    if choices:
        meta["choices"] = tuple(choices)
    return field(default=default, metadata=meta)


DRAFT_K, NGRAM_K = 6, 8         # default most proposals per step, by proposer


@dataclass(frozen=True)
class EngineConfig:
    model: str = setting(help="what to serve: a model directory (Hugging Face layout), an engine directory from `llmd export`, a GGUF file, or a model by name (`qwen2.5-coder:1.5b`: llmd's cache, Ollama's store, the Hub's cache; `llmd list`)")
    dtype: str = setting(
        "auto", choices=("auto", "float32", "bfloat16"),
        help="weights: auto serves a GGUF file from its own quantized blocks (mapped, never converted) and "
             "any other model in float32; float32 or bfloat16 converts a GGUF file to that type first")
    kv_memory: str | int = setting(
        "512MiB", unit="bytes",
        help="memory for the paged KV cache, target and draft together, e.g. 256MiB or 2GiB")
    block_size: int = setting(16, unit="tokens", help="tokens per KV cache block",
                              choices=(1, 2, 4, 8, 16, 32, 64, 128))
    max_batch_tokens: int = setting(512, unit="tokens",
                                    help="token budget of one engine step, shared by decodes and prompt chunks")
    batch_prompt_chunk: int = setting(
        64, unit="tokens",
        help="most prompt tokens a batch-priority request computes in one step (an editor's warm-up, batch jobs): "
             "a request arriving meanwhile waits for the step in flight, so background prefill keeps steps short; "
             "0: up to max_batch_tokens")
    batch_quiet_ms: float = setting(
        200.0, unit="ms",
        help="batch-priority prompts (an editor's warm-up, batch jobs) wait this long after the last more "
             "important request, so that they run in the pauses between keystrokes or turns; 0: right after")
    max_num_seqs: int = setting(64, unit="requests", help="requests running at once, at most")
    max_model_len: Optional[int] = setting(None, unit="tokens",
                                           help="longest prompt plus output; unset: the model's context window")
    max_waiting: int = setting(1024, unit="requests",
                               help="requests waiting to start, at most; more are refused as over capacity")
    prefix_cache: bool = setting(True, help="reuse the KV cache of prompt prefixes seen before")
    kv_dtype: str = setting(
        "auto", choices=KV_DTYPES,
        help="KV cache storage: the model dtype (auto, exact), bfloat16 (half a float32 model's bytes: faster with "
             "many streams, twice the tokens per budget) or int8 with a scale per block and head (approximate: a "
             "block's scale grows with what is written to it, so greedy text may vary with batching and speculation)")
    kv_disk: Optional[str] = setting(
        None, unit="directory",
        help="a directory for a tier of the prefix cache on disk (made owner-only): full KV blocks evicted from "
             "memory, and those cached when the engine goes idle, are written there and read back instead of "
             "recomputed, also after a restart; files are checked and keyed by the model, KV dtype and layout; "
             "unset: off")
    kv_disk_size: str | int = setting(
        "8GiB", unit="bytes",
        help="most bytes the kv_disk tier keeps, e.g. 2GiB; the least recently used blocks are deleted first")
    shift_max_stale: int = setting(
        32, unit="tokens",
        help="shifted reuse, for requests that ask for it (the language server's completions): keys and values "
             "of an earlier request's text taken at new positions after an edit before them, when they missed at "
             "most this many changed tokens (approximate: the text after an edit was computed before it); 0: off")
    head_screen: bool = setting(
        True,
        help="greedy rows find their token through a screen of the output head (4-bit for an int8 / int8g head, "
             "8-bit for a float32 or bfloat16 one) and exact scores for the few tokens it cannot rule out: the same "
             "tokens from fewer bytes a step, for a second, smaller copy of the head built at load "
             "(llmd.runtime.formats.head_screen)")
    attention: str = setting("fast", choices=("fast", "reference"),
                             help="attention code: llmd's fast paths, or the plain reference one")
    threads: Optional[int] = setting(None, unit="threads", help="CPU threads for the engine; unset: torch's choice")
    device: str = setting(
        "auto", choices=DEVICES,
        help="where the model runs: auto (llmd's own model code on the CPU; an ONNX Runtime engine on its CUDA "
             "provider when onnxruntime-gpu is installed; a TensorRT engine on the GPU), cpu, or cuda (an engine "
             "exported with --backend onnxruntime and llmd[gpu], or --backend tensorrt); a model that cannot run "
             "where asked is refused")
    cuda_graphs: bool = setting(
        True,
        help="--device cuda: replay decode and verification steps from CUDA graphs captured at load (a capture "
             "that fails is reported and the steps run eagerly); off: every step runs eagerly")
    kernels: Optional[str] = setting(
        None, choices=("auto", "avx512", "avx2", "off"),
        help="llmd's CPU kernels (a C library built once per machine): auto (the AVX-512 library with VNNI where the "
             "CPU runs it, else the AVX2 one), avx512, avx2, or off (torch's ops: much slower); one library a process, "
             "the first engine's; unset: auto")
    amx: Optional[bool] = setting(
        None, help="let the kernels use AMX's tile unit for prompts and large batches where the CPU has it (the "
                   "same numbers for int8 and int4; bfloat16 weights within float32 rounding); off: the vector "
                   "loop for every row count; one choice a process, the first engine's; unset: on")
    kernel_cache: Optional[str] = setting(
        None, unit="directory",
        help="where the CPU kernels are compiled to and kept (made owner-only; a directory others can write is "
             "skipped); unset: $XDG_CACHE_HOME/llmd, else ~/.cache/llmd")
    execution: str = setting(
        "auto", choices=EXECUTIONS,
        help="how a step runs: auto (llmd's CPU kernels and fused step, or an engine directory's compiled step), "
             "cpu, or reference (plain torch: slow, the yardstick the others are held to)")
    draft: Optional[str] = setting(
        "auto",
        help="speculative decoding: a draft model directory (same tokenizer), 'ngram' (prompt lookup for every "
             "request), 'none', or 'auto' (an engine directory's own draft, else prompt lookup for greedy "
             "requests only, whose output it cannot change; a sampled request with its own seed never speculates)")
    num_speculative_tokens: Optional[int] = setting(
        None, unit="tokens",
        help=f"most tokens proposed per step when speculating; unset: {NGRAM_K} for ngram, {DRAFT_K} for a draft model")
    adaptive_speculation: bool = setting(
        True, help="let measured costs and acceptance pick the speculation depth, up to num_speculative_tokens")
    ngram_n: int = setting(3, unit="tokens", help="match length of prompt lookup")
    seed: int = setting(0, help="seed of the requests that set none (sampling is reproducible per seed)")

    def __post_init__(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise InvalidRequest(msg)
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            check(choices is None or value is None or value in choices,
                  f"{f.name} must be one of {', '.join(map(str, choices or ()))}, got {value!r}")
        check(1 <= self.max_batch_tokens <= 1 << 16, f"max_batch_tokens must be in [1, 65536], got {self.max_batch_tokens}")
        check(0 <= self.batch_prompt_chunk <= 1 << 16, f"batch_prompt_chunk must be in [0, 65536], got {self.batch_prompt_chunk}")
        check(isinstance(self.batch_quiet_ms, (int, float)) and 0 <= self.batch_quiet_ms <= 60_000,
              f"batch_quiet_ms must be in [0, 60000], got {self.batch_quiet_ms}")
        check(1 <= self.max_num_seqs <= 4096, f"max_num_seqs must be in [1, 4096], got {self.max_num_seqs}")
        check(1 <= self.max_waiting <= 1 << 20, f"max_waiting must be in [1, 1048576], got {self.max_waiting}")
        check(self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= 16,
              "num_speculative_tokens must be in [0, 16]")
        check(1 <= self.ngram_n <= 16, "ngram_n must be in [1, 16]")
        check(0 <= self.shift_max_stale <= 1 << 16, f"shift_max_stale must be in [0, 65536], got {self.shift_max_stale}")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len must be positive")
        check(self.threads is None or 1 <= self.threads <= 4096, f"threads must be in [1, 4096], got {self.threads}")
        check(0 <= self.seed < 1 << 63, f"seed must be in [0, 2^63), got {self.seed}")
        parse_bytes(self.kv_memory)
        parse_bytes(self.kv_disk_size)
        check(self.kv_disk is None or (isinstance(self.kv_disk, str) and self.kv_disk.strip() != ""),
              "kv_disk must be a directory path")

    @property
    def kv_memory_bytes(self) -> int:
        return parse_bytes(self.kv_memory)


def float_dtype(dtype: str) -> str:
    """The float type of activations and of a float model's weights: ``auto`` computes in float32."""
    return "float32" if dtype == "auto" else dtype
