"""The int4 group size of an export: chosen from the model's widths and measured quality.

A group size must divide every product's input width (the rows of a group share one scale and one
zero point). Of those in ``CANDIDATES`` that do, larger groups store fewer scales and run faster;
smaller ones follow the weights more closely. Every candidate is tried on the calibration windows
in one pass over the layers (llmd.export.stream: the model rounded with it, the perplexity change and
top-1 agreement against the float model); the largest within the budget is taken, and when none is,
the candidate with the smallest perplexity change.
"""
from __future__ import annotations

from llmd.runtime.formats.quantized import QuantizationError

CANDIDATES = (128, 64, 32)


def input_widths(cfg) -> set[int]:
    """Input widths of every product an int4 export rounds (the head's is the hidden size)."""
    cfg = getattr(cfg, "config", cfg)
    return {cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim}


def dividing(*cfgs) -> list[int]:
    """The candidates that divide every input width of these models (configs, or models), largest first."""
    widths = set().union(*(input_widths(c) for c in cfgs))
    fits = [g for g in CANDIDATES if all(w % g == 0 for w in widths)]
    if not fits:
        raise QuantizationError(f"no int4 group size of {CANDIDATES} divides every input width of this model "
                                f"({sorted(widths)}); use --quant int8")
    return fits


def choose_group_size(measured: dict[int, tuple[float, float]], max_ppl_increase: float, min_top1: float) -> int:
    """The largest group size whose (perplexity change in %, top-1 agreement in %) is within the budget;
    when none is, the one with the smallest perplexity change."""
    for g in sorted(measured, reverse=True):
        if measured[g][0] <= max_ppl_increase and measured[g][1] >= min_top1:
            return g
    return min(measured, key=lambda g: measured[g][0])
