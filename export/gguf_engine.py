"""`llmd import FILE.gguf --out DIR --keep-blocks`: a GGUF file written as an llmd engine directory whose
quantized tensors keep the file's blocks (llmd.runtime.formats.gguf_blocks says which types map to
which llmd layout, and why the values are the same numbers).

Each tensor takes one route: its blocks as int8g or int4 (checked, per tensor, to dequantize to the
`gguf` package's float32 values), or float32 (1-D tensors, types without an llmd form, a check that
failed). llmd runs q, k and v as one module, and gate and up as another, so their parts must share a
form: int4 parts of one group stay int4, int8g parts (and int4 parts without offsets) become int8g with
the smallest group, and anything else makes the whole module float32. The quantization is "mixed":
the manifest's module table names each module's form.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from llmd.runtime.formats.engine_dir import WEIGHTS, load_model_dir
from llmd.runtime.formats.gguf import hf_config, open_gguf, tensor_values
from llmd.runtime.formats.gguf_blocks import Blocks, DECODERS, common_form, exact_form
from llmd.runtime.formats.gguf_check import GGUFError
from llmd.runtime.formats.gguf_import import check_complete, check_tensor, file_sha256, model_layout
from llmd.runtime.formats.gguf_tokenizer import tokenizer_files
from llmd.runtime.formats.quantized import QuantSpec, pack_nibbles

from .manifest import write_manifest
from .whole_dir import write_whole


def import_engine(path: str | Path, out: str | Path, progress: bool = True) -> dict:
    """Write the engine directory ``out`` (must not exist or be empty) from the GGUF file ``path``.
    Returns the summary: the route of every tensor type, sizes, the module table."""
    path, out = Path(path), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GGUFError(f"{out}: exists and is not empty; choose a new directory for the import")
    f = open_gguf(path)
    cfg = hf_config(f, "float32")
    files = tokenizer_files(f)                   # refuses an unsupported tokenizer before the slow part
    layout = model_layout(path, cfg)
    tied = cfg["tie_word_embeddings"]
    parts: dict[str, list] = defaultdict(list)      # llmd tensor name -> [(row offset, Blocks | float32 values)]
    kept: list[tuple[str, str, str]] = []            # (GGUF type, llmd tensor name, why not kept or "")
    seen = []
    for t, name, values, order in tensor_values(f, cfg, progress, desc="reading", as_checkpoint=False):
        check_tensor(path, cfg, layout, name, values.shape)
        seen.append(name)
        target, offset, _ = layout[name]
        kind = t.tensor_type.name
        form, why = None, "1-D" if values.ndim == 1 else f"{kind} has no llmd form"
        if values.ndim == 2 and kind in DECODERS:
            form, why = exact_form(kind, t.data, values.shape, values, order)
        if tied and target == "embed_tokens.weight":       # the table is the head: a quantized one is lm_head's
            target = "lm_head.weight"
        kept.append((kind, target, "" if form is not None else why))
        parts[target].append((offset, form if form is not None else values))
    check_complete(path, cfg, layout, seen)
    state, modules, demoted = assemble(parts)
    routes = Counter((kind, f"float32 ({why})" if why else modules.get(target.rsplit(".", 1)[0]) or
                      "float32 (fused with parts that share no llmd form)") for kind, target, why in kept)
    if tied and "lm_head" not in modules:         # a float table stays the embedding
        state["embed_tokens.weight"] = state.pop("lm_head.weight")
    spec = QuantSpec("mixed", head=_head(modules.get("lm_head", "float")),
                     embed="int8" if "embed_tokens" in modules else "float", modules=modules)
    sha = file_sha256(path, progress)
    summary = {"routes": [{"type": k, "route": r, "tensors": n} for (k, r), n in sorted(routes.items())],
               "demoted_modules": demoted, "gguf_bytes": path.stat().st_size, "gguf_sha256": sha}

    def write(tmp: Path) -> dict:
        target = tmp / "target"
        target.mkdir()
        (target / "config.json").write_text(json.dumps(cfg, indent=1))
        for name, text in files.items():
            (target / name).write_text(text, encoding="utf-8")
        save_file(state, str(target / WEIGHTS), metadata={"format": "pt", "quantization": json.dumps(spec.to_dict())})
        load_model_dir(target, spec)         # the reader's own strict check of names, shapes and dtypes
        summary["engine_bytes"] = (target / WEIGHTS).stat().st_size
        write_manifest(tmp, {"backend": "torch", "quantization": spec.to_dict(), "shape_buckets": {},
                             "models": {"target": {"dir": "target", "source": {"path": str(path.resolve()),
                                                                                "sha256": {path.name: sha}}}},
                             "tokenizer": {"dir": "target", "files": sorted(p.name for p in target.glob("tokenizer*"))},
                             "gguf_import": summary})
        return summary
    return write_whole(out, write)


def assemble(parts: dict[str, list]) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """llmd's tensors from the parts of each module: (state dict, module table, modules made float32
    because their parts had no common form)."""
    state, modules, demoted = {}, {}, []
    for name, pieces in parts.items():
        pieces = [p for _, p in sorted(pieces, key=lambda x: x[0])]
        module, leaf = name.rsplit(".", 1)
        if leaf == "weight":
            forms = common_form([p if isinstance(p, Blocks) else None for p in pieces])
            if forms is not None:
                key = "embed_tokens.table" if module == "embed_tokens" else module
                state.update(_quantized(key, forms))
                modules[module] = forms[0].form
                continue
            if any(isinstance(p, Blocks) for p in pieces):
                demoted.append(module)
            pieces = [p.dequantize() if isinstance(p, Blocks) else p for p in pieces]
        state[name] = torch.from_numpy(np.ascontiguousarray(np.concatenate(pieces)))
    return state, modules, demoted


def _quantized(key: str, forms: list[Blocks]) -> dict[str, torch.Tensor]:
    q = torch.from_numpy(np.concatenate([f.q for f in forms]))
    out = {f"{key}.qweight": pack_nibbles(q) if forms[0].kind == "int4" else q.contiguous(),
           f"{key}.scales": torch.from_numpy(np.concatenate([f.scales for f in forms]))}
    if forms[0].kind == "int4":
        out[f"{key}.zeros"] = torch.from_numpy(np.concatenate([f.zeros for f in forms]))
    return out


def _head(form: str) -> str:
    return form.split("/")[0]


def route_table(summary: dict) -> str:
    """The route of every tensor type, as printed by `llmd import --keep-blocks`."""
    rows = [("GGUF type", "tensors", "llmd form")] + [(r["type"], str(r["tensors"]), r["route"])
                                                      for r in summary["routes"]]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{a:<{w[0]}}  {b:>{w[1]}}  {c}" for a, b, c in rows]
    if summary["demoted_modules"]:
        lines.append(f"float32 because their parts share no form: {', '.join(summary['demoted_modules'])}")
    lines.append(f"engine weights {summary['engine_bytes'] / 2**20:.1f} MiB, GGUF file "
                 f"{summary['gguf_bytes'] / 2**20:.1f} MiB")
    return "\n".join(lines)
