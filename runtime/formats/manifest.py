"""manifest.json of an engine directory: what it holds, how it was made, and a hash of every file.

    ENGINE/
      manifest.json          this file's contents (below); written last, so its presence means complete
      target/                config.json, tokenizer files, weights.safetensors (quantized tensors)
      draft/                 the same for the draft model (optional)
      onnx/, aot/            backend artifacts (optional)

    {"format": "llmd-engine", "format_version": 1, "llmd_version": "0.1.0", "torch_version": "...",
     "backend": "torch" | "onnxruntime" | "tensorrt",
     "quantization": {QuantSpec fields},
     "models": {"target": {"dir": "target", "source": {"path": ..., "sha256": {file: hash}}}, "draft": {...}},
     "tokenizer": {"dir": "target", "files": [...]},
     "shape_buckets": {"batch": [...], "tokens": [...]},
     "artifacts": {"onnx": "onnx/target.onnx", "onnx_quantization": "how its products are quantized", ...},
     "quality": {..., "measured_on": "onnxruntime graph" | "aot decode package (...)" | "torch weights"},
     "files": {"target/weights.safetensors": {"sha256": "...", "bytes": 123}, ...}}

Every file listed under "files" must exist with that size and hash. The format version is the
compatibility key: any other version is refused (re-export with this llmd).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import EngineDirError

FORMAT = "llmd-engine"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(root: Path, verify_hashes: bool = True) -> dict:
    """Parse and check manifest.json; raises EngineDirError naming the problem and the fix."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise EngineDirError(f"{root}: no {MANIFEST}; this is not an llmd engine directory (or the export did "
                             "not finish): run `llmd export` again")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineDirError(f"{path}: not valid JSON ({e}); the engine directory is damaged, re-export it") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise EngineDirError(f"{path}: not an llmd engine manifest (format is not {FORMAT!r})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineDirError(f"{path}: engine format version {version!r} (written by llmd "
                             f"{manifest.get('llmd_version', '?')}); this llmd reads version {FORMAT_VERSION}: "
                             "re-export the model with this llmd")
    for key in ("models", "quantization", "backend", "files"):
        if not isinstance(manifest.get(key), dict if key != "backend" else str):
            raise EngineDirError(f"{path}: field {key!r} is missing or malformed")
    check_files(Path(root), manifest["files"], verify_hashes)
    return manifest


def check_files(root: Path, files: dict, verify_hashes: bool) -> None:
    for name, entry in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise EngineDirError(f"{root / MANIFEST}: file entry {name!r} points outside the engine directory")
        if not isinstance(entry, dict):
            raise EngineDirError(f"{root / MANIFEST}: file entry {name!r} is malformed; re-export")
    # Everything the export wrote is listed: a file added since could be read unverified.
    extra = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.name != MANIFEST and p.relative_to(root).as_posix() not in files)
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        raise EngineDirError(f"{root}: files the manifest does not list: {', '.join(extra[:3])}{more}; they were "
                             "added after export: remove them or re-export")
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise EngineDirError(f"{root}: incomplete engine directory, missing {', '.join(missing[:3])}{more}; "
                             "re-export it")
    for name, entry in files.items():
        p = root / name
        if p.stat().st_size != entry.get("bytes"):
            raise EngineDirError(f"{p}: size {p.stat().st_size} bytes, the manifest says {entry.get('bytes')}; "
                                 "the file was changed or truncated after export: re-export")
        if verify_hashes and sha256_file(p) != entry.get("sha256"):
            raise EngineDirError(f"{p}: sha256 does not match the manifest; the file was modified after export "
                                 "(tampered or corrupted): re-export")
