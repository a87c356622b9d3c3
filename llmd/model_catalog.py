"""The models `llmd pull NAME` knows by a short name: GGUF files on the Hugging Face Hub that editors and
assistants use, each with where it lives and what it must hash to.

A name takes Ollama's form (``qwen2.5-coder:1.5b``), so the same name serves a model from Ollama's store
where one is there and from llmd's cache once pulled. Each entry pins its content by ``sha256``; its
``revision`` is the commit to fetch, or ``main`` where no commit is pinned yet: the pull then records
the commit it resolved to. An entry without a ``sha256`` is checked against the sha256 the Hub reports
for the file (its LFS object id). ``source`` says where each pin was read.

Any other GGUF file is pulled by ``owner/repo/file.gguf[@revision]`` (with ``--sha256`` to pin it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from llmd.runtime.model_names import split_hub


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    repo: str
    file: str
    revision: str = "main"
    sha256: Optional[str] = None
    size: Optional[int] = None             # bytes, where known
    note: str = ""                         # what the model is for
    source: str = ""                       # where the sha256 was read


LOCALAI = "LocalAI's public model gallery (gallery/index.yaml)"
MODELS_REAL = "llmd's own pin (llmd/models_real.py), a file of the same size"

CATALOG = {e.name: e for e in (
    CatalogEntry("qwen2.5-coder:0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
                 "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                 sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
                 note="code completion and fill-in-the-middle, the smallest", source=MODELS_REAL),
    CatalogEntry("qwen2.5-coder:1.5b", "bartowski/Qwen2.5-Coder-1.5B-Instruct-GGUF",
                 "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
                 sha256="f530705d447660a4336c329981af164b471b60b974b1d808d57e8ec9fe23b239",
                 note="code completion and fill-in-the-middle", source=LOCALAI),
    CatalogEntry("qwen2.5-coder:3b", "bartowski/Qwen2.5-Coder-3B-Instruct-GGUF",
                 "Qwen2.5-Coder-3B-Instruct-Q4_K_M.gguf",
                 sha256="3da3afe6cf5c674ac195803ea0dd6fee7e1c228c2105c1ce8c66890d1d4ab460",
                 note="code completion and chat", source=LOCALAI),
    CatalogEntry("qwen2.5-coder:7b", "bartowski/Qwen2.5-Coder-7B-Instruct-GGUF",
                 "Qwen2.5-Coder-7B-Instruct-Q4_K_M.gguf",
                 sha256="1664fccab734674a50763490a8c6931b70e3f2f8ec10031b54806d30e5f956b6",
                 note="code chat and completion, the largest", source=LOCALAI),
    CatalogEntry("llama3.2:1b", "hugging-quants/Llama-3.2-1B-Instruct-Q4_K_M-GGUF", "llama-3.2-1b-instruct-q4_k_m.gguf",
                 sha256="1d0e9419ec4e12aef73ccf4ffd122703e94c48344a96bc7c5f0f2772c2152ce3",
                 note="chat, multilingual", source=LOCALAI),
    CatalogEntry("llama3.2:3b", "hugging-quants/Llama-3.2-3B-Instruct-Q4_K_M-GGUF", "llama-3.2-3b-instruct-q4_k_m.gguf",
                 sha256="c55a83bfb6396799337853ca69918a0b9bbb2917621078c34570bc17d20fd7a1",
                 note="chat, multilingual", source=LOCALAI),
    CatalogEntry("smollm2:135m", "bartowski/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct-Q4_K_M.gguf",
                 note="chat, tiny: tests and slow machines"),
    CatalogEntry("smollm2:360m", "bartowski/SmolLM2-360M-Instruct-GGUF", "SmolLM2-360M-Instruct-Q4_K_M.gguf",
                 note="chat, small"),
    CatalogEntry("smollm2:1.7b", "HuggingFaceTB/SmolLM2-1.7B-Instruct-GGUF", "smollm2-1.7b-instruct-q4_k_m.gguf",
                 sha256="decd2598bc2c8ed08c19adc3c8fdd461ee19ed5708679d1c54ef54a5a30d4f33",
                 note="chat", source=LOCALAI),
)}


class CatalogError(ValueError):
    """A name that is neither in the catalogue nor ``owner/repo/file.gguf``."""


def lookup(spec: str, sha256: Optional[str] = None, name: Optional[str] = None) -> CatalogEntry:
    """The entry ``spec`` names: a catalogue name (``:latest`` may be left off only where the catalogue has
    it), or ``owner/repo/file.gguf[@revision]``. ``sha256`` and ``name`` override the entry's."""
    entry = CATALOG.get(spec)
    if entry is None:
        hub = split_hub(spec)
        if hub is None:
            raise CatalogError(f"{spec}: not a name llmd knows ({', '.join(CATALOG)}) nor a Hub file "
                               "owner/repo/file.gguf[@revision]; `llmd pull --list` shows the catalogue")
        repo, file, revision = hub
        stem = file.rsplit("/", 1)[-1][:-len(".gguf")]
        entry = CatalogEntry(stem.lower(), repo, file, revision or "main")
    if sha256 is not None:
        entry = replace(entry, sha256=sha256.lower(), source="--sha256")
    return replace(entry, name=name) if name else entry


def catalog_table() -> str:
    rows = [("NAME", "REPO / FILE", "SHA256", "FOR")]
    rows += [(e.name, f"{e.repo}/{e.file}", (e.sha256 or "(the Hub's)")[:16], e.note)
             for e in CATALOG.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows)
