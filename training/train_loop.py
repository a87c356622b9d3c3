"""The training loop shared by the demo target, the raw-trained draft and ``llmd distill``.

A run is resumable: every ``checkpoint_every_s`` seconds the model, the AdamW moments and the loop
state are written to ``<ckpt_dir>`` (safetensors + JSON, no pickle), and a later run with the same
arguments continues from there. Batches are a pure function of (seed, step), so a resumed run sees
exactly the batches the uninterrupted one would have.

The learning rate follows a cosine from ``lr`` to ``lr * min_lr_ratio`` over the run's progress, which
is the further along of steps (step / max_steps) and wall time (elapsed / budget_s): a time budget
therefore still ends with an annealed model instead of being cut off at a high learning rate.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from llmd.runtime.errors import ModelLoadError
from llmd.runtime.models.layers import Linear, RMSNorm
from llmd.runtime.models.llama import LlamaForCausalLM

LossFn = Callable[[LlamaForCausalLM, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int = 1000
    budget_s: float = float("inf")
    seed: int = 0
    checkpoint_every_s: float = 180.0

    def __post_init__(self):
        if self.seq_len < 2 or self.batch_size < 1 or self.max_steps < 1 or self.budget_s <= 0:
            raise ValueError(f"invalid training configuration {self}")


def init_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Normal(0, 0.02) weights, output projections scaled by 1/sqrt(2 * layers), unit norms."""
    gen = torch.Generator().manual_seed(seed)
    depth_scale = 1 / math.sqrt(2 * len(model.layers))
    for name, m in model.named_modules():
        if isinstance(m, (Linear, nn.Embedding)):
            std = 0.02 * (depth_scale if name.endswith(("o_proj", "down_proj")) else 1.0)
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
        elif isinstance(m, RMSNorm):
            with torch.no_grad():
                m.weight.fill_(1.0)


PAD = -100      # a padded position in a batch: not a target (cross-entropy's ignore_index), fed as token 0


def next_token_loss(model: LlamaForCausalLM, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1]; PAD positions are skipped."""
    logits = model.forward_dense(batch[:, :-1].clamp(min=0))
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten().long(), ignore_index=PAD)


def documents(tokens: np.ndarray, width: int, end_id: int) -> np.ndarray:
    """[start, stop) of every document in the stream (each ends with ``end_id``), longer ones cut
    into pieces of at most ``width`` tokens."""
    ends = np.flatnonzero(tokens == end_id) + 1
    if len(ends) == 0 or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))
    starts = np.concatenate([[0], ends[:-1]])
    spans = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        spans.extend((s, min(s + width, b)) for s in range(a, b, width))
    return np.array(spans, dtype=np.int64).reshape(-1, 2)


def pack(lengths: np.ndarray, order: np.ndarray, width: int, open_limit: int = 64) -> list[list[int]]:
    """Documents (indices, taken in ``order``) packed whole into windows of ``width`` tokens: each goes
    to the first open window with room, else opens one; past ``open_limit`` the fullest one closes."""
    windows: list[list[int]] = []
    open_ids: list[int] = []
    room: dict[int, int] = {}
    for d in order.tolist():
        n = int(lengths[d])
        w = next((w for w in open_ids if room[w] >= n), None)
        if w is None:
            if len(open_ids) >= open_limit:
                open_ids.remove(min(open_ids, key=room.__getitem__))
            w = len(windows)
            windows.append([])
            open_ids.append(w)
            room[w] = width
        windows[w].append(d)
        room[w] -= n
    return windows


class DocSampler:
    """Batches of whole documents packed into windows of seq_len + 1 tokens, padded with PAD.

    A document (one chunk of a file, plain or rearranged for fill-in-the-middle, ending with the
    end-of-text token) never straddles two windows, so a fill-in-the-middle sample is always seen
    with its prefix and suffix. Each epoch reshuffles and repacks; batch k is fixed by (seed, k)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, end_id: int):
        self.tokens, self.width, self.batch_size, self.seed = tokens, seq_len + 1, batch_size, seed
        self.spans = documents(tokens, self.width, end_id)
        self.lengths = self.spans[:, 1] - self.spans[:, 0]
        self._epochs: dict[int, list[list[int]]] = {}
        self.windows_per_epoch = len(self._epoch(0))
        if self.windows_per_epoch < batch_size:
            raise ValueError(f"{len(tokens)} tokens cannot fill a batch of {batch_size} x {self.width}")

    def _epoch(self, e: int) -> list[list[int]]:
        """Epoch e's windows: a pure function of (seed, e); the two most recent are kept."""
        if e not in self._epochs:
            order = np.random.default_rng([self.seed, e]).permutation(len(self.spans))
            self._epochs = {k: v for k, v in self._epochs.items() if k == e - 1}
            self._epochs[e] = pack(self.lengths, order, self.width)
        return self._epochs[e]

    def fill(self) -> float:
        """Fraction of window positions holding tokens (the rest is padding), in the first epoch."""
        return float(self.lengths.sum()) / (self.windows_per_epoch * self.width)

    def batch(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.windows_per_epoch // self.batch_size)
        windows = self._epoch(epoch)[k * self.batch_size:(k + 1) * self.batch_size]
        rows = np.full((self.batch_size, self.width), PAD, dtype=np.int64)
        for r, docs in enumerate(windows):
            at = 0
            for d in docs:
                a, b = self.spans[d]
                rows[r, at:at + b - a] = self.tokens[a:b]
                at += b - a
        return torch.from_numpy(rows)


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": other, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


# ---- checkpoints -------------------------------------------------------------------------------
def save_checkpoint(ckpt_dir: Path, model: nn.Module, opt: torch.optim.AdamW, state: dict) -> None:
    """Written to a temporary name and renamed, so a killed run leaves the previous checkpoint whole."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    names = {p: n for n, p in model.named_parameters()}
    tensors = {f"model.{n}": p.detach().contiguous() for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        tensors[f"exp_avg.{names[p]}"] = s["exp_avg"].contiguous()
        tensors[f"exp_avg_sq.{names[p]}"] = s["exp_avg_sq"].contiguous()
        state = {**state, "adam_step": float(s["step"])}
    tmp = ckpt_dir / "train_state.safetensors.tmp"
    save_file(tensors, str(tmp))
    (ckpt_dir / "train_state.json.tmp").write_text(json.dumps(state, indent=2))
    os.replace(tmp, ckpt_dir / "train_state.safetensors")
    os.replace(ckpt_dir / "train_state.json.tmp", ckpt_dir / "train_state.json")


def load_checkpoint(ckpt_dir: Path, model: nn.Module, opt: torch.optim.AdamW) -> Optional[dict]:
    """The saved loop state, or None when there is no checkpoint. Model and optimizer are filled in."""
    meta = ckpt_dir / "train_state.json"
    if not meta.is_file():
        return None
    state = json.loads(meta.read_text())
    tensors = load_file(str(ckpt_dir / "train_state.safetensors"))
    params = dict(model.named_parameters())
    if {k[len("model."):] for k in tensors if k.startswith("model.")} != set(params):
        raise ModelLoadError(f"{ckpt_dir}: checkpoint belongs to a different model shape; "
                             "delete it or choose another --work directory")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[f"model.{n}"])
    for n, p in params.items():
        if f"exp_avg.{n}" in tensors:
            opt.state[p] = {"step": torch.tensor(state["adam_step"]), "exp_avg": tensors[f"exp_avg.{n}"],
                            "exp_avg_sq": tensors[f"exp_avg_sq.{n}"]}
    return state


# ---- the loop ----------------------------------------------------------------------------------
def train(model: LlamaForCausalLM, sampler: DocSampler, cfg: TrainConfig, ckpt_dir: Path,
          loss_fn: LossFn = next_token_loss, desc: str = "train", session_steps: int | None = None) -> dict:
    """Train until max_steps or the time budget; returns the final loop state (steps, time, loss).

    ``session_steps`` stops this call after that many steps (checkpointed), to be resumed later."""
    model.train()
    opt = make_optimizer(model, cfg)
    state = load_checkpoint(ckpt_dir, model, opt) or {"step": 0, "elapsed_s": 0.0, "loss_ema": None}
    if state.get("config") not in (None, asdict(cfg)):
        print(f"note: {ckpt_dir} was written with a different configuration; continuing with the new one")
    state["config"] = asdict(cfg)
    start, last_ckpt = time.monotonic() - state["elapsed_s"], time.monotonic()
    stop_at = state["step"] + session_steps if session_steps is not None else None
    bar = tqdm(total=cfg.max_steps, initial=state["step"], desc=desc, dynamic_ncols=True, mininterval=5)
    while True:
        elapsed = time.monotonic() - start
        progress = max(state["step"] / cfg.max_steps, elapsed / cfg.budget_s)
        if progress >= 1.0 or state["step"] == stop_at:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, state["step"], progress)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, sampler.batch(state["step"]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        value = loss.item()
        state["loss_ema"] = value if state["loss_ema"] is None else 0.98 * state["loss_ema"] + 0.02 * value
        state["step"] += 1
        state["elapsed_s"] = time.monotonic() - start
        bar.update(1)
        bar.set_postfix(loss=f"{state['loss_ema']:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}", refresh=False)
        if time.monotonic() - last_ckpt > cfg.checkpoint_every_s:
            save_checkpoint(ckpt_dir, model, opt, state)
            last_ckpt = time.monotonic()
    bar.close()
    save_checkpoint(ckpt_dir, model, opt, state)
    model.eval()
    return state
