"""One step's metadata for the CUDA backend, built on the host from what the model runner's feeds say,
moved to the device in one copy.

Every integer of a step lives in one int64 buffer, so one host-to-device copy moves them all (and a
captured graph's replay is one copy into its static buffer of the same layout):

    flat: | input_ids T | positions T | slot_mapping T | query_start B+1 | seq_lens B | block_table B*W |
    sample_rows: the packed rows whose logits are sampled (a separate buffer: it is read after the graph)

Each part starts at a multiple of SEGMENT elements (128 bytes; the gaps are zeros, never read), so a
view's alignment is the same whatever T and B are: Triton, which specializes a kernel on its
pointers' 16-byte alignment, compiles each kernel variant once per run instead of again whenever a
batch's size moves a view (kernels.py).

Padding to a graph bucket of (B requests, T rows): the real requests come first; padding requests
have no rows and seq_len 0, and rows past the last request's are padding rows with token 0 at
position 0, slot -1 (written nowhere) and owned by no request (attending to nothing: their attention
output is zero). Block table entries past a request's blocks are 0 and never read.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmd.runtime.model_runner import Feed

SEGMENT = 16            # int64 elements: every part of the flat buffer starts on a 128-byte boundary


@dataclass(frozen=True)
class StepShape:
    """What a step's buffers hold: T rows, B requests, W block-table columns, Q rows per request at most."""

    num_rows: int
    num_seqs: int
    width: int
    max_query_len: int

    @property
    def parts(self) -> list[int]:
        """The lengths of the flat buffer's parts, in order (see the module docstring)."""
        t, b = self.num_rows, self.num_seqs
        return [t, t, t, b + 1, b, b * self.width]

    @property
    def flat_size(self) -> int:
        return sum(_padded(n) for n in self.parts)


def _padded(n: int) -> int:
    return -(-n // SEGMENT) * SEGMENT


def split_parts(flat, shape: StepShape) -> list:
    """The six parts of ``flat`` (a numpy array or a tensor) as views, the block table [B, W]."""
    views, at = [], 0
    for n in shape.parts:
        views.append(flat[at:at + n])
        at += _padded(n)
    views[-1] = views[-1].reshape(shape.num_seqs, shape.width)
    return views


@dataclass
class StepMetadata:
    """Views of one flat buffer (see the module docstring); ``shape`` is static for a graph bucket,
    ``real_rows``/``real_seqs`` count what the scheduler asked for."""

    shape: StepShape
    flat: torch.Tensor
    sample_rows: torch.Tensor
    sample_counts: list[int]
    real_rows: int
    real_seqs: int

    def __post_init__(self):
        parts = split_parts(self.flat, self.shape)
        self.input_ids, self.positions, self.slot_mapping, self.query_start, self.seq_lens, self.block_table = parts

    def to(self, device: torch.device | str, pin: bool = False) -> "StepMetadata":
        """The same metadata on ``device``: one copy for the flat buffer, one for the sample rows
        (asynchronous with ``pin``: from page-locked host memory, on a GPU)."""
        flat, rows = (self.flat.pin_memory(), self.sample_rows.pin_memory()) if pin else (self.flat, self.sample_rows)
        return StepMetadata(self.shape, flat.to(device, non_blocking=True), rows.to(device, non_blocking=True),
                            self.sample_counts, self.real_rows, self.real_seqs)


def build_metadata(feeds: list[Feed], block_size: int, width: int | None = None,
                   pad_to: StepShape | None = None) -> StepMetadata:
    """The step's metadata from the model runner's feeds (one per scheduled request, in order).

    ``width``: block-table columns (default: the most blocks any request needs). ``pad_to``: a graph
    bucket's shape, which must hold the step (``fits``)."""
    rows = sum(len(f.token_ids) for f in feeds)
    max_q = max((len(f.token_ids) for f in feeds), default=0)
    need = max((-(-(f.start + len(f.token_ids)) // block_size) for f in feeds), default=0)
    if pad_to is None:
        shape = StepShape(rows, len(feeds), max(1, need if width is None else width), max_q)
    else:
        shape = pad_to
        if not fits(shape, rows, len(feeds), max_q, need):
            raise ValueError(f"a step of {len(feeds)} requests, {rows} rows ({max_q} at most each), {need} blocks "
                             f"does not fit the bucket {shape}")
    flat = np.zeros(shape.flat_size, dtype=np.int64)
    ids, pos, slots, qstart, lens, table = split_parts(flat, shape)
    slots[:] = -1
    sample_rows: list[int] = []
    counts = []
    row = 0
    for i, f in enumerate(feeds):
        n, c = len(f.token_ids), f.start
        ids[row:row + n] = f.token_ids
        p = np.arange(c, c + n)
        pos[row:row + n] = p
        blocks = np.asarray(f.block_ids[:-(-(c + n) // block_size)], dtype=np.int64)
        slots[row:row + n] = blocks[p // block_size] * block_size + p % block_size
        table[i, :len(blocks)] = blocks
        lens[i] = c + n
        sample_rows.extend(range(row + n - f.num_samples, row + n))
        counts.append(f.num_samples)
        row += n
        qstart[i + 1] = row
    qstart[len(feeds) + 1:] = row          # padding requests: no rows
    return StepMetadata(shape, torch.from_numpy(flat), torch.tensor(sample_rows, dtype=torch.long), counts,
                        rows, len(feeds))


def fits(shape: StepShape, rows: int, seqs: int, max_query_len: int, blocks: int) -> bool:
    return (rows <= shape.num_rows and seqs <= shape.num_seqs and max_query_len <= shape.max_query_len
            and blocks <= shape.width)
