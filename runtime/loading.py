"""Resolve what EngineConfig.model names (a Hugging Face directory) into a ready model, its tokenizer
and the size of the KV pool."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional
from pathlib import Path

import torch

from .config import EngineConfig, float_dtype
from .backends.base import create_backend
from .errors import EngineDirError, ModelLoadError
from .formats.engine_dir import engine_draft_dir, load_engine_draft, load_engine_model
from .formats.manifest import read_manifest
from .execution import backend_class, choose
from .formats.gguf_import import resolve_model_path
from .formats.gguf_check import is_gguf_file
from .formats.gguf_native import load_native
from .formats.head_screen import HeadScreen
from .model_names import resolve_config
from .model_runner import ModelRunner, kv_bytes_per_block
from .models.config import ModelConfig
from .models.llama import LlamaForCausalLM
from .models.loader import load_model
from .runner import Runner
from .tokenizer import Tokenizer, check_vocab

log = logging.getLogger("llmd.loading")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    num_blocks: int
    draft: Optional[LlamaForCausalLM] = None
    draft_config: Optional[ModelConfig] = None
    kv_dtype: str = "auto"
    backend: Optional[object] = None          # a CompiledStep when the engine directory was compiled for one
    execution: str = "cpu"                    # the execution backend the model was prepared for (llmd.runtime.execution)
    device: str = "cpu"                       # where llmd's own model code runs: cpu, or cuda (CudaRunner)

    def context_len(self, wanted: Optional[int]) -> int:
        """The context window served: ``wanted`` (None: the model's), at most the model's. A model with
        sliding windows is capped where its first window starts to slide when it runs on the CUDA runner
        or a compiled step, whose attention computes every layer in full."""
        n = min(wanted or self.config.max_position_embeddings, self.config.max_position_embeddings)
        if self.config.window_cap and (self.device == "cuda" or self.backend is not None):
            n = min(n, self.config.window_cap)
        return n


def native_gguf(model: str | None, dtype: str) -> bool:
    """Is ``model`` a GGUF file (by its magic bytes) to serve from its own blocks (``--dtype auto``)?"""
    return bool(model) and dtype == "auto" and is_gguf_file(model)


def resolve_path(model: str, dtype: str) -> Path:
    """A model directory as given, or for a GGUF file its cached import in ``dtype``'s float type."""
    return Path(resolve_model_path(model, float_dtype(dtype)))


def load_for_engine(config: EngineConfig, progress=None) -> LoadedModel:
    config = resolve_config(config)                      # a model by name: its path (llmd.runtime.model_names)
    if native_gguf(config.model, config.dtype):
        return _load_native(config)
    path = resolve_path(config.model, config.dtype)      # a GGUF file under --dtype float32: its cached import
    if not path.exists():
        raise ModelLoadError(f"{path}: no such model directory; pass a Hugging Face model directory "
                             "(config.json, *.safetensors, tokenizer.json) or an llmd engine directory")
    kv_dtype = config.kv_dtype
    backend = None
    device = "cpu"
    draft_path = (resolve_path(config.draft, config.dtype)
                  if config.draft and config.draft not in ("ngram", "auto", "none") else None)
    if (path / "manifest.json").is_file():
        manifest = read_manifest(path, verify_hashes=False)     # its values are used once load_engine_model verified it
        check_device(path, backend_name(manifest), config.device)
        model, cfg, tokenizer = load_engine_model(path, config, progress=progress)
        if kv_dtype == "auto":
            kv_dtype = (manifest.get("quantization") or {}).get("kv_dtype", "auto")
        backend = engine_backend(path, manifest, config.device)
        if config.draft in (None, "auto") and engine_draft_dir(path) is not None:
            draft_path = path                                   # an engine's own draft speculates by default
    elif (path / "target" / "weights.safetensors").is_file():
        raise EngineDirError(f"{path}: an engine directory without manifest.json: the export did not finish; "
                             "run `llmd export` again")
    else:
        device = hf_device(config)
        model, cfg, tokenizer = load_hf_model(path, float_dtype(config.dtype), progress, own_execution(config, device))
    if device == "cuda" and draft_path is not None and (draft_path / "manifest.json").is_file():
        raise EngineDirError(f"{draft_path}: a draft from an engine directory runs on the CPU only; with "
                             "--device cuda give a Hugging Face directory as --draft, or 'ngram'")
    execution = own_execution(config, device) if backend is None else choose(config.execution, backend)
    if config.dtype == "bfloat16" and device == "cpu" and execution == "cpu" and cpu_bf16() is False:
        log.warning("this CPU has no bfloat16 arithmetic, so --dtype bfloat16 widens every product in torch "
                    "(about half the speed of float32 here); --dtype float32 keeps a bfloat16 checkpoint's "
                    "weights in bfloat16 blocks (the same bytes) with float32 arithmetic, and --kv-dtype "
                    "bfloat16 halves the cache as well")
    # the screen finds the largest raw logit; soft-capped logits (plan.final_softcap) may tie where raw ones do not
    if config.head_screen and backend is None and execution == "cpu" and cfg.plan.final_softcap is None:
        head = model.lm_head if model.lm_head is not None else model._tied_head
        model.head_screen = HeadScreen.build(head, model.norm.weight)
    draft = draft_cfg = None
    if draft_path is not None:
        draft, draft_cfg = load_draft(draft_path, config, tokenizer, own_execution(config, device))
    blocks = kv_blocks([cfg] + ([draft_cfg] if draft_cfg else []), config, kv_dtype)
    return LoadedModel(model, cfg, tokenizer, blocks, draft, draft_cfg, kv_dtype, backend, execution, device)


def _load_native(config: EngineConfig) -> LoadedModel:
    """A GGUF file served from its own blocks on the cpu backend; its draft likewise (a GGUF file),
    or a model directory, 'ngram' or none."""
    if config.device == "cuda":
        raise ModelLoadError(f"{config.model}: a GGUF file is served from its own blocks on the CPU; for --device "
                             "cuda pass --dtype bfloat16 (or float32) to import it, or use --device cpu")
    execution = choose(config.execution)
    if execution != "cpu":
        raise ModelLoadError(f"{config.model}: a GGUF file's own blocks run on the cpu execution backend; pass "
                             f"--execution cpu, or --dtype float32 to import it for {execution}")
    model, cfg, tokenizer = load_native(config.model)
    backend_class(execution).prepare(model)
    draft = draft_cfg = None
    if config.draft and config.draft not in ("ngram", "auto", "none"):
        native = native_gguf(config.draft, config.dtype)             # a GGUF draft from its own blocks too
        path = Path(config.draft) if native else resolve_path(config.draft, config.dtype)
        draft, draft_cfg = load_draft(path, config, tokenizer, execution)
    kv_dtype = config.kv_dtype
    blocks = kv_blocks([cfg] + ([draft_cfg] if draft_cfg else []), config, kv_dtype)
    return LoadedModel(model, cfg, tokenizer, blocks, draft, draft_cfg, kv_dtype, None, execution, "cpu")


def cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> Optional[bool]:
    """Whether this CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX), read from ``cpuinfo``'s
    flags; None where that file cannot be read (not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        return None
    return None


def own_execution(config: EngineConfig, device: str) -> str:
    """What llmd's own model code (a Hugging Face directory, a draft) is prepared for: the CUDA
    runner, which takes the weights as loaded, or the chosen execution backend."""
    return "cuda" if device == "cuda" else choose(config.execution)


def hf_device(config: EngineConfig) -> str:
    """Where a Hugging Face directory runs: the GPU when asked (refused, before any weights load, where
    it cannot run) or, with ``auto``, when torch sees one; else the CPU."""
    if config.device == "cpu":
        return "cpu"
    why = cuda_missing()
    if config.device == "cuda" and why:
        raise ModelLoadError(f"--device cuda: {why}; install torch with CUDA and triton (pip install triton) on a "
                             "machine with an NVIDIA GPU, or use --device cpu")
    if why:
        return "cpu"
    for what, ok in (("--block-size 16", config.block_size == 16), ("--kv-dtype auto or bfloat16", config.kv_dtype != "int8"),
                     ("--attention fast", config.attention == "fast")):
        if not ok:
            if config.device == "cuda":
                raise ModelLoadError(f"--device cuda needs {what}")
            return "cpu"
    return "cuda"


def cuda_missing() -> Optional[str]:
    """None when the CUDA backend can run here, else what is missing."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) is built without CUDA"
        return f"torch (CUDA {torch.version.cuda}) sees no GPU"
    try:
        import triton  # noqa: F401  (the CUDA backend's kernels)
    except ImportError:
        return "triton is not installed"
    return None


def load_draft(path: Path, config: EngineConfig, target_tokenizer: Tokenizer, execution: str = "cpu"):
    """A draft from a model directory, an engine directory's own draft, an engine directory, or a GGUF
    file served from its own blocks (``native_gguf``, on the cpu backend)."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such draft model directory; pass a directory, 'ngram', or no draft")
    if execution == "cpu" and native_gguf(str(path), config.dtype):
        model, cfg, tok = load_native(path, progress=False)
        backend_class(execution).prepare(model)
    elif (path / "manifest.json").is_file():
        model, cfg, tok = load_engine_draft(path, config) if engine_draft_dir(path) else load_engine_model(path, config)
    else:
        model, cfg, tok = load_hf_model(path, float_dtype(config.dtype), execution=execution)
    if tok.vocab_size != target_tokenizer.vocab_size or tok.encode(PROBE) != target_tokenizer.encode(PROBE):
        raise ModelLoadError(f"{path if path.is_file() else path / 'tokenizer.json'}: the draft's tokenizer differs "
                             "from the target's; speculative decoding needs the same tokenizer")
    return model, cfg


PROBE = "def f(x):\n    return {'a': [1, 2.5]}  # héllo 日本 🙂\n"


def backend_name(manifest: dict) -> str:
    name = manifest.get("backend", "torch")
    return "aot" if name == "torch" and (manifest.get("artifacts") or {}).get("aot") else name


def check_device(path: Path, backend: str, device: str) -> None:
    """Refuse, before any weights load, a device an engine directory cannot run on. Torch and AOT engines
    hold layouts for llmd's CPU kernels; a GPU is reached through a Hugging Face directory (the CUDA
    backend) or an engine directory compiled for ONNX Runtime or TensorRT (the backend checks its provider)."""
    if device == "cuda" and backend in ("torch", "aot"):
        raise EngineDirError(f"{path}: llmd runs {'this AOT engine' if backend == 'aot' else 'this engine'} on the CPU "
                             "only; for a GPU, serve the Hugging Face model directory with --device cuda, export an "
                             "engine with `llmd export --backend onnxruntime` (needs llmd[gpu], onnxruntime-gpu) or "
                             "`--backend tensorrt`, or use --device cpu")
    if device == "cpu" and backend == "tensorrt":
        raise EngineDirError(f"{path}: a TensorRT engine runs only on a CUDA GPU; export for the CPU with "
                             "`llmd export --backend torch` or `--backend onnxruntime`")


def engine_backend(path: Path, manifest: dict, device: str = "auto"):
    """The compiled step backend an engine directory asks for, or None for plain torch modules."""
    name = backend_name(manifest)
    if name == "torch":
        return None
    return create_backend(name, path, manifest, device)


def load_hf_model(path: Path, dtype: str, progress=None,
                  execution: str = "cpu") -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer]:
    """The model prepared for the ``execution`` backend, its config and tokenizer. The CUDA runner
    (``cuda``) takes the weights as loaded and moves them itself."""
    cfg = ModelConfig.from_dir(path)
    tokenizer = Tokenizer.from_dir(path)
    check_vocab(path, tokenizer, cfg)
    model = load_model(path, dtype, cfg, progress=progress)
    if execution != "cuda":
        backend_class(execution).prepare(model)
    return model, cfg, tokenizer


def kv_blocks(cfgs: list[ModelConfig], config: EngineConfig, kv_dtype: str = "auto") -> int:
    """Blocks that fit the budget when each block holds KV for every model in ``cfgs``."""
    per_block = sum(kv_bytes_per_block(c, config.block_size, float_dtype(config.dtype), kv_dtype) for c in cfgs)
    num_blocks = config.kv_memory_bytes // per_block
    if num_blocks < 1:
        raise ModelLoadError(f"kv_memory {config.kv_memory} cannot hold one block of {config.block_size} tokens "
                             f"for this model ({per_block} bytes)")
    return num_blocks


def make_runner(loaded: LoadedModel, model, config: EngineConfig, max_model_len: int, num_spec_tokens: int,
                draft: bool = False) -> Runner:
    """The runner for ``model`` (the target, or with ``draft`` its draft) where it was loaded: the CUDA
    runner on the GPU, else a ModelRunner on the execution backend the weights were prepared for."""
    c = config
    if loaded.device == "cuda":
        from .execution.cuda.backend import CudaRunner     # needs triton: imported for the GPU only
        return CudaRunner(model, loaded.num_blocks, c.block_size, float_dtype(c.dtype), loaded.kv_dtype, "cuda",
                          c.max_num_seqs, num_spec_tokens, max_model_len, graphs=None if c.cuda_graphs else "off")
    if draft:
        return ModelRunner(model, loaded.num_blocks, c.block_size, float_dtype(c.dtype), kv_dtype=loaded.kv_dtype,
                           execution=choose(c.execution))
    return ModelRunner(model, loaded.num_blocks, c.block_size, float_dtype(c.dtype),
                       reference_attention=c.attention == "reference", kv_dtype=loaded.kv_dtype,
                       backend=loaded.backend, execution=loaded.execution)
