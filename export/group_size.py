"""The int4 group size of an export: chosen from the model's widths and measured quality.

A group size must divide every product's input width (the rows of a group share one scale and one
zero point). Of those in ``CANDIDATES`` that do, larger groups store fewer scales and run faster;
smaller ones follow the weights more closely. Each candidate is tried on the calibration windows
(the model rounded with it, the perplexity change and top-1 agreement against the float model),
largest first, and the first within ``budget`` is taken; when none is, the candidate with the
smallest perplexity change is.
"""
from __future__ import annotations

import copy
from dataclasses import replace

from llmd.runtime.formats.quantized import QuantizationError, quantize_model

from . import quality

CANDIDATES = (128, 64, 32)


def input_widths(model) -> set[int]:
    """Input widths of every product an int4 export rounds (the head's is the hidden size)."""
    cfg = model.config
    return {cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim}


def dividing(model) -> list[int]:
    widths = input_widths(model)
    fits = [g for g in CANDIDATES if all(w % g == 0 for w in widths)]
    if not fits:
        raise QuantizationError(f"no int4 group size of {CANDIDATES} divides every input width of this model "
                                f"({sorted(widths)}); use --quant int8")
    return fits


def choose_group_size(model, spec, windows, reference, max_ppl_increase: float, min_top1: float,
                      prepare=None, progress=None) -> tuple[int, dict[int, tuple[float, float]]]:
    """-> (group size, {candidate: (perplexity change in %, top-1 agreement in %)} of those measured).
    ``model`` is the float model (not changed); ``reference`` its predictions on ``windows``;
    ``prepare(model, group_size)`` changes a copy's float weights before rounding (the scale search)."""
    fits = dividing(model)
    if len(fits) == 1:
        return fits[0], {}
    measured = {}
    for g in fits:
        trial = copy.deepcopy(model)
        if prepare is not None:
            prepare(trial, g)
        quantize_model(trial, replace(spec, group_size=g))
        q = quality.compare(reference, quality.predict(trial, windows), None, "", "")
        measured[g] = (100 * q.ppl_increase, 100 * q.top1_agreement)
        if progress is not None:
            progress.advance()
        if measured[g][0] <= max_ppl_increase and measured[g][1] >= min_top1:
            return g, measured
    return min(measured, key=lambda g: measured[g][0]), measured
