"""Ollama's local model store, read in place: a name finds its manifest, the manifest its GGUF blob.

    <store>/manifests/<host>/<namespace>/<model>/<tag>    JSON: {"layers": [{"mediaType", "digest", "size"}, ...]}
    <store>/blobs/sha256-<hex>                             the layer of mediaType MODEL_LAYER is a GGUF file

A name is ``[[host/]namespace/]model[:tag]``: the host defaults to registry.ollama.ai, the namespace
to library, the tag to latest. The store is ``$OLLAMA_MODELS``, else ``~/.ollama/models``, else the
Linux service's ``/usr/share/ollama/.ollama/models``. Nothing here writes to the store.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL_LAYER = "application/vnd.ollama.image.model"
SYSTEM_STORE = Path("/usr/share/ollama/.ollama/models")
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")          # a namespace, model or tag
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(:[0-9]+)?")
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class OllamaName:
    host: str
    namespace: str
    model: str
    tag: str

    @property
    def short(self) -> str:
        """The name as Ollama prints it: host and namespace only where they are not the defaults."""
        prefix = "" if self.host == DEFAULT_HOST else f"{self.host}/"
        if prefix or self.namespace != DEFAULT_NAMESPACE:
            prefix += f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"

    def manifest(self, store: Path) -> Path:
        return store / "manifests" / self.host / self.namespace / self.model / self.tag


@dataclass(frozen=True)
class OllamaModel:
    name: str                      # OllamaName.short
    path: Path                     # the GGUF blob
    size: int
    store: Path


def parse_name(text: str) -> Optional[OllamaName]:
    """The parts of an Ollama model name, or None where ``text`` cannot be one (no path escapes the store)."""
    base, tag = text, DEFAULT_TAG
    if ":" in text.rsplit("/", 1)[-1]:
        base, tag = text.rsplit(":", 1)
    parts = base.split("/")
    if len(parts) > 3 or not _PART.fullmatch(tag) or not all(_PART.fullmatch(p) for p in parts[-2:]):
        return None
    if len(parts) == 3 and not _HOST.fullmatch(parts[0]):
        return None
    host = parts[0] if len(parts) == 3 else DEFAULT_HOST
    namespace = parts[-2] if len(parts) >= 2 else DEFAULT_NAMESPACE
    return OllamaName(host, namespace, parts[-1], tag)


def store_dirs() -> list[Path]:
    """Where Ollama keeps its models: ``$OLLAMA_MODELS`` alone when set, else those of the two usual
    places that exist."""
    env = os.environ.get("OLLAMA_MODELS")
    if env:
        return [Path(env).expanduser()]
    return [d for d in (Path.home() / ".ollama" / "models", SYSTEM_STORE) if d.is_dir()]


def find(text: str) -> Optional[OllamaModel]:
    """The model ``text`` names in the first store that has it, else None."""
    name = parse_name(text)
    if name is None:
        return None
    for store in store_dirs():
        for candidate in dict.fromkeys((name, OllamaName(*(p.lower() for p in (name.host, name.namespace,
                                                                                 name.model, name.tag))))):
            model = read_manifest(store, candidate)
            if model is not None:
                return model
    return None


def read_manifest(store: Path, name: OllamaName) -> Optional[OllamaModel]:
    """The GGUF blob a manifest points to, where the manifest and the blob both exist."""
    try:
        manifest = json.loads(name.manifest(store).read_text())
    except (OSError, ValueError):
        return None
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    for layer in layers if isinstance(layers, list) else []:
        if isinstance(layer, dict) and layer.get("mediaType") == MODEL_LAYER:
            m = _DIGEST.fullmatch(str(layer.get("digest", "")))
            blob = store / "blobs" / f"sha256-{m.group(1)}" if m else None
            if blob is not None and blob.is_file():
                return OllamaModel(name.short, blob, blob.stat().st_size, store)
    return None


def list_models() -> Iterator[OllamaModel]:
    """Every model of every store whose blob is present, by name."""
    for store in store_dirs():
        root = store / "manifests"
        for tag in sorted(root.glob("*/*/*/*")):
            if tag.is_file():
                host, namespace, model = tag.relative_to(root).parts[:3]
                found = read_manifest(store, OllamaName(host, namespace, model, tag.name))
                if found is not None:
                    yield found
