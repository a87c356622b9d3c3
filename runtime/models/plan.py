"""The layer plan: what an architecture's decoder computes, declared once by its file in
``architectures/`` and read by the loader, the model, the fused step, quantization and the exports.

A plan names llmd's four products per layer (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) and, for each, the checkpoint tensors whose rows it stacks; the norms (their kind and
where they sit); the activation; rotary bases (one for every layer, or a local one for sliding
layers); and the attention options (scale, logit soft-capping, q/k norms, a window per layer).

``plain()`` says whether a plan is the Llama family's (what the fused step, the kernel rotary and the
GGUF writers take as is); anything else runs the torch path of ``planned.PlannedForCausalLM``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

NORM_KINDS = ("rms", "rms_one_plus")          # weight w applied as w, or as (1 + w) (Gemma)
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor group feeding a product: ``module`` (under a layer, without ``.weight``)
    and the rows it gives, by symbol: "q", "kv", "i" (intermediate), "h" (hidden), or a sum of them
    written with "+" ("q+kv+kv" for a fused qkv_proj)."""
    module: str
    rows: str


@dataclass(frozen=True)
class Product:
    """One of llmd's products per layer: its module (under a layer), its input width by symbol, and
    the checkpoint sources whose rows it stacks, in order."""
    module: str
    inputs: str
    sources: tuple[Source, ...]
    bias: bool = False


def split_products(qkv_bias: bool = False, o_bias: bool = False, mlp_bias: bool = False) -> tuple[Product, ...]:
    """The Llama layout: q, k, v and gate, up stored apart."""
    return (Product("self_attn.qkv_proj", "h", (Source("self_attn.q_proj", "q"), Source("self_attn.k_proj", "kv"),
                                                Source("self_attn.v_proj", "kv")), qkv_bias),
            Product("self_attn.o_proj", "q", (Source("self_attn.o_proj", "h"),), o_bias),
            Product("mlp.gate_up_proj", "h", (Source("mlp.gate_proj", "i"), Source("mlp.up_proj", "i")), mlp_bias),
            Product("mlp.down_proj", "i", (Source("mlp.down_proj", "h"),), mlp_bias))


def fused_products() -> tuple[Product, ...]:
    """q, k, v in one checkpoint tensor (``qkv_proj``) and gate, up in another (``gate_up_proj``)."""
    return (Product("self_attn.qkv_proj", "h", (Source("self_attn.qkv_proj", "q+kv+kv"),)),
            Product("self_attn.o_proj", "q", (Source("self_attn.o_proj", "h"),)),
            Product("mlp.gate_up_proj", "h", (Source("mlp.gate_up_proj", "i+i"),)),
            Product("mlp.down_proj", "i", (Source("mlp.down_proj", "h"),)))


@dataclass(frozen=True)
class LayerPlan:
    products: tuple[Product, ...] = field(default_factory=split_products)
    norm_kind: str = "rms"
    sandwich: bool = False                   # norms after attention and after the MLP too (Gemma 2, 3)
    activation: str = "silu"
    qk_norm: bool = False                    # per-head norm on q and k before rotary
    rope_local_theta: Optional[float] = None  # sliding layers' rotary base (else the model's one)
    attention_scale: Optional[float] = None  # scores' scale; None: head_dim ** -0.5
    attn_softcap: Optional[float] = None     # scores become cap * tanh(scores / cap)
    final_softcap: Optional[float] = None    # logits likewise
    embed_scale: bool = False                # embeddings times sqrt(hidden), rounded to their dtype
    sliding_window: Optional[int] = None     # the window of sliding layers
    sliding_layers: Optional[tuple[bool, ...]] = None   # which layers slide; None: all of them (if a window)

    def __post_init__(self):
        if self.norm_kind not in NORM_KINDS:
            raise ValueError(f"norm kind {self.norm_kind!r} is not one of {NORM_KINDS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")

    def plain(self) -> bool:
        """The Llama family's plan: nothing the fused step and the kernel rotary do not compute."""
        return (self.norm_kind == "rms" and not self.sandwich and self.activation == "silu"
                and self.rope_local_theta is None and self.attention_scale is None and self.attn_softcap is None
                and self.final_softcap is None and not self.embed_scale)

    def features(self) -> list[str]:
        """What this plan has beyond the Llama family's (for the log, when a fast path steps aside)."""
        named = {"norms (1 + w)": self.norm_kind != "rms", "sandwich norms": self.sandwich,
                 f"{self.activation} activation": self.activation != "silu",
                 "local rotary base": self.rope_local_theta is not None,
                 "attention scale": self.attention_scale is not None,
                 "attention soft-capping": self.attn_softcap is not None,
                 "final soft-capping": self.final_softcap is not None, "embedding scale": self.embed_scale}
        return [k for k, on in named.items() if on]

    def product(self, module: str) -> Product:
        return next(p for p in self.products if p.module == module)

    def bias(self, module: str) -> bool:
        return self.product(module).bias

    def layer_norms(self) -> tuple[str, ...]:
        """A layer's norm modules, as checkpoints name them."""
        if self.sandwich:
            return ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")
        return ("input_layernorm", "post_attention_layernorm")

    def norm_before(self) -> tuple[tuple[str, str], ...]:
        """(norm, product) pairs where the norm's output is the product's input (column equalization)."""
        mlp_norm = "pre_feedforward_layernorm" if self.sandwich else "post_attention_layernorm"
        return (("input_layernorm", "self_attn.qkv_proj"), (mlp_norm, "mlp.gate_up_proj"))

    def slides(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return True if self.sliding_layers is None else self.sliding_layers[layer]

    def windows(self, layers: int) -> tuple[Optional[int], ...]:
        """Each layer's window: the positions a query sees, itself and those before it (None: all)."""
        return tuple(self.sliding_window if self.slides(i) else None for i in range(layers))

    def with_(self, **changes) -> "LayerPlan":
        return replace(self, **changes)


def rows_of(symbols: str, sizes: dict[str, int]) -> int:
    """Rows of a source from its symbols ("q+kv+kv") and the model's sizes."""
    return sum(sizes[s] for s in symbols.split("+"))


def layer_kinds(raw: dict, layers: int, every: Optional[int] = None) -> Optional[tuple[bool, ...]]:
    """Which layers slide: config.json's ``layer_types`` ("sliding_attention" / "full_attention"), else
    every ``every``-th layer is full (1-based), the rest slide; None when neither is known."""
    types = raw.get("layer_types")
    if types is not None:
        if not (isinstance(types, list) and len(types) == layers
                and all(t in ("sliding_attention", "full_attention") for t in types)):
            raise ValueError(f"'layer_types' must list 'sliding_attention' or 'full_attention' for each of the "
                             f"{layers} layers")
        return tuple(t == "sliding_attention" for t in types)
    if every is not None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"the sliding window pattern must be a positive integer, got {every!r}")
        return tuple((i + 1) % every != 0 for i in range(layers))
    return None


def number(raw: dict, key: str, default: Optional[float]) -> Optional[float]:
    """config.json's ``key`` as a finite positive number; None where it is null (or absent, default None)."""
    v = raw.get(key, default)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"'{key}' must be a positive number or null, got {v!r}")
    return float(v)
