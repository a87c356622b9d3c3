"""Every decoder layer of a small step in one kernel call (``llmd_decode`` in llmd.runtime.kernels'
decode.c), and a draft model's greedy proposals in another (``llmd_draft``).

The Python forward of a decode step calls a dozen kernels per layer, and the Python between them
(module calls, checks, allocations) cost as much as the arithmetic for a small model: 0.4 ms of a
1 ms tiny-shape token here. The fused call runs the same kernels in the same order, with the same
thread counts, so its hidden states are bit-identical to the Python forward's (tests hold the two
to it). It serves a step when everything that step needs has a kernel form: each product's
``kernel_product()`` (float32 weights in the blocked layout, float32 or bfloat16 blocks; int8, int4
or int8g weights on llmd's quantized kernels), rotary on adjacent pairs without q/k norms, a float32
or bfloat16 KV pool (keys and values rounded to bfloat16 as torch rounds them), and every request on
the attention kernel (decode, verification, short prompt chunks). It takes as many rows as every
product's kernel takes in the Python forward too (``KernelProduct.max_rows``), up to
``ops.fused_rows()``. Anything else returns None and the Python forward runs, as it always could.
"""
from __future__ import annotations

import ctypes

import torch

from llmd.runtime import kernels
from llmd.runtime.kernels import ops

POOL_DTYPES = (torch.float32, torch.bfloat16)     # KV pools the fused step writes and reads


class FusedDecode:
    """The weight pointers of one prepared model and a scratch buffer: called by one thread at a time,
    as the engine runs its model."""

    def __init__(self, model, linears: list, forms: list[ops.KernelProduct], max_rows: int):
        """``linears``: each layer's four products in order (``layer_linears``); ``forms`` their
        ``kernel_product()``s."""
        cfg = model.config
        # what the calls read, not the model itself (which holds this object: no reference cycle)
        self.config, self.rotary, self.norm = cfg, model.rotary, model.norm.weight.detach()
        self.head, self.embed = head_of(model)
        self.max_rows = max_rows
        self.eps = cfg.rms_norm_eps
        self.windows = frozenset(model.windows)          # the layers' windows (None: full attention)
        # the storage behind the pointers, held (as detached tensors, which a later swap of a parameter's
        # ``.data`` cannot free) for as long as the pointers live; prepare_for_inference builds anew
        norms = [_held(n.weight) for layer in model.layers
                 for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        biases = [_held(m.bias) for m in linears]
        self._tensors = [*norms, *biases, *(t for f in forms for t in f.tensors())]
        self._norms = (ctypes.c_void_p * len(norms))(*map(_ptr, norms))
        self._products = (kernels.struct("llmd_product") * len(forms))(*(f.struct(b) for f, b in zip(forms, biases)))
        h, kvh, d, i = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        e = cfg.hidden_size
        self._dims = kernels.struct("llmd_dims")(layers=cfg.num_layers, hidden=e, heads=h, kv_heads=kvh, head_dim=d,
                                                 intermediate=i, rope_rows=model.rotary.cos.shape[0],
                                                 vocab=cfg.vocab_size)
        self._per_row = (h + 2 * kvh) * d + 2 * h * d + kvh * d + 3 * i + e
        self._work = torch.empty(min(max_rows, 16) * self._per_row)    # grows with a step's rows
        self.steps = 0           # steps served (tests check the fused path really ran)
        self.draft_steps = 0     # greedy draft forwards served by draft_greedy

    def weight_bytes(self) -> int | None:
        """Bytes of the weights one step reads: every layer's products, norms and biases, and the head's
        kernel form, each storage once; None where the head is not on the kernels."""
        head = self.head.kernel_product()
        if head is None:
            return None
        seen: dict[int, int] = {}
        for t in [*self._tensors, *head.tensors()]:
            if t is not None:
                seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    def __deepcopy__(self, memo):
        return None           # a copied model has its own weights: it runs the Python forward

    @classmethod
    def build(cls, model) -> "FusedDecode | None":
        """The fused form of a prepared model, or None when some part has no kernel form."""
        if not _shapes_fit(model):
            return None
        flat = layer_linears(model)
        forms = [m.kernel_product() for m in flat]
        if any(f is None for f in forms):
            return None
        norms = [model.norm.weight, *(w for layer in model.layers
                                      for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight))]
        if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return None
        # rows beyond what every product's plan sends to the kernel take the Python path, as they would anyway
        max_rows = min(f.max_rows for f in forms)
        return cls(model, flat, forms, min(max_rows, ops.fused_rows())) if max_rows >= 1 else None

    def _scratch(self, rows: int) -> torch.Tensor:
        """The kernels' work buffer for a call of ``rows`` rows: grown to the largest call so far, then kept."""
        if self._work.numel() < rows * self._per_row:
            self._work = torch.empty(rows * self._per_row)
        return self._work

    def _step_dims(self, rows: int, pools: torch.Tensor, table_width: int, block_size: int):
        """The dims (kernels.h's llmd_dims) with this call's rows, pool slots, table width, block size
        and pool value size filled in."""
        dims = self._dims
        dims.rows, dims.pool_slots, dims.table_width, dims.block_size = rows, pools.shape[1], table_width, block_size
        dims.pool_bytes = pools.element_size()
        return dims

    @staticmethod
    def serves(attn) -> bool:
        """The fused calls read and write these pools (the cpu backend asks once, when it is built):
        float32 or bfloat16 pools on the attention kernel, without int8 scales."""
        return attn.kernel and attn.scales is None and not attn.reference and attn.k_pool.dtype in POOL_DTYPES

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor | None:
        """Final normed hidden states [T, hidden] of the packed rows, or None where this step needs
        the Python forward (``attn``'s pools served, see ``serves``). Writes this step's keys and
        values into the pools as that would."""
        t = x.shape[0]
        kr = self._kernel_rows(attn)
        if (t > self.max_rows or x.dtype != torch.float32 or x.dim() != 2 or kr is None or attn.groups
                or kr.rows.numel() != t or positions.dtype != torch.int64):
            return None
        fn = kernels.lib().llmd_decode           # loaded: a fused form is built only where it is
        pools = attn.k_pool
        work = self._scratch(t)                          # held by this call while the kernel writes it
        dims = self._step_dims(t, pools, kr.table.shape[1], kr.block_size)
        rotary = self.rotary
        x = x.contiguous().clone()           # the residual stream, overwritten; the caller's x stays whole
        out = torch.empty_like(x)
        positions = positions.contiguous()   # held while the kernel reads it
        rc = fn(ctypes.addressof(dims), x.data_ptr(), out.data_ptr(), ctypes.addressof(self._norms),
                ctypes.addressof(self._products), self.norm.data_ptr(), self.eps, rotary.cos.data_ptr(),
                rotary.sin.data_ptr(), positions.data_ptr(), pools.data_ptr(), attn.v_pool.data_ptr(),
                attn.slot_mapping.data_ptr(), kr.rows.data_ptr(), kr.spans.data_ptr(), kr.lengths.data_ptr(),
                kr.table.data_ptr(), work.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise MemoryError("the fused step's kernels could not allocate their buffers (out of memory)")
        if rc:
            return None      # a shape a kernel refused (a position past the rotary tables): the Python path says why
        self.steps += 1
        return out

    def _kernel_rows(self, attn):
        """The kernel rows every layer reads this step (a window's where every layer slides alike), or
        None where layers read different ones: a window cuts some request's context for some layers
        and not for others (the Python forward then attends layer by layer)."""
        forms = {id(rows): rows for rows in (attn.window_metadata(w)[0] for w in self.windows)}
        return next(iter(forms.values())) if len(forms) == 1 else None

    def draft_greedy(self, runner, feeds: list[list[int]], positions: list[int], block_ids: list[list[int]],
                     steps: int) -> list[list[int]] | None:
        """``steps`` greedy draft forwards in one kernel call (llmd.runtime.spec.draft's loop): request i
        first feeds ``feeds[i]`` (one token or more: what the draft has not seen) at ``positions[i]``..,
        then each token it takes at the next position; its pools are ``runner``'s. Returns each
        request's tokens taken (all ``steps``, or fewer where the caller's own loop must go on: logits
        with NaN, a position past its blocks or the rotary tables), or None where the kernel cannot run
        this (more rows than the products take on the kernel, a head not on the kernel for this many
        rows); ``runner``'s pools must be ones it ``serves``."""
        t, rows = len(feeds), sum(len(f) for f in feeds)
        fn = kernels.lib().llmd_draft
        attn = runner.attn
        head = self.head.kernel_product()
        table = self._table(head)
        most = min(self.max_rows, ops.draft_rows())
        if (not 1 <= t <= rows <= most or not all(feeds) or steps < 1
                or head is None or head.max_rows < t or self.head.bias is not None or table is None):
            return None
        # a request's own blocks bound its steps (the table's zero padding is no block of its own): its
        # last position at step s is positions[i] + len(feeds[i]) - 1 + s
        bs = runner.block_size
        steps = min(steps, *(len(b) * bs - p - len(f) + 1 for b, p, f in zip(block_ids, positions, feeds)))
        window = min((w for w in self.windows if w is not None), default=None)
        if window is not None:          # the loop attends whole contexts: none may reach past a window
            steps = min(steps, *(window - p - len(f) + 1 for p, f in zip(positions, feeds)))
        if steps < 1:
            return None
        width = max(len(b) for b in block_ids)
        blocks = torch.tensor([b + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32)
        dims = self._step_dims(t, attn.k_pool, width, bs)
        e, v = self.config.hidden_size, self.config.vocab_size
        ids = torch.tensor([i for f in feeds for i in f], dtype=torch.int64)
        count = torch.tensor([len(f) for f in feeds], dtype=torch.int32)
        pos0 = torch.tensor(positions, dtype=torch.int64)
        out = torch.empty(t, steps, dtype=torch.int64)
        x, hidden, logits = torch.empty(most, e), torch.empty(most, e), torch.empty(t, v)
        work = self._scratch(rows)                       # held by this call while the kernel writes it
        rotary = self.rotary
        head_struct, table_struct = head.struct(), table.struct()
        done = fn(ctypes.addressof(dims), ctypes.addressof(self._norms), ctypes.addressof(self._products),
                  self.norm.data_ptr(), self.eps, rotary.cos.data_ptr(), rotary.sin.data_ptr(),
                  attn.k_pool.data_ptr(), attn.v_pool.data_ptr(), blocks.data_ptr(), ctypes.addressof(head_struct),
                  ctypes.addressof(table_struct), ids.data_ptr(), count.data_ptr(), pos0.data_ptr(), steps,
                  out.data_ptr(), x.data_ptr(), hidden.data_ptr(), logits.data_ptr(), work.data_ptr(),
                  torch.get_num_threads())
        if done == -2:
            raise MemoryError("the fused step's kernels could not allocate their buffers (out of memory)")
        if done < 0:
            return None
        self.draft_steps += done
        return out[:, :done].tolist()

    def _table(self, head: ops.KernelProduct | None) -> ops.KernelProduct | None:
        """The token table as llmd_draft reads its rows (as the model's ``embed`` looks them up), or None
        where it cannot: a tied float head's own blocks, float32 rows, or an int8 / int8g table's rows."""
        embed = self.embed
        if embed is None:                 # tied: the head's table, its float blocks or its int8 rows
            rows = getattr(self.head, "table_form", None)
            return head if rows is None or head is None else rows()
        if isinstance(embed, torch.Tensor):
            ok = embed.dtype == torch.float32 and embed.is_contiguous()
            return ops.KernelProduct(ops.KIND_ROWS, embed) if ok else None
        rows = getattr(embed, "table_form", None)
        return rows() if rows is not None else None


def head_of(model):
    """The output head (a tied head's prepared Linear, or lm_head), and the token table the draft loop
    reads rows of: None for a tied float head (rows from the head's own blocks), a quantized
    embedding's table module (its ``kernel_product()``), else the embedding weight."""
    if model._tied_head is not None:
        return model._tied_head, None
    table = getattr(model.embed_tokens, "table", None)      # a quantized embedding (formats.quantized)
    return model.lm_head, table if table is not None else model.embed_tokens.weight


def _shapes_fit(model) -> bool:
    """The kernels are built and take this model's plan and shapes: the Llama plan (``LayerPlan.plain``),
    rotary on adjacent pairs without q/k norms,
    rows in whole vectors of 16, head sizes the attention kernel takes."""
    cfg = model.config
    return (kernels.available() and cfg.plan.plain() and model._interleaved and not cfg.qk_norm and not cfg.hidden_size % 16
            and not cfg.intermediate_size % 16 and not cfg.head_dim % 16 and cfg.head_dim <= 256)


def layer_linears(model) -> list:
    """Each layer's four products, in the plan's order (qkv, o, gate_up, down: decode.c's)."""
    modules = [p.module for p in model.config.plan.products]
    return [layer.get_submodule(m) for layer in model.layers for m in modules]


def _held(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
