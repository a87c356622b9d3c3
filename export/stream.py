"""An export a decoder layer at a time: the float weights of one layer are in memory at once, never
the whole model, so a 7B model exports on a machine that could not hold it in float32.

    source = open_source(path)     a Hugging Face directory (safetensors, read per tensor) or a GGUF
                                   file (mapped; each layer's blocks dequantized as it comes up)
    quantize_part(...)             one pass over the layers: the float reference's hidden states and
                                   the calibration text's advance through each float layer, which is
                                   then scale-searched, rounded (once per int4 group size still to be
                                   chosen) and written; the table and head are rounded a chunk of
                                   rows at a time
    WrittenModel(dir, spec)        the written weights read back a layer at a time: the quality gate
                                   measures the engine through them
    float_reference(source, w)     the gate's float reference alone, for measuring another engine

Memory is bounded by a float layer (two while int4 group sizes are compared), the rounded head and
the windows' hidden states; the rounded layers go to disk as they are made (``TensorWriter``).
"""
from __future__ import annotations

import copy
import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from llmd.runtime.errors import ModelLoadError
from llmd.runtime.formats.engine_dir import WEIGHTS
from llmd.runtime.formats.gguf import hf_config, open_gguf
from llmd.runtime.formats.gguf_import import is_gguf
from llmd.runtime.formats.gguf_native import load_native, page_releaser
from llmd.runtime.formats.gguf_tokenizer import tokenizer_files
from llmd.runtime.formats.manifest import sha256_file
from llmd.runtime.formats.quantized import (QuantEmbedding, QuantLinear, QuantSpec, embedding_module, head_module,
                                            load_rows, quantize_layer, quantize_model)
from llmd.runtime.models.config import ModelConfig
from llmd.runtime.models.layers import RMSNorm
from llmd.runtime.models.llama import TORCH_OPS, DecoderLayer, LlamaForCausalLM, causal_attention, materialize
from llmd.runtime.models.loader import checked, checkpoint_layout, safetensors_files, wanted
from llmd.runtime.tokenizer import Tokenizer, check_vocab

from . import quality
from .awq import awq_layer, layer_products, recording, sampled

COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")
BATCH = 4             # windows a forward takes at once (as quality.predict)
TABLE_CHUNK = 8192    # rows of a float table (embedding, head) in memory at once


# ---- sources: a model's float weights, a piece at a time ---------------------------------------

def empty_layer(cfg: ModelConfig, i: int) -> DecoderLayer:
    with torch.device("meta"):
        layer = DecoderLayer(cfg, i)
    return materialize(layer, torch.float32)


class HFSource:
    """A Hugging Face directory: each tensor read from its safetensors file when its layer comes up
    (the file is mapped only while it is read, so its pages do not pile up in this process)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.config = ModelConfig.from_dir(self.path)
        self.layout = checkpoint_layout(self.config)
        self._file: dict[str, Path] = {}
        for f in safetensors_files(self.path):
            with self._open(f) as st:
                for name in st.keys():
                    if not wanted(f, name, self.config, self.layout):
                        continue
                    if name in self._file:
                        raise ModelLoadError(f"{f}: tensor {name!r} is also in another safetensors file; remove the "
                                             "stale file (a leftover model.safetensors beside shards?)")
                    self._file[name] = f
        missing = sorted(set(self.layout) - set(self._file))
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ModelLoadError(f"{self.path}: weights missing from the safetensors files: {', '.join(missing[:3])}{more}")

    @staticmethod
    def _open(f: Path):
        try:
            return safe_open(str(f), framework="pt")
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors ({e}); the file is truncated or corrupt, "
                                 "re-export or re-download it") from None

    def tensor(self, name: str, start: int | None = None, end: int | None = None) -> torch.Tensor:
        """Checkpoint tensor ``name`` (rows start:end of it) in float32, checked."""
        f, shape = self._file[name], self.layout[name][2]
        try:
            with safe_open(str(f), framework="pt") as st:
                piece = st.get_slice(name)
                if tuple(piece.get_shape()) != shape:
                    raise ModelLoadError(f"{f}: tensor {name!r} has shape {tuple(piece.get_shape())}, config.json "
                                         f"implies {shape}")
                t = piece[:] if start is None else piece[start:end]
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"{f}: cannot read tensor {name!r} ({e}); re-export or re-download the model") from None
        want = shape if start is None else (end - start, *shape[1:])
        return checked(f, name, t, want).float()

    def layer(self, i: int) -> DecoderLayer:
        layer, prefix = empty_layer(self.config, i), f"layers.{i}."
        params = dict(layer.named_parameters())
        with torch.no_grad():
            for name, (target, offset, shape) in self.layout.items():
                if target.startswith(prefix):
                    params[target[len(prefix):]][offset:offset + shape[0]].copy_(self.tensor(name))
        return layer.eval()

    def norm(self) -> torch.Tensor:
        return self.tensor("model.norm.weight")

    def table_rows(self, start: int, end: int) -> torch.Tensor:
        return self.tensor("model.embed_tokens.weight", start, end)

    def head_rows(self, start: int, end: int) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            return self.table_rows(start, end)
        return self.tensor("lm_head.weight", start, end)

    def tokenizer(self) -> Tokenizer:
        tokenizer = Tokenizer.from_dir(self.path)
        check_vocab(self.path, tokenizer, self.config)
        return tokenizer

    def write_meta(self, out: Path) -> None:
        """config.json, generation config and tokenizer files, copied unchanged."""
        out.mkdir(parents=True, exist_ok=True)
        for name in COPIED:
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, out / name)

    def hashes(self) -> dict:
        files = sorted(p for p in self.path.iterdir()
                       if p.is_file() and (p.suffix == ".safetensors" or p.name in COPIED))
        return {"path": str(self.path.resolve()), "sha256": {p.name: sha256_file(p) for p in files}}

    def release(self, i: int) -> None:
        pass


class GGUFSource:
    """A GGUF file, mapped: a layer's blocks are dequantized exactly (formats.gguf_native) when the
    layer comes up, and its mapped pages handed back once they are read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.model, self.config, self._tokenizer = load_native(self.path, progress=False)
        self._hand_back = page_releaser(self.model._gguf_map)

    def layer(self, i: int) -> DecoderLayer:
        native, layer = self.model.layers[i], empty_layer(self.config, i)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                owner, _, leaf = name.rpartition(".")
                src = native.get_submodule(owner)
                p.copy_(src.dense_weight() if leaf == "weight" and hasattr(src, "dense_weight") else getattr(src, leaf))
        return layer.eval()

    def release(self, i: int) -> None:
        """Hand back the mapped pages of layer ``i`` (re-read from the file if ever touched again)."""
        for m in self.model.layers[i].modules():
            if getattr(m, "_release", None) is not None:
                for b in m.blocks:
                    m._release(b)

    def norm(self) -> torch.Tensor:
        return self.model.norm.weight.detach()

    def table_rows(self, start: int, end: int) -> torch.Tensor:
        return self._rows(self.model.embed_tokens.table, start, end)

    def head_rows(self, start: int, end: int) -> torch.Tensor:
        return self._rows(self.model.lm_head, start, end)

    def _rows(self, table, start: int, end: int) -> torch.Tensor:
        """Rows start:end of a one-part table, dequantized; their mapped pages handed back."""
        rows = table.rows(torch.arange(start, end))
        self._hand_back(table.qweight[start:end])
        return rows

    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def write_meta(self, out: Path) -> None:
        """config.json and the tokenizer files, from the file's metadata."""
        out.mkdir(parents=True, exist_ok=True)
        f = open_gguf(self.path, reader=False)
        (out / "config.json").write_text(json.dumps(hf_config(f, "float32"), indent=1))
        for name, text in tokenizer_files(f).items():
            (out / name).write_text(text, encoding="utf-8")

    def hashes(self) -> dict:
        return {"path": str(self.path.resolve()), "sha256": {self.path.name: sha256_file(self.path)}}


def open_source(path: str | Path):
    """The float weights of the model at ``path``, a piece at a time."""
    path = Path(path)
    return GGUFSource(path) if path.is_file() and is_gguf(path) else HFSource(path)


# ---- the engine file, written as it is made -----------------------------------------------------

DTYPES = {torch.float32: "F32", torch.int8: "I8", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64"}


class TensorWriter:
    """A safetensors file written a tensor at a time: the data goes to a side file as it comes, and
    ``finish`` writes the header and the data behind it. Floats are stored as float32 (what the
    engine directory holds)."""

    def __init__(self, path: Path, metadata: dict[str, str]):
        self.path, self.metadata = Path(path), metadata
        self._data_path = self.path.with_name(self.path.name + ".data")
        self._data = open(self._data_path, "wb")
        self.index: dict[str, dict] = {}
        self._at = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        t = (t.float() if t.is_floating_point() else t).detach().contiguous()
        self._begin(name, t.dtype, tuple(t.shape))
        self._write(t)

    def add_rows(self, name: str, shape: tuple[int, int], rows) -> None:
        """A float table [n, k] from ``rows(start, end)``, a chunk at a time."""
        self._begin(name, torch.float32, shape)
        for start in range(0, shape[0], TABLE_CHUNK):
            self._write(rows(start, min(shape[0], start + TABLE_CHUNK)).float().contiguous())

    def add_module(self, prefix: str, module: nn.Module) -> None:
        for name, t in module.state_dict().items():
            self.add(prefix + name, t)

    def _begin(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if name in self.index:
            raise ValueError(f"tensor {name!r} written twice")
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        self.index[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [self._at, self._at + n]}
        self._at += n

    def _write(self, t: torch.Tensor) -> None:
        self._data.write(t.numpy().data if t.numel() else b"")

    def finish(self) -> Path:
        self._data.close()
        if self._data_path.stat().st_size != self._at:
            raise OSError(f"{self._data_path}: {self._data_path.stat().st_size} bytes written, {self._at} expected")
        header = json.dumps({"__metadata__": self.metadata, **self.index}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(data, out, 16 << 20)
        self._data_path.unlink()
        return self.path

    def discard(self) -> None:
        self._data.close()
        self._data_path.unlink(missing_ok=True)


# ---- hidden states of windows, a layer at a time -------------------------------------------------

class Stream:
    """Windows [n, T] of tokens through the layers so far: per batch of windows, the residual stream
    and the last layer's MLP output (added with the next norm, as LlamaForCausalLM._layers does)."""

    def __init__(self, windows: torch.Tensor, embed):
        self.windows = windows
        self.parts = [[x, None] for x in embed(windows).split(BATCH)]

    @torch.no_grad()
    def advance(self, layer: nn.Module, rope) -> None:
        for p in self.parts:
            p[0], p[1] = layer(p[0], rope, causal_attention, TORCH_OPS, p[1])

    @torch.no_grad()
    def hidden(self, norm: nn.Module) -> list[torch.Tensor]:
        return [TORCH_OPS.add_norm(x, pending, norm)[1] for x, pending in self.parts]


def table_lookup(rows, vocab: int):
    """embed(ids) from a float table given as ``rows(start, end)``: read a chunk of rows at a time."""
    def embed(ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = None
        for start in range(0, vocab, TABLE_CHUNK):
            end = min(vocab, start + TABLE_CHUNK)
            hit = (flat >= start) & (flat < end)
            if hit.any():
                chunk = rows(start, end)
                out = torch.empty(flat.numel(), chunk.shape[1]) if out is None else out
                out[hit] = chunk[flat[hit] - start]
        return out.view(*ids.shape, -1)
    return embed


@torch.no_grad()
def float_head_predictions(streams: list[tuple[list[torch.Tensor], torch.Tensor]], rows, vocab: int):
    """Predictions of hidden states through a float head given as ``rows(start, end)``, a chunk of the
    vocabulary at a time (the head's float copy is never whole): [(hidden batches, windows)] ->
    [quality.Predictions]."""
    state = []
    for hidden, windows in streams:
        h = torch.cat(hidden).reshape(-1, hidden[0].shape[-1])
        n = h.shape[0]
        state.append({"h": h, "w": windows, "lse": torch.full((n,), -math.inf), "best": torch.full((n,), -math.inf),
                      "arg": torch.zeros(n, dtype=torch.long), "tgt": torch.zeros(n),
                      "next": torch.cat([windows[:, 1:], windows[:, :1]], 1).reshape(-1)})
    for start in range(0, vocab, TABLE_CHUNK):
        end = min(vocab, start + TABLE_CHUNK)
        w = rows(start, end)
        for s in state:
            logits = s["h"] @ w.t()
            m, a = logits.max(1)
            better = m > s["best"]            # the first of equal maxima, as argmax over the whole
            s["best"] = torch.where(better, m, s["best"])
            s["arg"] = torch.where(better, a + start, s["arg"])
            s["lse"] = torch.logaddexp(s["lse"], torch.logsumexp(logits, 1))
            hit = (s["next"] >= start) & (s["next"] < end)
            s["tgt"][hit] = logits[hit, s["next"][hit] - start]
    out = []
    for s in state:
        b, t = s["w"].shape
        nll = (s["lse"] - s["tgt"]).view(b, t)[:, :-1]
        out.append(quality.Predictions(nll, s["arg"].view(b, t)))
    return out


@torch.no_grad()
def head_predictions(hidden: list[torch.Tensor], windows: torch.Tensor, logits) -> quality.Predictions:
    """Predictions through a head module (``logits(h)``), a window at a time: one window's logits over
    the vocabulary are in memory at once."""
    nll, top1 = [], []
    for h, w in zip(torch.cat(hidden), windows):
        n, t = quality.score(logits(h[None]), w[None])
        nll.append(n)
        top1.append(t)
    return quality.Predictions(torch.cat(nll), torch.cat(top1))


def norm_module(cfg: ModelConfig, weight: torch.Tensor) -> nn.Module:
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight = nn.Parameter(weight.float().clone(), requires_grad=False)
    return norm


def rope_for(cfg: ModelConfig, length: int):
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(cfg)
    return skeleton.rope(torch.arange(length), torch.float32)


@torch.no_grad()
def float_reference(source, windows: torch.Tensor) -> quality.Predictions:
    """The float model's predictions on ``windows``, a layer at a time: the quality gate's reference,
    computed as ``quantize_part`` computes it, for measuring another engine against the same numbers."""
    cfg = source.config
    ref = Stream(windows, table_lookup(source.table_rows, cfg.vocab_size))
    rope = rope_for(cfg, windows.shape[1])
    for i in range(cfg.num_layers):
        layer = source.layer(i)
        source.release(i)
        ref.advance(layer, rope)
        del layer
    hidden = ref.hidden(norm_module(cfg, source.norm()))
    return float_head_predictions([(hidden, windows)], source.head_rows, cfg.vocab_size)[0]


# ---- the pass that quantizes and writes -----------------------------------------------------------

class QuantizedTop:
    """A model's rounded table and head (and final norm), built from the source a chunk of rows at a
    time: what a written engine holds outside its layers."""

    def __init__(self, source, spec: QuantSpec):
        cfg = self.config = source.config
        self.spec = spec
        self.head = head_module(spec, cfg)
        if self.head is not None:
            load_rows(self.head, source.head_rows)
        self.table = None
        if not cfg.tie_word_embeddings and (table := embedding_module(spec, cfg)) is not None:
            self.table = load_rows(table, source.table_rows)
        self.norm = norm_module(cfg, source.norm())
        self._source = source

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if cfg.tie_word_embeddings and self.head is not None:
            return self.head.rows(ids.reshape(-1)).view(*ids.shape, -1)
        if self.table is not None:
            return self.table.rows(ids.reshape(-1)).view(*ids.shape, -1)
        return table_lookup(self._source.table_rows, cfg.vocab_size)(ids)

    def write(self, writer: TensorWriter) -> None:
        """The names and layout engine_dir.load_model_dir expects."""
        cfg, source = self.config, self._source
        writer.add("norm.weight", self.norm.weight)
        if self.head is not None:
            writer.add_module("lm_head.", self.head)
        elif not cfg.tie_word_embeddings:
            writer.add_rows("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), source.head_rows)
        if self.table is not None:
            writer.add_module("embed_tokens.table.", self.table)
        elif not (cfg.tie_word_embeddings and self.head is not None):
            writer.add_rows("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), source.table_rows)


def expected_tensors(cfg: ModelConfig, spec: QuantSpec) -> set[str]:
    """The tensor names an engine directory's loader expects for this model and spec."""
    with torch.device("meta"):
        model = quantize_model(LlamaForCausalLM(cfg), spec, from_weights=False)
    return set(model.state_dict())


@torch.no_grad()
def quantize_part(source, spec: QuantSpec, out: Path, *, groups: list[int], scale_search: bool,
                  eval_windows: torch.Tensor | None, calibration: torch.Tensor | None, progress) -> dict:
    """Round every layer of ``source`` and write the model into ``out`` (config, tokenizer files,
    weights.safetensors). int4 with several ``groups``: each is written to its own file and measured
    on the calibration windows against the float model; the caller's ``choose(measured)`` decides
    (see ``finish_part``). Returns {"reference": Predictions on eval_windows (None when not asked),
    "calibration_reference": on calibration, "measured": {group: Predictions on calibration},
    "writers": {group: TensorWriter}}."""
    cfg = source.config
    source.write_meta(out)
    specs = {g: _with_group(spec, g) for g in groups}
    tops = {}
    for g, s in specs.items():       # a head's form depends on the group size only when it is int4
        key = (s.head, s.group_size if s.head == "int4" else None)
        tops[g] = next((t for t in tops.values() if (t.spec.head, t.spec.group_size if t.spec.head == "int4" else None)
                        == key), None) or QuantizedTop(source, s)
    metadata = {g: {"format": "pt", "quantization": json.dumps(s.to_dict())} for g, s in specs.items()}
    writers = {g: TensorWriter(out / (WEIGHTS if len(groups) == 1 else f"{WEIGHTS}.g{g}"), metadata[g])
               for g in groups}
    try:
        float_embed = table_lookup(source.table_rows, cfg.vocab_size)
        ref = Stream(eval_windows, float_embed) if eval_windows is not None else None
        compare = len(groups) > 1
        search = scale_search and spec.method == "int4"
        cal = Stream(calibration, float_embed) if calibration is not None and (search or compare) else None
        cands = {g: Stream(calibration, tops[g].embed) for g in groups} if compare else {}
        rope_e = rope_for(cfg, eval_windows.shape[1]) if ref else None
        rope_c = rope_for(cfg, calibration.shape[1]) if cal else None
        for i in range(cfg.num_layers):
            layer = source.layer(i)
            source.release(i)
            if ref:
                ref.advance(layer, rope_e)
            inputs = None
            if cal:
                with recording(layer_products(layer)) as seen:
                    cal.advance(layer, rope_c)
                inputs = sampled(seen)
            for k, g in enumerate(groups):
                mine = layer if k == len(groups) - 1 else copy.deepcopy(layer)
                if search:
                    awq_layer(mine, dict(zip(layer_products(mine), (inputs[m] for m in layer_products(layer)))),
                              g, spec.symmetric)
                quantize_layer(mine, specs[g])
                writers[g].add_module(f"layers.{i}.", mine)
                if compare:         # through the kernels the engine runs, as the gate measures
                    for m in mine.modules():
                        if isinstance(m, QuantLinear):
                            m.prepare()
                    cands[g].advance(mine, rope_c)
                del mine
            del layer
            progress.advance()
        for g in groups:
            tops[g].write(writers[g])
        for top in {id(t): t for t in tops.values()}.values():
            if top.head is not None:        # the head as the engine runs it: never widened to float
                top.head.prepare()
        result = {"writers": writers, "measured": {}, "reference": None, "calibration_reference": None}
        float_streams = ([(ref.hidden(tops[groups[0]].norm), eval_windows)] if ref else []) + \
                        ([(cal.hidden(tops[groups[0]].norm), calibration)] if compare else [])
        refs = float_head_predictions(float_streams, source.head_rows, cfg.vocab_size) if float_streams else []
        if ref:
            result["reference"] = refs.pop(0)
        if compare:
            result["calibration_reference"] = refs.pop(0)
            for g in groups:
                top = tops[g]
                logits = top.head if top.head is not None else None
                hidden = cands[g].hidden(top.norm)
                result["measured"][g] = (head_predictions(hidden, calibration, logits) if logits is not None else
                                         float_head_predictions([(hidden, calibration)], source.head_rows,
                                                                cfg.vocab_size)[0])
        progress.advance()
        return result
    except BaseException:
        for w in writers.values():
            w.discard()
        raise


def finish_part(out: Path, result: dict, group: int, cfg: ModelConfig, spec: QuantSpec) -> None:
    """Keep the file of the chosen group size as weights.safetensors; the others are deleted."""
    for g, w in result["writers"].items():
        if g == group:
            path = w.finish()
            if path.name != WEIGHTS:
                path.replace(out / WEIGHTS)
        else:
            w.discard()
    written = set(result["writers"][group].index)
    want = expected_tensors(cfg, _with_group(spec, group))
    if written != want:
        raise RuntimeError(f"the streamed export wrote {sorted(written ^ want)[:3]} unlike what the engine loader "
                           "expects; this is a bug in llmd")


def _with_group(spec: QuantSpec, group: int) -> QuantSpec:
    return replace(spec, group_size=group)


# ---- the written weights, read back a layer at a time ----------------------------------------------

class WrittenModel:
    """A model subdirectory of an engine directory, read back a layer at a time: what the quality gate
    measures (the tensors the engine will load, through its modules)."""

    def __init__(self, path: Path, spec: QuantSpec):
        self.path, self.spec = Path(path), spec
        self.config = cfg = ModelConfig.from_dir(self.path)
        self.file = self.path / WEIGHTS
        with torch.device("meta"):
            top = LlamaForCausalLM(cfg)
            top.layers = nn.ModuleList()
        quantize_model(top, spec, from_weights=False)
        with safe_open(str(self.file), framework="pt") as st:
            top.load_state_dict({n: st.get_tensor(n) for n in st.keys() if not n.startswith("layers.")},
                                strict=True, assign=True)
        tables = {id(m.table) for m in top.modules() if isinstance(m, QuantEmbedding) and "table" in m._modules}
        for m in top.modules():
            if isinstance(m, QuantLinear):
                m.prepare(id(m) not in tables)
        self.top = top.eval()

    def layer(self, i: int) -> DecoderLayer:
        prefix = f"layers.{i}."
        with torch.device("meta"):
            layer = quantize_layer(DecoderLayer(self.config, i), self.spec, from_weights=False)
        with safe_open(str(self.file), framework="pt") as st:
            layer.load_state_dict({n[len(prefix):]: st.get_tensor(n) for n in st.keys() if n.startswith(prefix)},
                                  strict=True, assign=True)
        for m in layer.modules():
            if isinstance(m, QuantLinear):
                m.prepare()
        return layer.eval()

    @torch.no_grad()
    def predict(self, windows: torch.Tensor, progress=None) -> quality.Predictions:
        stream = Stream(windows, self.top.embed)
        rope = rope_for(self.config, windows.shape[1])
        for i in range(self.config.num_layers):
            stream.advance(self.layer(i), rope)
            if progress is not None:
                progress.advance()
        return head_predictions(stream.hidden(self.top.norm), windows, self.top.compute_logits)
