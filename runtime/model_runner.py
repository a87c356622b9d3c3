"""ModelRunner: owns the model, its KV pools, and turns a scheduled step into logits.

Input preparation packs every scheduled request's new tokens along one axis:

    packed rows:  | req A chunk (n_A rows) | req B (1 row) | req C (k+1 rows) | ...
    positions:    | c_A .. c_A+n_A-1       | c_B           | c_C .. c_C+k     |
    slot_mapping: the pool slot each row's key/value is written to

and computes logits only for rows that are sampled (the last row of a request that reaches the end
of its tokens, or all k+1 rows of a request whose proposals are verified).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .attention import SeqSpan, int_tensor
from .execution import backend_class
from . import kernels
from .kernels import ops
from .models.config import ModelConfig
from .models.llama import LlamaForCausalLM
from .runner import Runner
from .sampler import SamplingRow, sample
from .scheduler import ScheduledRequest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pool_dtype(dtype: str, kv_dtype: str) -> torch.dtype:
    """The KV pool's element type: the model's (auto), bfloat16, or int8 (with scales)."""
    return torch.int8 if kv_dtype == "int8" else DTYPES[dtype if kv_dtype == "auto" else kv_dtype]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: str, kv_dtype: str = "auto") -> int:
    if kv_dtype == "int8":     # one byte per value plus a float32 scale per block and kv head
        return 2 * cfg.num_layers * (block_size * cfg.kv_size + 4 * cfg.num_kv_heads)
    return 2 * cfg.num_layers * block_size * cfg.kv_size * pool_dtype(dtype, kv_dtype).itemsize


def rotate_keys(k: torch.Tensor, delta: int, inv_freq: torch.Tensor, adjacent: bool) -> torch.Tensor:
    """Keys [..., D] rotated by ``delta`` positions: each pair's angle grows by ``delta * inv_freq``.
    Pairs are adjacent dimensions (2i, 2i + 1) in the prepared layout, else the two halves (i, i + D/2)."""
    angle = delta * inv_freq.double().to(k.device)
    cos, sin = angle.cos().float(), angle.sin().float()
    x = k.float()
    d = x.shape[-1]
    if adjacent:
        pairs = x.unflatten(-1, (d // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


@dataclass
class Feed:
    """One request's part of a forward: feed ``token_ids`` at positions start.., sample the last
    ``num_samples`` rows."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    num_samples: int


def feeds_for(scheduled: list[ScheduledRequest]) -> list[Feed]:
    feeds = []
    for s in scheduled:
        r = s.request
        c, n = r.num_computed_tokens, s.num_new_tokens
        base = r.num_tokens
        ids = r.token_ids[c:c + n] if c + n <= base else r.token_ids[c:] + r.spec_token_ids[:c + n - base]
        feeds.append(Feed(ids, c, r.block_ids, (s.num_spec_tokens + 1) if s.samples else 0))
    return feeds


@dataclass
class StepBatch:
    """The step's packed inputs, kept for callers that need positions (the speculative proposers)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    spans: list[SeqSpan]
    sample_rows: torch.Tensor         # packed rows whose logits are computed
    sample_counts: list[int]          # per scheduled request: how many of those rows are its own


class ModelRunner(Runner):
    """``execution`` names the backend (llmd.runtime.execution) the model was prepared for; ``backend``
    is an engine directory's compiled step (llmd.runtime.backends), which runs as the compiled one.
    The members the engine reads are the runner contract's (llmd.runtime.execution.contract)."""

    samples_on_device = False          # logits come back on the host: sampled there

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: str,
                 reference_attention: bool = False, kv_dtype: str = "auto", backend=None, execution: str = "cpu"):
        cfg = model.config
        self.model = model
        self.config = cfg
        self.backend = backend            # a compiled CompiledStep (onnxruntime, aot, tensorrt) or None
        self.block_size = block_size
        self.num_blocks = num_blocks
        cls = backend_class("compiled" if backend is not None else execution)
        self.device = cls.device
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        element = pool_dtype(dtype, kv_dtype)
        self.k_pool = torch.zeros(shape, dtype=element, device=cls.device)
        self.v_pool = torch.zeros(shape, dtype=element, device=cls.device)
        scales = None
        if kv_dtype == "int8":
            scale_shape = (cfg.num_layers, num_blocks, cfg.num_kv_heads)
            scales = (torch.zeros(scale_shape, device=cls.device), torch.zeros(scale_shape, device=cls.device))
        self.attn = cls.attention(self.k_pool, self.v_pool, block_size, scales, reference=reference_attention)
        self.execution = cls(model, self.attn, backend) if backend is not None else cls(model, self.attn)
        # keys can be moved to other positions where llmd's own model code wrote them in a float pool
        self.can_shift = backend is None and kv_dtype != "int8"

    @torch.inference_mode()
    def copy_shifted(self, src: list[int], dst: list[int], delta: int) -> None:
        """Copy the keys and values of pool slots ``src`` to slots ``dst``, each key rotated from its
        position ``p`` to ``p + delta`` (rotary angles add), in the layout the model writes them in."""
        if not self.can_shift:
            raise RuntimeError("this runner cannot move keys to other positions")
        s = torch.tensor(src, device=self.k_pool.device)
        d = torch.tensor(dst, device=self.k_pool.device)
        v = self.v_pool[:, s]
        k = self.k_pool[:, s]
        if delta:
            k = rotate_keys(k, delta, self.model.rotary.inv_freq, self.model.rotary_pairs_adjacent)
        self.k_pool[:, d] = k.to(self.k_pool.dtype)
        self.v_pool[:, d] = v

    @torch.inference_mode()
    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst`` (every layer's keys and values,
        and an int8 pool's block scales with them)."""
        if src == dst:
            return
        bs = self.block_size
        for pool in (self.k_pool, self.v_pool):
            pool[:, dst * bs:dst * bs + n] = pool[:, src * bs:src * bs + n]
        if self.attn.scales is not None:
            for scale in self.attn.scales:
                scale[:, dst] = scale[:, src]

    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One block's keys and values in every layer (and an int8 pool's block scales): views of the
        pools, as the disk tier stores them, in this order."""
        bs = self.block_size
        views = [self.k_pool[:, block_id * bs:(block_id + 1) * bs], self.v_pool[:, block_id * bs:(block_id + 1) * bs]]
        if self.attn.scales is not None:
            views += [scale[:, block_id] for scale in self.attn.scales]
        return views

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        return self.prepare_feeds(feeds_for(scheduled))

    def prepare_feeds(self, feeds: list[Feed]) -> StepBatch:
        """Plain Python lists, then one tensor each: per-step work stays O(tokens) with few torch calls."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans, sample_rows, counts = [], [], []
        row = 0
        for f in feeds:
            c, n, k = f.start, len(f.token_ids), f.num_samples
            ids.extend(f.token_ids)
            positions.extend(range(c, c + n))
            b = f.block_ids
            slots.extend(b[p // bs] * bs + p % bs for p in range(c, c + n))
            spans.append(SeqSpan(row, n, c + n, b))
            sample_rows.extend(range(row + n - k, row + n))
            counts.append(k)
            row += n
        n = len(ids)
        flat = int_tensor(ids + positions + slots + sample_rows, np.int64)   # one tensor, four views
        return StepBatch(flat[:n], flat[n:2 * n], flat[2 * n:3 * n], spans, flat[3 * n:], counts)

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Forward the packed step; returns float32 logits [len(sample_rows), vocab]."""
        return self.execution.run(batch)

    @property
    def screens_head(self) -> bool:
        """Greedy steps find their tokens through the head's screen (``run_greedy``)."""
        return self.backend is None and self.model.head_screen is not None

    def run_greedy(self, batch: StepBatch) -> list[int]:
        """Forward the packed step whose sampled rows are all greedy; returns each row's token."""
        return self.execution.run_greedy(batch)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """One token per row, drawn on the host (``execute`` samples there too, with logprobs)."""
        return sample(logits, rows).token_ids.tolist()

    def stats(self) -> dict:
        return {**super().stats(), **self._kernel_stats(), **self._screen_stats()}

    def _kernel_stats(self) -> dict:
        """Which of llmd's CPU kernel libraries the cpu backend runs: avx512, avx2, or none (torch's ops);
        from how many rows its int8 products take AMX's tile unit (0: never), and past how many rows
        products over bfloat16 blocks do (0: never)."""
        if self.execution.kernels is None:
            return {}
        on = self.execution.kernels
        return {"cpu_kernels": kernels.variant() if on else "none",
                "cpu_amx_rows": kernels.lib().llmd_amx_min_rows(-1) if on else 0,
                "cpu_amx_bf16": ops.bf16_amx_rows() if on else 0}

    def _screen_stats(self) -> dict:
        """The head screen's counters: greedy rows it served, the head rows it scored exactly per row,
        and rows that read the whole head instead."""
        if not self.screens_head:
            return {}
        st = self.model.head_screen.stats
        return {"head_screen_on": st.on, "head_screen_rows": st.rows, "head_screen_whole": st.whole,
                "head_screen_candidates_mean": round(st.candidates / st.rows, 1) if st.rows else None}
