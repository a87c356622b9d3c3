"""ModelConfig: the architecture facts llmd needs, read from a Hugging Face config.json and checked."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from ..errors import ModelLoadError
from . import registry
from .plan import LayerPlan

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


MAX_POSITIONS = 1 << 21       # context positions a model may declare (its rotary tables hold each one)
MAX_HEAD_DIM = 1024


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str             # the registered name (llmd.runtime.models.registry)
    family: str                   # its model_type
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    attention_bias: bool          # q, k, v projections carry a bias (Qwen2 always)
    qk_norm: bool                 # per-head RMSNorm on q and k before rope (Qwen3)
    mlp_bias: bool
    torch_dtype: str
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    o_proj_bias: bool = False     # Llama and Qwen3 with attention_bias bias o_proj too (Qwen2 never does)
    plan: LayerPlan = LayerPlan()  # what each layer computes (llmd.runtime.models.plan)

    @property
    def window_cap(self) -> Optional[int]:
        """The context where some layer's window starts to slide, or None: attention that computes
        every layer in full (a backend without per-layer windows) stays exact up to it."""
        windows = [w for w in self.plan.windows(self.num_layers) if w is not None]
        cap = min(windows, default=None)
        return cap if cap is not None and cap < self.max_position_embeddings else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        layer = attn + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * layer + h

    def flops_per_token(self) -> int:
        """Matmul FLOPs for one token (2 per multiply-add), excluding attention over the context."""
        h, i = self.hidden_size, self.intermediate_size
        layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i
        return 2 * (self.num_layers * layer + h * self.vocab_size)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        file = path / "config.json"
        if not path.is_dir():
            raise ModelLoadError(f"{path}: model directory not found")
        if not file.is_file():
            raise ModelLoadError(f"{file}: missing; a model directory needs config.json")
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{file}: expected a JSON object")
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        def fail(msg: str):
            raise ModelLoadError(f"{source}: {msg}")

        arch = registry.find(raw)
        if arch is None:
            fail(f"unsupported architecture {raw.get('architectures') or raw.get('model_type')!r}; "
                 f"llmd supports {registry.supported()}")

        def get_int(key: str, default=None, minimum: int = 1) -> int:
            v = raw.get(key, default)
            if v is None:
                fail(f"missing '{key}'")
            if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
                fail(f"'{key}' must be an integer >= {minimum}, got {v!r}")
            return v

        def get_float(key: str, default) -> float:
            v = raw.get(key, default)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                fail(f"'{key}' must be a positive number, got {v!r}")
            return float(v)

        def get_bool(key: str, default: bool) -> bool:
            v = raw.get(key, default)
            if not isinstance(v, bool):
                fail(f"'{key}' must be true or false, got {v!r}")
            return v

        hidden = get_int("hidden_size")
        heads = get_int("num_attention_heads")
        kv_heads = get_int("num_key_value_heads", heads)
        head_dim = raw.get("head_dim") or None
        if head_dim is None:
            if hidden % heads:
                fail(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
            head_dim = hidden // heads
        elif not isinstance(head_dim, int) or head_dim < 1:
            fail(f"'head_dim' must be a positive integer, got {head_dim!r}")
        if heads % kv_heads:
            fail(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        if head_dim % 2:
            fail(f"head_dim {head_dim} must be even for rotary embeddings")
        if head_dim > MAX_HEAD_DIM:
            fail(f"head_dim {head_dim} is larger than llmd takes ({MAX_HEAD_DIM})")
        max_pos = get_int("max_position_embeddings", 2048)
        if max_pos > MAX_POSITIONS:         # the rotary tables are built for every position
            fail(f"max_position_embeddings {max_pos} is more than llmd takes ({MAX_POSITIONS})")
        try:
            plan = arch.layer_plan(raw, get_bool("attention_bias", False))
            plan = plan.with_(activation=activation(raw, plan), **_mlp_bias(plan, get_bool("mlp_bias", False)))
        except ValueError as e:
            fail(str(e))
        window = plan.sliding_window
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            fail(f"'sliding_window' must be a positive integer, got {window!r}")
        if plan.sliding_layers is not None and len(plan.sliding_layers) != get_int("num_hidden_layers"):
            fail("the layer types do not name every layer")

        rope_theta, scaling = _rope(raw, fail)

        def token_ids(key: str) -> tuple[int, ...]:
            v = raw.get(key)
            ids = v if isinstance(v, list) else ([] if v is None else [v])
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                fail(f"'{key}' must be a token id or a list of them, got {v!r}")
            return tuple(ids)

        if raw.get("quantization_config"):
            fail("this checkpoint is already quantized (quantization_config); llmd loads float32, bfloat16 or "
                 "float16 weights and quantizes them itself with `llmd export --quant ...`")
        eos_ids = token_ids("eos_token_id")
        bos_ids = token_ids("bos_token_id")
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return cls(
            architecture=arch.name, family=arch.model_type,
            vocab_size=get_int("vocab_size"), hidden_size=hidden,
            intermediate_size=get_int("intermediate_size"), num_layers=get_int("num_hidden_layers"),
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, max_position_embeddings=max_pos,
            rms_norm_eps=get_float("rms_norm_eps", 1e-6), rope_theta=rope_theta, rope_scaling=scaling,
            tie_word_embeddings=get_bool("tie_word_embeddings", False),
            attention_bias=plan.bias("self_attn.qkv_proj"), qk_norm=plan.qk_norm,
            mlp_bias=plan.bias("mlp.down_proj"),
            torch_dtype=str(dtype), bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=eos_ids,
            o_proj_bias=plan.bias("self_attn.o_proj"), plan=plan,
        )


ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def activation(raw: dict, plan: LayerPlan) -> str:
    """The MLP's activation: config.json's ``hidden_activation`` (Gemma), else ``hidden_act``, else
    the plan's."""
    name = raw.get("hidden_activation") or raw.get("hidden_act") or None
    if name is None:
        return plan.activation
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def _mlp_bias(plan: LayerPlan, bias: bool) -> dict:
    """config.json's ``mlp_bias`` on the plan's gate/up and down products."""
    if not bias:
        return {}
    return {"products": tuple(replace(p, bias=True) if p.module.startswith("mlp.") else p for p in plan.products)}


def _rope(raw: dict, fail) -> tuple[float, RopeScaling]:
    # Newer configs keep everything in rope_parameters; older ones use rope_theta + rope_scaling.
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        fail("rope_parameters / rope_scaling must be objects")
    # per layer kind (Gemma 3): the full layers' rotary here; the plan reads the sliding layers' base
    params, scaling = params.get("full_attention", params), scaling.get("full_attention", scaling)
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        fail("rope_parameters' full_attention must be an object")
    merged = {**scaling, **params}
    def positive(name: str, v) -> float:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            fail(f"{name} must be a finite positive number, got {v!r}")
        return v

    theta = positive("rope_theta", merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        fail(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    fields = {k: positive(f"rope scaling's {k}", merged[k])
              for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings") if k in merged}
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                "original_max_position_embeddings")}.get(rope_type, ())
    missing = [k for k in needed if k not in fields]
    if missing:
        fail(f"{rope_type} rope scaling needs {', '.join(missing)}")
    partial = raw.get("partial_rotary_factor", merged.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        fail(f"partial_rotary_factor {partial!r} is not supported (rotary over the whole head only)")
    scaling = RopeScaling(rope_type=rope_type, **fields)
    if rope_type == "llama3" and not scaling.high_freq_factor > scaling.low_freq_factor:
        fail(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {scaling.high_freq_factor} "
             f"and {scaling.low_freq_factor}")
    return float(theta), scaling
