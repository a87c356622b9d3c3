"""Activation-aware int4: scales searched on calibration text, folded into the float model before
plain group-wise rounding.

int4 rounds every group of input columns to 16 levels, so the error a product makes is the
rounding error of each weight times the size of the input that meets it. Two changes to the float
weights, each leaving the float model's function as it was (or clipping what rounding would clip),
make that error smaller where the inputs are large:

- Column scales. For a product whose input comes from something linear per column (the norm before
  qkv and gate/up; the up half of gate/up before down; the value rows before the output
  projection), input column j of the weight is multiplied by s_j and the producer's column j divided
  by it: the same function in float, and finer steps, relative to its size, for the columns that meet
  large inputs. s = a^alpha with a the mean absolute input per column over the calibration tokens;
  alpha is searched per product (``ALPHAS``) for the smallest output error of the rounded product on
  those tokens; alpha 0 (no change) is among the candidates, so no product gets worse on them.
- Clipping. Each group's range is shrunk by the factor (``CLIPS``) that minimises the group's
  rounding error weighted by the mean square of each input column; weights outside are clamped to the
  shrunk range, which is where rounding with that range puts them anyway.

The module only rewrites float weights; ``quantize_model`` then rounds them as it would any others.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

ALPHAS = tuple(i / 10 for i in range(11))
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
ROWS = 512          # calibration tokens kept per product (evenly spaced over all of them)


OUTPUTS = 512       # output rows a scale's error is measured on (evenly spaced; rows round on their own)


def fake_int4(w: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """w rounded to int4 groups and back as ``quantize_int4`` rounds it, less its float16 storage of
    scales and offsets: the searches' model of rounding, in a few passes over w (not a dozen)."""
    n, k = w.shape
    g = w.reshape(n, k // group_size, group_size)
    if symmetric:
        s = (g.abs().amax(-1, keepdim=True) / 7.5).clamp_(min=1e-12)
        return (g / s).round_().clamp_(-8, 7).mul_(s).view(n, k)
    lo, hi = torch.aminmax(g, dim=-1, keepdim=True)
    s = ((hi - lo) / 15).clamp_(min=1e-12)
    return (g - lo).div_(s).round_().clamp_(0, 15).mul_(s).add_(lo).view(n, k)


def layer_products(layer: nn.Module) -> tuple[nn.Module, ...]:
    """The products of a decoder layer whose scales are searched here."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


@contextmanager
def recording(modules):
    """{module: [inputs seen]} while the block runs: every input each of ``modules`` is called with."""
    seen: dict[nn.Module, list[torch.Tensor]] = {m: [] for m in modules}
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen[mod].append(args[0].reshape(-1, args[0].shape[-1])))
             for m in modules]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def sampled(seen: dict, rows: int = ROWS) -> dict[nn.Module, torch.Tensor]:
    """Each module's inputs, ``rows`` of them evenly spaced over all it saw: [rows, K]."""
    out = {}
    for m, xs in seen.items():
        x = torch.cat(xs).float()
        out[m] = x[torch.linspace(0, len(x) - 1, min(rows, len(x))).long()]
    return out


@torch.no_grad()
def collect_inputs(model: nn.Module, windows: torch.Tensor, rows: int = ROWS) -> dict[nn.Module, torch.Tensor]:
    """The float model's inputs to every product searched here, over the calibration windows: [rows, K]
    per module (the products' own inputs, before any of them is changed)."""
    with recording([m for layer in model.layers for m in layer_products(layer)]) as seen:
        for w in windows.split(4):
            model.forward_dense(w)
    return sampled(seen, rows)


def search_scale(w: torch.Tensor, x: torch.Tensor, group_size: int, symmetric: bool,
                 a: torch.Tensor | None = None, expand=lambda s: s) -> torch.Tensor:
    """Scales for weight w [N, K] meeting inputs x [R, K]: the alpha of ``ALPHAS`` whose rounded
    (w * s) / s gives the outputs closest to x @ w.T, on ``OUTPUTS`` of its rows. By default one scale per column, from the mean
    absolute input a; ``a`` and ``expand`` (scales -> [K]) let columns share a scale."""
    if w.shape[0] > OUTPUTS:
        w = w[torch.linspace(0, w.shape[0] - 1, OUTPUTS).long()]
    reference = x @ w.t()
    a = (x.abs().mean(0) if a is None else a).clamp(min=1e-6)
    best, best_err = torch.ones_like(a), float("inf")
    for alpha in ALPHAS:
        s = a ** alpha
        s = s / (s.max() * s.min()).sqrt()
        cols = expand(s)
        err = (x @ (fake_int4(w * cols, group_size, symmetric) / cols).t() - reference).pow(2).mean().item()
        if err < best_err:
            best, best_err = s, err
    return best


def clip_weights(w: torch.Tensor, x: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """w with each group clamped to the shrink factor of ``CLIPS`` that minimises the group's rounding
    error weighted by the inputs' mean square per column."""
    n, k = w.shape
    g = w.view(n, k // group_size, group_size)
    weight = x.pow(2).mean(0).view(1, k // group_size, group_size)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    if symmetric:
        lo, hi = -g.abs().amax(-1, keepdim=True), g.abs().amax(-1, keepdim=True)
    best_err = torch.full((n, k // group_size, 1), float("inf"))
    best = torch.ones_like(best_err)
    for c in CLIPS:
        # the clamped group's range, known without a pass over it: a bound moves only toward zero
        low, high = torch.maximum(lo, lo * c), torch.minimum(hi, hi * c)
        clamped = g.clamp(low, high)
        if symmetric:
            s = (torch.maximum(low.abs(), high.abs()) / 7.5).clamp_(min=1e-12)
            rounded = (clamped / s).round_().clamp_(-8, 7).mul_(s)
        else:
            s = ((high - low) / 15).clamp_(min=1e-12)
            rounded = clamped.sub_(low).div_(s).round_().clamp_(0, 15).mul_(s).add_(low)
        err = rounded.sub_(g).pow_(2).mul_(weight).sum(-1, keepdim=True)
        better = err < best_err
        best = torch.where(better, c, best)
        best_err = torch.where(better, err, best_err)
    return g.clamp(torch.maximum(lo, lo * best), torch.minimum(hi, hi * best)).reshape(n, k)


@torch.no_grad()
def apply_awq(model: nn.Module, windows: torch.Tensor, group_size: int, symmetric: bool, progress=None) -> None:
    """Search and fold the column scales, then clip, for every decoder product of ``model`` (float,
    before ``quantize_model``), calibrated on ``windows`` [n, T]."""
    inputs = collect_inputs(model, windows)
    for layer in model.layers:
        awq_layer(layer, inputs, group_size, symmetric)
        if progress is not None:
            progress.advance()


@torch.no_grad()
def awq_layer(layer: nn.Module, inputs: dict, group_size: int, symmetric: bool) -> None:
    """``apply_awq`` for one decoder layer, given its products' float inputs (``collect_inputs``,
    or ``sampled`` of a ``recording`` of the layer alone): it changes nothing outside the layer."""
    inputs = {m: inputs[m] for m in layer_products(layer)}
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o, gate_up, down = layer_products(layer)
    # qkv and gate/up: their inputs are RMSNorm outputs, so the norm's weight takes 1/s
    for norm, proj in ((layer.input_layernorm, qkv), (layer.post_attention_layernorm, gate_up)):
        s = search_scale(proj.weight.float(), inputs[proj], group_size, symmetric)
        proj.weight.mul_(s)
        norm.weight.div_(s)
        inputs[proj] = inputs[proj] / s
    # down: its input is silu(gate) * up, linear in up's rows
    inter = down.in_features
    s = search_scale(down.weight.float(), inputs[down], group_size, symmetric)
    down.weight.mul_(s)
    scale_rows(gate_up, slice(inter, 2 * inter), 1 / s)
    inputs[down] = inputs[down] / s
    # o: its input is attention over values, linear in v's rows; heads sharing a kv head share a scale
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    per_kv = inputs[o].abs().mean(0).view(kv_heads, heads // kv_heads, d).mean(1).reshape(-1)

    def spread(s_kv):        # a scale per (kv head, dim) -> one per column of o
        return s_kv.view(kv_heads, 1, d).expand(kv_heads, heads // kv_heads, d).reshape(-1)
    s_kv = search_scale(o.weight.float(), inputs[o], group_size, symmetric, per_kv, spread)
    s = spread(s_kv)
    o.weight.mul_(s)
    v_rows = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
    scale_rows(qkv, v_rows, 1 / s_kv)
    inputs[o] = inputs[o] / s
    for proj in (qkv, o, gate_up, down):
        proj.weight.copy_(clip_weights(proj.weight.float(), inputs[proj], group_size, symmetric))


def scale_rows(proj: nn.Module, rows: slice, factor: torch.Tensor) -> None:
    proj.weight[rows].mul_(factor[:, None])
    if proj.bias is not None:
        proj.bias[rows].mul_(factor)
