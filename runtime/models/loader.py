"""Load and save Llama-family weights in the Hugging Face safetensors layout.

Checkpoint names map onto llmd's fused parameters as the layer plan says (llmd.runtime.models.plan):
q/k/v_proj are row slices of qkv_proj and gate/up_proj of gate_up_proj, or a checkpoint's own fused
tensor is taken whole. Every tensor is checked for presence, shape and dtype before it is copied; a problem
raises ModelLoadError naming the file and the tensor.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import ModelLoadError
from . import registry
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .plan import rows_of

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_layout(cfg: ModelConfig) -> dict[str, tuple[str, int, tuple[int, ...]]]:
    """checkpoint name -> (llmd parameter name, row offset, expected shape), from the layer plan's
    products and norms."""
    plan = cfg.plan
    h, i = cfg.hidden_size, cfg.intermediate_size
    sizes = {"h": h, "q": cfg.q_size, "kv": cfg.kv_size, "i": i}
    out = {"model.embed_tokens.weight": ("embed_tokens.weight", 0, (cfg.vocab_size, h)),
           "model.norm.weight": ("norm.weight", 0, (h,))}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", 0, (cfg.vocab_size, h))
    for n in range(cfg.num_layers):
        src, dst = f"model.layers.{n}.", f"layers.{n}."
        for product in plan.products:
            offset, width = 0, sizes[product.inputs]
            for source in product.sources:
                rows = rows_of(source.rows, sizes)
                out[f"{src}{source.module}.weight"] = (f"{dst}{product.module}.weight", offset, (rows, width))
                if product.bias:
                    out[f"{src}{source.module}.bias"] = (f"{dst}{product.module}.bias", offset, (rows,))
                offset += rows
        if plan.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[f"{src}self_attn.{norm}.weight"] = (f"{dst}self_attn.{norm}.weight", 0, (cfg.head_dim,))
        for norm in plan.layer_norms():
            out[f"{src}{norm}.weight"] = (f"{dst}{norm}.weight", 0, (h,))
    return out


def stored_shift(cfg: ModelConfig, target: str) -> float:
    """What llmd adds to a checkpoint tensor's values: 1 for norms whose checkpoints store w for a
    (1 + w) scale (llmd keeps the scale itself, so every norm computes alike), else 0."""
    return 1.0 if cfg.plan.norm_kind == "rms_one_plus" and target.endswith("norm.weight") else 0.0


LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index}: malformed shard index ({e})") from None
        if not all(isinstance(n, str) and n for n in names):
            raise ModelLoadError(f"{index}: weight_map values must be shard file names")
        files = [path / n for n in names]
        for f in files:
            if not f.is_file() or f.parent != path:
                raise ModelLoadError(f"{index}: names shard {f.name!r}, which is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights found")
    return files


def iter_tensors(files: Iterable[Path]):
    """Yield (file, name, tensor); wraps every safetensors failure into ModelLoadError."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield f, name, st.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors ({e}); the file is truncated or corrupt, "
                                 "re-export or re-download it") from None


def wanted(f: Path, name: str, cfg: ModelConfig, layout: dict) -> bool:
    """Is checkpoint tensor ``name`` one llmd loads? False for what it skips; refuses one it does not know."""
    if name.endswith(IGNORED_SUFFIXES):
        return False
    if name not in layout:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return False   # some tied checkpoints store the head anyway; it equals the embedding
        raise ModelLoadError(f"{f}: unexpected tensor {name!r} for {cfg.architecture} "
                             f"({cfg.num_layers} layers); is config.json from the same model?")
    return True


def checked(f: Path, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``tensor`` once its shape is ``shape``, its dtype a float one llmd loads and its values finite."""
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(f"{f}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies {shape}")
    if tensor.dtype not in LOADABLE_DTYPES:
        raise ModelLoadError(f"{f}: tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}; llmd "
                             "loads float32, bfloat16 and float16 weights (a quantized checkpoint is not one)")
    if not torch.isfinite(tensor).all():
        raise ModelLoadError(f"{f}: tensor {name!r} contains NaN or infinity")
    return tensor


def load_model(path: str | Path, dtype: str = "float32", cfg: ModelConfig | None = None,
               progress=None) -> LlamaForCausalLM:
    """Build the model from a Hugging Face directory. ``progress(n_done, n_total)`` is called per tensor."""
    path = Path(path)
    cfg = cfg or ModelConfig.from_dir(path)
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported; choose one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    layout = checkpoint_layout(cfg)
    files = safetensors_files(path)
    stored = sum(f.stat().st_size for f in files)
    if cfg.num_parameters() * 2 > stored:     # no loadable dtype takes under 2 bytes a weight
        raise ModelLoadError(f"{path}: config.json describes {cfg.num_parameters():,} weights, more than "
                             f"{stored:,} bytes of safetensors can hold; is config.json from this model?")
    model = registry.get(cfg.architecture).model_class.empty(cfg, torch_dtype)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for n, (f, name, tensor) in enumerate(iter_tensors(files)):
        if not wanted(f, name, cfg, layout):
            continue
        target, offset, shape = layout[name]
        if name in seen:
            raise ModelLoadError(f"{f}: tensor {name!r} is also in another safetensors file; remove the "
                                 "stale file (a leftover model.safetensors beside shards?)")
        rows = params[target].data[offset:offset + shape[0]]
        rows.copy_(checked(f, name, tensor, shape))
        if shift := stored_shift(cfg, target):
            rows.add_(shift)
        seen.add(name)
        if progress:
            progress(n + 1, len(layout))
    missing = sorted(set(layout) - seen)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{path}: weights missing from the safetensors files: {', '.join(missing[:3])}{more}")
    model.eval()
    return model


def save_model(model: LlamaForCausalLM, path: str | Path, extra_config: dict | None = None) -> None:
    """Write model.safetensors (checkpoint names, unfused) for a model that has not been prepared."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors = {}
    for name, (target, offset, shape) in checkpoint_layout(model.config).items():
        rows = params[target].detach()[offset:offset + shape[0]].float()
        tensors[name] = (rows - stored_shift(model.config, target)).contiguous().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
