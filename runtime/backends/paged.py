"""Run a CompiledStep over llmd's paged KV pool for one packed step (the ModelRunner's StepBatch).

    k_pool, v_pool: [L, num_blocks * block_size, kv_heads, head_dim], owned by the ModelRunner

Per request span: gather its past slots, run the backend on its new rows, write the returned
keys/values into its new slots. Logits come back for the batch's sample rows only, as from
ModelRunner.run.
"""
from __future__ import annotations

import torch

from .base import CompiledStep


@torch.inference_mode()
def run_step(backend: CompiledStep, k_pool: torch.Tensor, v_pool: torch.Tensor, batch,
             block_size: int) -> torch.Tensor:
    logits = {}
    for span in batch.spans:
        rows = slice(span.start, span.start + span.num_q)
        slots = span.kv_slots(block_size)
        past = slots[:span.ctx_len - span.num_q]
        out, new_k, new_v = backend.forward(batch.input_ids[rows], batch.positions[rows],
                                            k_pool[:, past].float(), v_pool[:, past].float())
        fresh = slots[span.ctx_len - span.num_q:]
        k_pool[:, fresh] = new_k.to(k_pool.dtype)
        v_pool[:, fresh] = new_v.to(v_pool.dtype)
        for i in range(span.num_q):
            logits[span.start + i] = out[i]
    rows = batch.sample_rows.tolist()
    if not rows:
        return torch.empty(0, 0)
    return torch.stack([logits[r] for r in rows]).float()
