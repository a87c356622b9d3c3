"""The sampling knobs an HTTP front passes on as they are (temperature, the filters, the penalties),
as llmd.sampling_fields declares them: each front's body gets one optional field per knob, in the
front's spelling and with llmd's bounds, and ``knobs`` reads them back under llmd's names.

A parameter declared with a front in its ``fronts`` is taken by that front with no change here.
Pure Python: no torch, no aiohttp.
"""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, create_model

from llmd.protocol import sampling_type
from llmd.sampling_fields import PARAMS, PENALTY, Param, Spelling, for_front


def _taken(front: str, penalties: bool) -> tuple[tuple[Param, Spelling], ...]:
    return tuple((p, s) for p, s in for_front(front) if penalties or p.stage != PENALTY)


def knob_model(name: str, front: str, base: type[BaseModel], penalties: bool = True) -> type[BaseModel]:
    """``base`` with an optional field for each knob ``front`` takes (without the penalties: those
    of a body that cannot say their window)."""
    fields = {s.name: (Optional[sampling_type(p, s.high)], None) for p, s in _taken(front, penalties)}
    return create_model(name, __base__=base, __module__=base.__module__, **fields)


def knobs(body: BaseModel, front: str, penalties: bool = True) -> dict:
    """llmd's sampling map for the knobs ``body`` sets; a value past the parameter's bound that the
    front allows (``Spelling.high``) becomes the bound."""
    out = {}
    for p, s in _taken(front, penalties):
        value = getattr(body, s.name)
        if value is not None:
            out[p.name] = type(value)(p.high) if s.high is not None and value > p.high else value
    return out


def chained(sampling: dict, samplers: list[str]) -> dict:
    """``sampling`` without the filters and temperature a llama.cpp ``samplers`` chain leaves out
    (no chain: all of them). Penalties are not governed by the chain in llmd."""
    if not samplers:
        return sampling
    dropped = {p.name for p in PARAMS if p.chain and p.stage != PENALTY and p.chain not in samplers}
    return {k: v for k, v in sampling.items() if k not in dropped}
