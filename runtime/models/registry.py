"""The architectures llmd runs, registered under the names a Hugging Face config.json gives them.

An architecture is one file in ``architectures/`` that calls ``register``: its ``architectures``
name (``Qwen2ForCausalLM``), its ``model_type`` (``qwen2``), the module that computes it, and its
layer plan (llmd.runtime.models.plan) from config.json: products and checkpoint map, norms,
activation, rotary and attention options; and, where GGUF files hold it, its GGUF family
(llmd.runtime.models.gguf_family): names, metadata keys and stored forms. The Llama family may give ``Traits`` instead, the
shorthand for a Llama plan. The files are imported on the first lookup, so adding an architecture
is a file and its tests.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable, Optional, Union

from torch import nn

from .gguf_family import GGUFFamily
from .plan import LayerPlan, split_products


@dataclass(frozen=True)
class Traits:
    """What a family decides for itself, from config.json's ``attention_bias`` and the rest."""
    qkv_bias: bool                          # q, k, v projections carry a bias
    o_proj_bias: bool = False
    qk_norm: bool = False                   # per-head RMSNorm on q and k before rotary
    sliding_window: Optional[int] = None    # every layer attends this many positions back, or None

    def plan(self) -> LayerPlan:
        return LayerPlan(products=split_products(self.qkv_bias, self.o_proj_bias), qk_norm=self.qk_norm,
                         sliding_window=self.sliding_window)


@dataclass(frozen=True)
class Architecture:
    name: str                                       # config.json "architectures" entry
    model_type: str                                 # config.json "model_type"
    model_class: type[nn.Module]                    # built from a ModelConfig; has ``empty(cfg, dtype)``
    plan: Callable[[dict, bool], Union[LayerPlan, Traits]]   # (config.json, its attention_bias) -> plan
    gguf: Optional[GGUFFamily] = None               # how GGUF files store it; None: not read from GGUF

    @property
    def traits(self):
        return self.plan

    def layer_plan(self, raw: dict, attention_bias: bool) -> LayerPlan:
        """This architecture's plan for config.json ``raw`` (ValueError where it names what llmd lacks)."""
        plan = self.plan(raw, attention_bias)
        return plan.plan() if isinstance(plan, Traits) else plan


_BY_NAME: dict[str, Architecture] = {}
_BY_TYPE: dict[str, Architecture] = {}
_discovered = False


def register(arch: Architecture) -> Architecture:
    if _BY_NAME.get(arch.name, arch) != arch or _BY_TYPE.get(arch.model_type, arch) != arch:
        raise ValueError(f"architecture {arch.name!r} / model_type {arch.model_type!r} is already registered")
    _BY_NAME[arch.name] = _BY_TYPE[arch.model_type] = arch
    return arch


def _discover() -> None:
    """Import every file of ``architectures/`` once: each registers itself."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = importlib.import_module(f"{__package__}.architectures")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


def find(raw: dict) -> Optional[Architecture]:
    """The architecture config.json names: its first registered ``architectures`` entry; its
    ``model_type`` only when it lists none (a listed head llmd lacks, a classifier say, is refused);
    None when llmd runs neither."""
    _discover()
    names = raw.get("architectures")
    if names:
        names = names if isinstance(names, list) else [names]
        return next((_BY_NAME[n] for n in names if isinstance(n, str) and n in _BY_NAME), None)
    model_type = raw.get("model_type")
    return _BY_TYPE.get(model_type) if isinstance(model_type, str) else None


def get(name: str) -> Architecture:
    """A registered architecture by its ``architectures`` name (ModelConfig.architecture)."""
    _discover()
    return _BY_NAME[name]


def by_gguf() -> dict[str, Architecture]:
    """The architectures GGUF files may hold, by their ``general.architecture`` name."""
    _discover()
    return {a.gguf.name: a for a in _BY_NAME.values() if a.gguf is not None}


def supported() -> list[str]:
    _discover()
    return sorted(_BY_NAME)
