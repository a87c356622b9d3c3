"""CudaRunner: the model runner for ``--device cuda``, held to the runner contract
(llmd.runtime.execution.contract) like the CPU's ModelRunner, with ``sample`` drawing on the device.
It has no head screen and cannot move keys to other positions (``screens_head``, ``can_shift``: False);
its ``execution`` is CudaExecution: the argmax on the device, and a draft's rounds one step at a time.

A step: the feeds' metadata is built on the host (padded to a graph bucket when the step is a decode or
verification step that fits one), copied to the device in one copy, and either replayed in the
bucket's captured graph or run eagerly; logits stay on the device. ``sample`` draws on the device and
returns the ids in one device-to-host copy.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from llmd.runtime.model_runner import Feed, feeds_for, pool_dtype
from llmd.runtime.runner import Runner
from llmd.runtime.sampler import SamplingRow
from llmd.runtime.scheduler import ScheduledRequest

from .attention import TritonAttention
from .graphs import StepGraphs, bucket_shapes
from .metadata import StepMetadata, build_metadata
from .ops import BLOCK_SIZE, decode_splits
from .sampling import draw

GRAPH_MODES = ("capture", "standin", "off")
log = logging.getLogger("llmd.cuda")


@dataclass
class CudaBatch:
    feeds: list[Feed]
    sample_counts: list[int]           # per request: its rows among the sampled ones (as StepBatch)


class CudaExecution:
    """The contract's ``execution`` of a CudaRunner: what the engine and a draft ask of a backend."""

    name = "cuda"
    kernels = None                     # llmd's CPU kernels never run here (no cpu_* stats)

    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """Each row's first largest value (int64 [M]), on the logits' device."""
        return logits.argmax(-1)

    @staticmethod
    def greedy_rounds(runner, feeds, positions, block_ids, steps) -> None:
        """None: a draft's greedy forwards run one step at a time (each may replay a graph)."""
        return None


class CudaRunner(Runner):
    samples_on_device = True
    screens_head = False               # no head screen: greedy steps read the whole head's logits
    can_shift = False                  # shifted prefix reuse stays off
    execution = CudaExecution()

    def __init__(self, model, num_blocks: int, block_size: int, dtype: str, kv_dtype: str = "auto",
                 device: str | torch.device = "cuda", max_num_seqs: int = 64, num_spec_tokens: int = 0,
                 max_model_len: Optional[int] = None, graphs: Optional[str] = None, pin: Optional[bool] = None):
        if block_size != BLOCK_SIZE:
            raise ValueError(f"the CUDA backend's attention reads blocks of {BLOCK_SIZE} tokens, not {block_size}")
        if kv_dtype == "int8":
            raise ValueError("the CUDA backend keeps keys and values in bfloat16 or float32, not int8")
        cfg = model.config
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin   # host buffers page-locked: asynchronous copies
        self.model = model.requires_grad_(False)
        if any(t.device.type != self.device.type for t in [*model.parameters(), *model.buffers()]):
            self.model.to(self.device)
        self.config = cfg
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        element = pool_dtype(dtype, kv_dtype)
        self.k_pool = torch.zeros(shape, dtype=element, device=self.device)
        self.v_pool = torch.zeros(shape, dtype=element, device=self.device)
        self.attn = TritonAttention(self.k_pool, self.v_pool)
        self.width = -(-(max_model_len or cfg.max_position_embeddings) // block_size)
        mode = graphs or ("capture" if self.device.type == "cuda" else "off")
        if mode not in GRAPH_MODES:
            raise ValueError(f"graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
        self.graphs: Optional[StepGraphs] = None
        self.step_graphs = "off"
        if mode != "off":
            self._set_up_graphs(mode, bucket_shapes(max_num_seqs, self.width, num_spec_tokens))

    def _set_up_graphs(self, mode: str, shapes) -> None:
        """The graph buckets, captured (``capture``) or replayed eagerly from their static buffers
        (``standin``). A capture that raises is reported and leaves every step eager: parity and the
        eager step's speed are kept, only the graphs' saving is lost."""
        kv_heads = self.config.num_kv_heads
        try:
            self.graphs = StepGraphs(self._forward_all, shapes, self.block_size, self.device,
                                     lambda s: decode_splits(s.num_seqs, kv_heads, s.width),
                                     capture=mode == "capture", pin=self.pin)
        except Exception as e:      # any capture failure: the eager path needs none of what it built
            self.graphs = None
            self.step_graphs = f"failed: {type(e).__name__}: {e}"
            log.warning("llmd: CUDA graph capture failed (%s: %s); running every step eagerly. "
                        "--no-cuda-graphs skips the capture.", type(e).__name__, e)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return
        self.step_graphs = "captured" if mode == "capture" else "standin"

    def prepare(self, scheduled: list[ScheduledRequest]) -> CudaBatch:
        return self.prepare_feeds(feeds_for(scheduled))

    def prepare_feeds(self, feeds: list[Feed]) -> CudaBatch:
        return CudaBatch(feeds, [f.num_samples for f in feeds])

    @torch.inference_mode()
    def run(self, batch: CudaBatch) -> torch.Tensor:
        """Float32 logits of the sampled rows, on the device."""
        feeds = batch.feeds
        bucket = self.graphs.bucket_for(feeds) if self.graphs is not None else None
        if bucket is not None:
            return self.graphs.run(build_metadata(feeds, self.block_size, pad_to=bucket))
        meta = build_metadata(feeds, self.block_size).to(self.device, self.pin)
        splits = decode_splits(meta.shape.num_seqs, self.config.num_kv_heads, meta.shape.width) \
            if meta.shape.max_query_len == 1 else 1
        self.attn.prepare(meta, splits)
        hidden = self.model(meta.input_ids, meta.positions, self.attn)
        if meta.real_rows == 0 or len(meta.sample_rows) == 0:
            return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
        if len(meta.sample_rows) != meta.real_rows:
            hidden = hidden.index_select(0, meta.sample_rows)
        return self.model.compute_logits(hidden).float()

    def run_greedy(self, batch: CudaBatch) -> list[int]:
        """Each sampled row's greedy token: the argmax on the device, the ids in one copy."""
        return self.execution.greedy(self.run(batch)).tolist()

    @torch.inference_mode()
    def copy_slots(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` slots of block ``src`` into block ``dst``, every layer's keys and values."""
        if src == dst:
            return
        bs = self.block_size
        for pool in (self.k_pool, self.v_pool):
            pool[:, dst * bs:dst * bs + n] = pool[:, src * bs:src * bs + n]

    def copy_shifted(self, src: list[int], dst: list[int], delta: int) -> None:
        raise RuntimeError("the CUDA backend cannot move keys to other positions")

    def block_views(self, block_id: int) -> list[torch.Tensor]:
        """One block's keys and values in every layer: views of the pools, in the disk tier's order."""
        bs = self.block_size
        return [self.k_pool[:, block_id * bs:(block_id + 1) * bs], self.v_pool[:, block_id * bs:(block_id + 1) * bs]]

    def _forward_all(self, meta: StepMetadata, splits: int) -> torch.Tensor:
        """Logits of every row of a bucket's step (what a graph captures)."""
        self.attn.prepare(meta, splits)
        return self.model.compute_logits(self.model(meta.input_ids, meta.positions, self.attn)).float()

    def stats(self) -> dict:
        return {**super().stats(), "cuda_graphs": self.step_graphs}

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """One token id per row, drawn on the logits' device (see ``draw``); the ids come back in one copy."""
        return draw(logits, rows)
