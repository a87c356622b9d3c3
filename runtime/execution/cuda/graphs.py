"""Captured steps for decode and verification, one per bucket, replayed by copying metadata.

Buckets: decode steps of B requests with one row each, B in 1, 2, 4, 8, then every 8 up to
``max_num_seqs``; verification steps of B requests with up to k+1 rows each (B * (k+1) rows). A step
whose every row is sampled (decode, verification) goes to the smallest bucket that holds it, padded
as metadata.py describes; other steps (prompt chunks) run eagerly.

Each bucket keeps a static metadata buffer on the device. On a GPU its step is captured once after a
warm-up, all buckets in one memory pool (largest first, so smaller ones reuse its blocks); a replay
is one host-to-device copy of the metadata and ``graph.replay()``. The CPU stand-in (``capture=False``)
keeps the same static buffers and copies and runs the step eagerly from them, so bucket choice,
padding and metadata copies are tested without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .metadata import StepMetadata, StepShape, build_metadata, fits

Forward = Callable[[StepMetadata, int], torch.Tensor]       # (metadata, key splits) -> logits of every row


def batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs] + list(range(16, max_num_seqs + 1, 8))
    return sizes if sizes[-1] == max_num_seqs else sizes + [max_num_seqs]


def bucket_shapes(max_num_seqs: int, width: int, num_spec_tokens: int) -> list[StepShape]:
    """Decode buckets, then verification buckets (none without speculation), each smallest first."""
    shapes = [StepShape(b, b, width, 1) for b in batch_sizes(max_num_seqs)]
    q = num_spec_tokens + 1
    if num_spec_tokens:
        shapes += [StepShape(b * q, b, width, q) for b in batch_sizes(max_num_seqs)]
    return shapes


def choose_bucket(shapes: list[StepShape], rows: int, seqs: int, max_query_len: int, blocks: int) -> Optional[StepShape]:
    """The smallest bucket of the step's kind (decode: one row per request) that holds it."""
    decode = max_query_len == 1
    for s in shapes:
        if (s.max_query_len == 1) == decode and fits(s, rows, seqs, max_query_len, blocks):
            return s
    return None


@dataclass
class Bucket:
    shape: StepShape
    static: StepMetadata              # on the device; every replay copies a step's metadata into it
    splits: int
    graph: Optional[object] = None    # torch.cuda.CUDAGraph once captured
    out: Optional[torch.Tensor] = None


class StepGraphs:
    def __init__(self, forward: Forward, shapes: list[StepShape], block_size: int, device: torch.device,
                 splits_for: Callable[[StepShape], int], capture: bool, pin: bool = False):
        self.forward, self.block_size, self.device, self.pin = forward, block_size, torch.device(device), pin
        self.shapes = shapes
        self.buckets = {s: Bucket(s, build_metadata([], block_size, pad_to=s).to(device), splits_for(s)) for s in shapes}
        self.replays = 0
        if capture:
            self._capture_all()

    def bucket_for(self, feeds) -> Optional[StepShape]:
        """The bucket for these feeds (model_runner.Feed), or None: a step with unsampled rows or
        larger than every bucket runs eagerly."""
        if not feeds or any(f.num_samples != len(f.token_ids) for f in feeds):
            return None
        bs = self.block_size
        return choose_bucket(self.shapes, sum(len(f.token_ids) for f in feeds), len(feeds),
                             max(len(f.token_ids) for f in feeds),
                             max(-(-(f.start + len(f.token_ids)) // bs) for f in feeds))

    def run(self, host: StepMetadata) -> torch.Tensor:
        """Logits of the step's real rows; ``host`` was built with ``pad_to`` a bucket's shape."""
        b = self.buckets[host.shape]
        b.static.flat.copy_(host.flat.pin_memory() if self.pin else host.flat, non_blocking=True)
        self.replays += 1
        if b.graph is not None:
            b.graph.replay()
            out = b.out
        else:
            out = self.forward(b.static, b.splits)
        return out[:host.real_rows]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for shape in sorted(self.shapes, key=lambda s: -s.num_rows):
            b = self.buckets[shape]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):                       # compiles the kernels, settles the allocator
                    self.forward(b.static, b.splits)
            torch.cuda.current_stream().wait_stream(side)
            b.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(b.graph, pool=pool):
                b.out = self.forward(b.static, b.splits)
        torch.cuda.synchronize()
