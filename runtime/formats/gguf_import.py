"""Turn a GGUF file into a Hugging Face model directory llmd loads like any other:
config.json, model.safetensors (float32 or bfloat16), tokenizer.json, tokenizer_config.json (with
the chat template) and generation_config.json.

`imported_dir` keeps one import per file content and dtype under the cache
(``$XDG_CACHE_HOME/llmd/gguf/<sha256>-<dtype>``, else ``~/.cache/llmd/gguf``), so `--model FILE.gguf`
reads and converts a file once. A directory appears there only complete: it is written beside its
final name and renamed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ModelLoadError
from ..models.config import ModelConfig
from ..models.loader import checkpoint_layout

from .gguf import hf_config, open_gguf, read_tensors
from .gguf_check import GGUFError, is_gguf_file
from .gguf_tokenizer import tokenizer_files

SOURCE_FILE = "gguf_source.json"          # which file a directory was imported from


def is_gguf(path: str | Path) -> bool:
    """A GGUF file by its name, or by its first bytes (an Ollama blob has no extension)."""
    return str(path).lower().endswith(".gguf") or is_gguf_file(path)


def import_gguf(path: str | Path, out: str | Path, dtype: str = "float32", progress: bool = True) -> Path:
    """Write the model in ``path`` as a Hugging Face directory ``out`` (created; must not exist)."""
    from safetensors.torch import save_file
    path, out = Path(path), Path(out)
    if out.exists() and any(out.iterdir()):
        raise GGUFError(f"{out}: exists and is not empty; choose a new directory for the import")
    f = open_gguf(path)
    cfg = hf_config(f, dtype)
    files = tokenizer_files(f)                   # refuses an unsupported tokenizer before the slow part
    layout = model_layout(path, cfg)
    tensors = {}
    for name, t in read_tensors(f, cfg, dtype, progress):
        check_tensor(path, cfg, layout, name, tuple(t.shape))
        tensors[name] = t
    check_complete(path, cfg, layout, tensors)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    (out / SOURCE_FILE).write_text(json.dumps({"file": str(path.resolve()), "bytes": path.stat().st_size,
                                               "dtype": dtype}, indent=1))
    return out


def model_layout(path: Path, cfg: dict) -> dict:
    """checkpoint name -> (llmd name, row offset, shape) for the model the metadata describes."""
    try:
        return checkpoint_layout(ModelConfig.from_dict(cfg, source=f"{path} (metadata)"))
    except ModelLoadError as e:
        raise GGUFError(str(e)) from None


def check_tensor(path: Path, cfg: dict, layout: dict, name: str, shape: tuple) -> None:
    """A tensor of the file is one the metadata's model has, with the shape it implies."""
    if name not in layout:
        raise GGUFError(f"{path}: tensor {name} is not part of this {cfg['model_type']} model (tie_word_embeddings "
                        f"{cfg['tie_word_embeddings']}, {cfg['num_hidden_layers']} layers)")
    if shape != layout[name][2]:
        raise GGUFError(f"{path}: tensor {name} has shape {list(shape)} but the metadata implies "
                        f"{list(layout[name][2])}")


def check_complete(path: Path, cfg: dict, layout: dict, seen) -> None:
    missing = sorted(set(layout) - set(seen))
    if missing:
        raise GGUFError(f"{path}: tensors missing for the metadata's {cfg['model_type']} model, e.g. {missing[0]}")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmd" / "gguf"


def file_sha256(path: Path, progress: bool = True) -> str:
    from tqdm import tqdm
    h = hashlib.sha256()
    with open(path, "rb") as fh, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, leave=False,
                                      desc=f"hashing {path.name}", disable=not progress) as bar:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def imported_dir(path: str | Path, dtype: str = "float32", progress: bool = True) -> Path:
    """The cached import of ``path`` (made now if absent), keyed by the file's sha256 and ``dtype``."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    final = cache_root() / f"{file_sha256(path, progress)}-{dtype}"
    if (final / "config.json").is_file() and (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=final.parent))
    try:
        import_gguf(path, work, dtype, progress)
        try:
            work.rename(final)
        except OSError:                  # another process finished the same import first
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def resolve_model_path(path: str | Path, dtype: str = "float32", progress: bool = True) -> str:
    """A model path as given, or for a .gguf file the directory of its cached import."""
    return str(imported_dir(path, dtype, progress)) if is_gguf(path) else str(path)


def source_gguf(model_dir: str | Path) -> Path | None:
    """The GGUF file a directory was imported from, while that file is still there unchanged in size."""
    try:
        source = json.loads((Path(model_dir) / SOURCE_FILE).read_text())
        path = Path(source["file"])
        return path if path.is_file() and path.stat().st_size == source["bytes"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
