"""Write manifest.json, last, once an engine directory's files are in place (the format and its
reader: llmd.runtime.formats.manifest)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from llmd import __version__
from llmd.runtime.formats.manifest import FORMAT, FORMAT_VERSION, MANIFEST, sha256_file


def hash_tree(root: Path) -> dict[str, dict]:
    """Every regular file under root except the manifest: relative path -> sha256 and size."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            out[p.relative_to(root).as_posix()] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    return out


def write_manifest(root: Path, fields: dict) -> dict:
    """Hash the directory's files and write manifest.json (atomically, last)."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "llmd_version": __version__,
                "torch_version": torch.__version__, **fields, "files": hash_tree(root)}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    tmp.replace(root / MANIFEST)
    return manifest
