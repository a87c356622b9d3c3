"""What a model argument names: a path, or a model by name, found on this machine without the network.

`resolve_model` answers, in this order (the first that has it wins):
  1. an existing file or directory, as given;
  2. llmd's cache: a model `llmd pull` fetched, by its name (``qwen2.5-coder:1.5b``, a name without a
     tag also as ``:latest``) or by its source ``repo/file``; or a GGUF file in the cache by file name;
  3. Ollama's store: ``[[host/]namespace/]model[:tag]`` (formats/ollama_store.py), its blob used in place;
  4. the Hub's cache (huggingface_hub's, read only): ``owner/repo/file.gguf[@revision]``.
A name found nowhere is refused with what to do; a text that is plainly a path (``/``, ``./``, ``~``,
``model.gguf``) goes on as given, for the loader to say what is missing there.

llmd's cache (``$LLMD_MODELS``, else ``$XDG_CACHE_HOME/llmd/models``, else ``~/.cache/llmd/models``):
    <cache>/<slug>/llmd-model.json     a `PulledModel`, written once the file's sha256 matched
    <cache>/<slug>/<file>.gguf         the model
    <cache>/*.gguf                     files placed there by other means (`llmd models-real`)
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator, Optional

from .config import EngineConfig
from .errors import ModelLoadError
from .formats import ollama_store
from .formats.gguf_import import cache_root

RECORD = "llmd-model.json"
NOT_MODELS = ("ngram", "auto", "none")         # draft values that name no model
PATH_PREFIXES = ("/", "./", "../", "~")         # a text that starts so is a path, never a name


class ModelNotFound(ModelLoadError):
    """A model name found in no store; says what to do."""


@dataclass(frozen=True)
class PulledModel:
    name: str                      # the short name it resolves by
    repo: str                      # where it came from on the Hub
    file: str
    revision: str                  # the commit it was pulled at
    sha256: str
    size: int
    path: str = ""                 # set when read: the GGUF file

    @property
    def source(self) -> str:
        return f"{self.repo}/{self.file}"


def models_dir() -> Path:
    env = os.environ.get("LLMD_MODELS")
    return Path(env).expanduser() if env else cache_root().parent / "models"


def slug(name: str) -> str:
    """The folder of a pulled model in llmd's cache."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".") or "_"


def write_record(folder: Path, model: PulledModel) -> None:
    fields = {k: v for k, v in asdict(model).items() if k != "path"}
    tmp = folder / (RECORD + ".tmp")
    tmp.write_text(json.dumps(fields, indent=1))
    tmp.replace(folder / RECORD)


def read_record(folder: Path) -> Optional[PulledModel]:
    try:
        fields = json.loads((folder / RECORD).read_text())
        model = PulledModel(**{k: fields[k] for k in ("name", "repo", "file", "revision", "sha256", "size")})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    path = folder / model.file
    return replace(model, path=str(path)) if path.is_file() else None


def pulled_models() -> Iterator[PulledModel]:
    root = models_dir()
    for record in sorted(root.glob(f"*/{RECORD}")):
        model = read_record(record.parent)
        if model is not None:
            yield model


def loose_files() -> list[Path]:
    """GGUF files in llmd's cache that no pull recorded."""
    return sorted(p for p in models_dir().glob("*.gguf") if p.is_file())


def find_pulled(text: str) -> Optional[PulledModel]:
    wanted = {text, text + ":latest"} if ":" not in text.rsplit("/", 1)[-1] else {text}
    source, _, revision = text.partition("@")
    for model in pulled_models():
        if model.name in wanted or (model.source == source and revision in ("", model.revision)):
            return model
    return None


def find_in_cache(text: str) -> Optional[Path]:
    """llmd's cache: a pulled model by name or source, or a loose GGUF file by file name."""
    model = find_pulled(text)
    if model is not None:
        return Path(model.path)
    loose = models_dir() / text
    return loose if "/" not in text and loose.suffix == ".gguf" and loose.is_file() else None


def split_hub(text: str) -> Optional[tuple[str, str, Optional[str]]]:
    """``owner/repo/path/file.gguf[@revision]`` -> (repo, file, revision), else None."""
    spec, _, revision = text.partition("@")
    parts = spec.split("/")
    if len(parts) < 3 or not parts[-1].lower().endswith(".gguf") or any(p in ("", ".", "..") for p in parts):
        return None
    return "/".join(parts[:2]), "/".join(parts[2:]), revision or None


def find_in_ollama(text: str) -> Optional[Path]:
    found = ollama_store.find(text)
    return found.path if found is not None else None


def find_in_hub_cache(text: str) -> Optional[Path]:
    hub = split_hub(text)
    if hub is None:
        return None
    from huggingface_hub import try_to_load_from_cache     # local files only; imported where a Hub name is given
    try:
        found = try_to_load_from_cache(hub[0], hub[1], cache_dir=hub_cache_dir(), revision=hub[2])
    except ValueError:                                     # not a valid repository id
        return None
    return Path(found) if isinstance(found, str) else None


def hub_cache_dir() -> Optional[str]:
    """huggingface_hub's cache as the environment names it now (None: its default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None


def resolve_model(text: str) -> str:
    """The path ``text`` names (see the module's docstring for the order); raises ModelNotFound."""
    if not text or text.startswith(PATH_PREFIXES) or Path(text).exists():
        return text
    for find in (find_in_cache, find_in_ollama, find_in_hub_cache):
        path = find(text)
        if path is not None:
            return str(path)
    if text.lower().endswith(".gguf") and split_hub(text) is None:    # a file name, not a Hub name
        return text
    raise ModelNotFound(not_found_message(text))


def not_found_message(text: str) -> str:
    stores = ", ".join(str(s) for s in ollama_store.store_dirs()) or "none found; $OLLAMA_MODELS names one"
    return (f"{text}: no such file or directory, and no model of that name in llmd's cache ({models_dir()}), "
            f"Ollama's store ({stores}) or the Hub's cache; `llmd list` shows the models on this machine, "
            f"`llmd pull {text}` downloads one (`llmd pull --list` shows the names it knows), and a model "
            "directory or GGUF file may be given by its path")


def resolve_config(config: EngineConfig) -> EngineConfig:
    """``config`` with its model and draft as paths."""
    draft = config.draft
    if draft and draft not in NOT_MODELS:
        draft = resolve_model(draft)
    return replace(config, model=resolve_model(config.model), draft=draft)
