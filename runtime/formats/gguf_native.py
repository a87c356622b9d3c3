"""A GGUF file served from its own blocks: the file is mapped into memory and every weight is read
where it lies, by llmd's kernels for GGUF's block types (llmd.runtime.kernels' blocks.c). Nothing is
dequantized ahead of time, no copy goes to disk, and the model's size in memory is the file's.

    load_native(path)  -> (model, ModelConfig, Tokenizer), ready for the cpu backend

Loading walks the header (gguf_check), reads the metadata and tokenizer (gguf, gguf_tokenizer), maps
the file copy-on-write (pages are shared with the page cache and never written), and builds the model
on the meta device with a ``GGUFLinear`` per product of the layer plan: the tensors of its sources (q, k
and v as three, or phi3's one ``attn_qkv``), each of its own type, read as one product's parts. llama and mistral files store q and k
rows with rotary pairs adjacent; that is the order llmd's prepared models use, so each part holds a
row order (an index, not a copy) that ``permute_outputs`` composes with.

Norms and biases (float32 vectors) are copied: a few MB. Token rows are dequantized as they are looked
up. A tensor type the kernels do not read (or a machine without them) is refused here with what to do:
``--dtype float32`` still imports any file the `gguf` package reads.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from llmd.runtime import kernels
from llmd.runtime.kernels import ops

from ..models import registry
from ..models.config import ModelConfig
from ..models.plan import rows_of
from ..tokenizer import Tokenizer, check_vocab
from .gguf import GGUFFile, family, hf_config, hf_name, open_gguf
from .gguf_check import GGUFError
from .gguf_tokenizer import tokenizer_files
from .quantized import QuantEmbedding

# GGUF tensor types the kernels read in place (ggml's numbers) and their (values, bytes) per block
TYPES = {"F32": 0, "F16": 1, "BF16": 30, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "IQ4_NL": 20,
         "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_XS": 23}
BLOCKS = {0: (1, 4), 1: (1, 2), 30: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 20: (32, 18),
          10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 23: (256, 136)}
NAMES = {v: k for k, v in TYPES.items()}
F32 = 0
PACKED8 = 100                     # a part's type + this: its rows interleaved in groups of 8 (blocks.c)
PACKS8 = {TYPES["Q4_K"], TYPES["Q5_K"], TYPES["Q8_0"]}          # types with an 8-row layout


class GGUFLinear(nn.Module):
    """A product whose weight is GGUF blocks: ``parts`` [(ggml type, uint8 rows [n, row bytes])], their
    outputs end to end; forward(x [..., in]) -> [..., out] in float32. The tensors are views of the mapped
    file (never written)."""

    method = "gguf"

    def __init__(self, in_features: int, parts: list[tuple[int, torch.Tensor]], bias: torch.Tensor | None = None,
                 release=None, packable: bool = True):
        """``release(view)``, where given, hands a part's mapped pages back once an 8-row copy of them
        exists; ``packable=False`` keeps the file's layout (a token table, whose rows are looked up)."""
        super().__init__()
        for t, rows in parts:
            per, size = BLOCKS[t]
            if in_features % per or rows.dim() != 2 or rows.shape[1] != in_features // per * size:
                raise GGUFError(f"a {NAMES[t]} tensor of rows {tuple(rows.shape)} does not hold {in_features} columns")
        self.in_features = in_features
        self.out_features = sum(int(r.shape[0]) for _, r in parts)
        self.types = [t for t, _ in parts]
        self.blocks = [r for _, r in parts]                     # not buffers: no state_dict copy of the file
        self.orders: list[torch.Tensor | None] = [None] * len(parts)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self._struct = None
        self._packed: list[torch.Tensor | None] | None = None     # 8-row copies, made on first use
        self._release, self.packable = release, packable

    # ---- layout ----------------------------------------------------------------------------
    def permute_outputs(self, rows: torch.Tensor) -> None:
        """Output i becomes output rows[i]: each part's rows are taken through an index (no copy). A
        permutation must keep every part's outputs within that part."""
        at = 0
        for p, block in enumerate(self.blocks):
            n = int(block.shape[0])
            local = rows[at:at + n] - at
            if local.numel() != n or int(local.min()) < 0 or int(local.max()) >= n:
                raise ValueError("a permutation of a GGUF product's outputs must keep each part's rows in that part")
            old = self.orders[p]
            self.orders[p] = (local if old is None else old[local]).to(torch.int32).contiguous()
            at += n
        if self.bias is not None:
            self.bias = self.bias[rows].contiguous()
        self._struct = self._packed = None

    def _pack(self) -> list[torch.Tensor | None]:
        """Each part of a type with an 8-row layout, copied into it (its row order applied), or None."""
        if self._packed is None:
            so = kernels.lib()
            self._packed = []
            for t, b, o in zip(self.types, self.blocks, self.orders):
                packed = None
                if self.packable and so is not None and t in PACKS8 and b.shape[0] % 8 == 0:
                    packed = torch.empty_like(b, memory_format=torch.contiguous_format)
                    _huge_pages(packed)
                    rc = so.llmd_gg_pack8(t, b.data_ptr(), None if o is None else o.data_ptr(), int(b.shape[0]),
                                          self.in_features, packed.data_ptr())
                    if rc:
                        packed = None
                    elif self._release is not None:
                        self._release(b)
                self._packed.append(packed)
        return self._packed

    def parts(self):
        """The llmd_gg_part array the kernels read (kept with this module): 8-row copies where a type
        has that layout, else the file's rows through their order."""
        if self._struct is None:
            packed = self._pack()
            part = kernels.struct("llmd_gg_part")
            self._struct = (part * len(self.blocks))(*(
                part(data=b.data_ptr(), order=None if o is None else o.data_ptr(), type=t, rows=int(b.shape[0]))
                if k is None else part(data=k.data_ptr(), order=None, type=t + PACKED8, rows=int(b.shape[0]))
                for t, b, o, k in zip(self.types, self.blocks, self.orders, packed)))
            self._struct_bytes = torch.frombuffer(self._struct, dtype=torch.uint8)
        return self._struct

    def prepare(self, use_kernels: bool = True) -> None:
        self.parts()

    # ---- products --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        usable = kernels.usable(x2, has_gradient=x2.requires_grad)     # the file's weights take no gradient
        y = ops.gg_matvec(x2, self.parts(), len(self.blocks), self.out_features) if usable else None
        if y is None:
            y = x2 @ self.dense_weight().t()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def kernel_product(self) -> ops.KernelProduct | None:
        if not kernels.available():
            return None
        self.parts()
        held = tuple(t for b, o, k in zip(self.blocks, self.orders, self._packed) for t in ((b, o) if k is None else (k,))
                     if t is not None)             # what a step reads: the 8-row copy, or the file's rows
        return ops.KernelProduct(ops.KIND_GG, self._struct_bytes, group=len(self.blocks), max_rows=ops.MANY_MAX_ROWS,
                                 held=held)

    def table_form(self) -> ops.KernelProduct | None:
        """The weight as a token table whose rows a draft loop reads (one part, rows in file order)."""
        if len(self.blocks) != 1 or self.orders[0] is not None:
            return None
        return self.kernel_product()

    @property
    def qweight(self) -> torch.Tensor:
        """The stored rows of a one-part weight (a token table): the file's blocks."""
        return self.blocks[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a one-part weight (a token table), dequantized exactly."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError("token id outside the vocabulary")
        out = torch.empty(ids.numel(), self.in_features)
        if ids.numel():
            dequantize_rows(self.blocks[0], self.types[0], self.in_features, ids, out)
        return out

    def dense_weight(self) -> torch.Tensor:
        """The whole weight as float32 [out, in] (exact): for references and machines without the kernels."""
        parts = []
        for t, b, o in zip(self.types, self.blocks, self.orders):
            w = torch.empty(b.shape[0], self.in_features)
            dequantize_rows(b, t, self.in_features, torch.arange(b.shape[0]), w)
            parts.append(w if o is None else w[o.long()])
        return torch.cat(parts)

    def packed_bytes(self) -> int:
        """Bytes of the 8-row copies made so far (memory of their own; the file's pages are handed back)."""
        return sum(k.numel() for k in self._packed or () if k is not None)

    def extra_repr(self) -> str:
        kinds = "+".join(NAMES[t] for t in self.types)
        return f"gguf {kinds}, in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def dequantize_rows(blocks: torch.Tensor, type_: int, k: int, ids: torch.Tensor, out: torch.Tensor) -> None:
    so = kernels.lib()
    ids = ids.to(torch.int64).contiguous()
    if so is not None:
        rc = so.llmd_gg_rows(blocks.data_ptr(), type_, k, ids.data_ptr(), ids.numel(), out.data_ptr())
        if rc == 0:
            return
    import gguf
    raw = blocks[ids].numpy()
    out.copy_(torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_)).reshape(-1, k)))


# ---- loading ---------------------------------------------------------------------------------

def native_types(f: GGUFFile) -> dict[str, str]:
    """Each 2-D tensor's type name; refuses a type the kernels do not read."""
    out = {}
    for s in f.spans:
        if len(s.dims) == 2 and s.type not in NAMES:
            import gguf
            name = gguf.GGMLQuantizationType(s.type).name if s.type in gguf.GGMLQuantizationType._value2member_map_ \
                else str(s.type)
            f.fail(s.name, f"tensor type {name} is not one llmd reads in place ({', '.join(TYPES)}); serve the "
                           "file with --dtype float32 (or bfloat16) to import it dequantized")
        out[s.name] = NAMES.get(s.type, str(s.type))
    return out


def _rotary_rows(rows: int, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (rotary pairs adjacent within a head) back to halves order: row j of
    the result is row order[j] of the file."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer a GGUF file carries, built from its metadata in memory."""
    return Tokenizer.from_texts(tokenizer_files(open_gguf(path, reader=False)), path)


def load_native(path: str | Path, progress: bool = True):
    """The model in GGUF file ``path`` with its weights read in place: (model, config, tokenizer).
    The model is not prepared yet (the cpu backend's ``prepare`` does that)."""
    path = Path(path)
    if not kernels.available():
        raise GGUFError(f"{path}: serving a GGUF file from its own blocks needs llmd's CPU kernels, which are "
                        f"unavailable here ({kernels.why()}); serve it with --dtype float32 instead")
    f = open_gguf(path, reader=False)
    raw = hf_config(f, "float32")
    cfg = ModelConfig.from_dict(raw, source=f"{path} (metadata)")
    tokenizer = Tokenizer.from_texts(tokenizer_files(f), path)
    check_vocab(path, tokenizer, cfg)
    types = native_types(f)
    mapped = np.memmap(path, dtype=np.uint8, mode="c")          # copy-on-write: never written, so shared
    spans = {s.name: s for s in f.spans}
    release = page_releaser(mapped)

    def blocks(name: str, rows: int, cols: int) -> tuple[int, torch.Tensor]:
        """The tensor's rows as they lie, once its shape is the [rows, cols] the metadata implies."""
        s = spans.get(name)
        if s is None:
            f.fail(name, "missing")
        if tuple(s.dims) != (cols, rows):
            f.fail(name, f"shape {list(reversed(s.dims))} where the metadata implies {[rows, cols]}")
        view = mapped[s.start:s.start + s.nbytes].reshape(int(s.dims[1]), -1)
        return s.type, torch.from_numpy(view)

    def vector(name: str, n: int) -> torch.Tensor:
        s = spans.get(name)
        if s is None:
            f.fail(name, "missing")
        if s.type != F32 or s.dims != (n,):
            f.fail(name, f"expected float32 [{n}], found type {s.type} shape {list(s.dims)}")
        v = torch.from_numpy(mapped[s.start:s.start + s.nbytes].view(np.float32).copy())
        if not torch.isfinite(v).all():
            f.fail(name, "contains NaN or infinity")
        return v

    for name in spans:
        hf_name(f, name)                          # every tensor is one llmd knows
    with torch.device("meta"):
        model = registry.get(cfg.architecture).model_class(cfg)
    fam = family(f)
    adjacent = fam.rotary_adjacent
    to_file = {hf.removesuffix(".weight"): g.removesuffix(".weight")      # checkpoint module -> GGUF name
               for g, hf in fam.layer.items() if g.endswith(".weight")}
    h = cfg.hidden_size
    sizes = {"h": h, "q": cfg.q_size, "kv": cfg.kv_size, "i": cfg.intermediate_size}
    for i, layer in enumerate(tqdm(model.layers, desc=f"mapping {path.name}", unit="layer", disable=not progress,
                                   leave=False)):
        p = f"blk.{i}."
        for product in cfg.plan.products:         # each product's parts: the file's tensors of its sources
            width, sources = sizes[product.inputs], product.sources
            parts = [blocks(p + to_file[s.module] + ".weight", rows_of(s.rows, sizes), width) for s in sources]
            bias = torch.cat([vector(p + to_file[s.module] + ".bias", rows_of(s.rows, sizes))
                              for s in sources]) if product.bias else None
            linear = GGUFLinear(width, parts, bias, release)
            if adjacent and product.module == "self_attn.qkv_proj":     # rotary-adjacent rows: to halves
                qo = _rotary_rows(cfg.q_size, cfg.num_heads)
                ko = _rotary_rows(cfg.kv_size, cfg.num_kv_heads)
                linear.permute_outputs(torch.cat([qo, ko + cfg.q_size,
                                                  torch.arange(cfg.kv_size) + cfg.q_size + cfg.kv_size]))
            parent, leaf = product.module.rsplit(".", 1)
            setattr(layer.get_submodule(parent), leaf, linear)
        norms = [f"self_attn.{n}" for n in ("q_norm", "k_norm") if cfg.qk_norm] + list(cfg.plan.layer_norms())
        for norm in norms:                        # Gemma files store the scale 1 + w, as llmd holds it
            size = cfg.head_dim if norm.startswith("self_attn.") else h
            layer.get_submodule(norm).weight = nn.Parameter(vector(p + to_file[norm] + ".weight", size),
                                                            requires_grad=False)
    model.norm.weight = nn.Parameter(vector("output_norm.weight", h), requires_grad=False)
    table = GGUFLinear(h, [blocks("token_embd.weight", cfg.vocab_size, h)], packable=False)        # its rows are looked up
    if cfg.tie_word_embeddings:
        model.lm_head = table
        model.embed_tokens = QuantEmbedding(table, owns_table=False)
    else:
        model.lm_head = GGUFLinear(h, [blocks("output.weight", cfg.vocab_size, h)], None, release)
        model.embed_tokens = QuantEmbedding(table, owns_table=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t is not None and t.is_meta]
    if left:
        f.fail(left[0], "no tensor of the file filled this weight")
    model.eval()
    model.gguf_source = path
    model.gguf_types = types
    model._gguf_map = mapped                      # the mapping lives as long as the model
    return model, cfg, tokenizer


def _huge_pages(t: torch.Tensor) -> None:
    """Ask for transparent huge pages under a large tensor not yet written (where the kernel gives them
    only when asked): a weight stream then crosses a page every 2 MiB, not every 4 KiB."""
    import mmap
    if t.numel() < 4 << 20 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        huge = 2 << 20
        start = -(-t.data_ptr() // huge) * huge
        end = (t.data_ptr() + t.numel()) // huge * huge
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


def page_releaser(mapped: np.memmap):
    """A function that hands the pages under a view of ``mapped`` back to the kernel (they are re-read
    from the file if ever touched again): after a tensor is copied into an 8-row layout, its mapped
    pages would otherwise stay resident beside the copy."""
    import mmap
    raw = getattr(mapped, "_mmap", None)
    base = mapped.ctypes.data
    page = mmap.PAGESIZE

    def release(view: torch.Tensor) -> None:
        if raw is None or not hasattr(raw, "madvise"):
            return
        start, end = view.data_ptr() - base, view.data_ptr() - base + view.numel()
        start, end = -(-start // page) * page, end // page * page
        if end > start:
            try:
                raw.madvise(mmap.MADV_DONTNEED, start, end - start)
            except (OSError, ValueError):
                pass
    return release


def type_summary(types: dict[str, str]) -> str:
    """'Q4_K x 169, Q6_K x 29, F32 x 57'-style count of a file's tensor types."""
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{t} x {n}" for t, n in sorted(counts.items(), key=lambda kv: -kv[1]))
