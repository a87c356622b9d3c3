"""`llmd pull`, `llmd list` and `llmd rm`: the models on this machine, by name.

`list` reads three places, none over the network: llmd's cache, Ollama's store and the Hub's cache
(its GGUF files). `rm` deletes from llmd's cache only; Ollama's store and the Hub's cache belong to
their own tools, and `rm` says which command removes a model there.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from llmd.model_catalog import CatalogError, catalog_table, lookup
from llmd.pull import PullError, pull
from llmd.runtime.formats import ollama_store
from llmd.runtime.formats.gguf_check import GGUFError, read_header
from llmd.runtime.model_names import find_pulled, hub_cache_dir, loose_files, models_dir, pulled_models


@dataclass(frozen=True)
class Listed:
    name: str
    size: int
    kind: str                      # architecture and quantization, from the GGUF header
    source: str                    # llmd, ollama or hub
    path: str


def add_models_parsers(sub) -> None:
    p = sub.add_parser("pull", help="download a GGUF model from the Hugging Face Hub into llmd's cache",
                       description="Download NAME (a name from llmd's catalogue, e.g. qwen2.5-coder:1.5b, or any "
                       "GGUF file as owner/repo/file.gguf[@revision]) into llmd's cache, at a pinned commit, and "
                       "check its sha256; afterwards --model NAME finds it. The only command that uses the "
                       "network (HF_ENDPOINT names a mirror, HF_TOKEN a login for gated repositories).")
    p.add_argument("name", nargs="?", help="catalogue name or owner/repo/file.gguf[@revision]")
    p.add_argument("--sha256", help="the sha256 the file must have (default: the catalogue's pin, else the sha256 "
                   "the Hub reports for the file)")
    p.add_argument("--name", dest="as_name", metavar="SHORT", help="the name to serve it by (default: the catalogue "
                   "name, or the file's name without .gguf, lowercased)")
    p.add_argument("--list", action="store_true", help="print the catalogue and exit")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run_pull)
    p = sub.add_parser("list", help="list the models on this machine: llmd's cache, Ollama's store, the Hub's cache",
                       description="List every model --model NAME can find without the network, with its size, "
                       "architecture and quantization (from the GGUF header), where it comes from and its path.")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.set_defaults(func=run_list)
    p = sub.add_parser("rm", help="remove a model from llmd's cache",
                       description="Delete NAME's files from llmd's cache (what `llmd pull` wrote, or a GGUF file "
                       "placed there). Asks nothing. Never touches Ollama's store or the Hub's cache: for a "
                       "model found only there, it says which command removes it.")
    p.add_argument("name", help="the name `llmd list` shows for it")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.set_defaults(func=run_rm)


def run_pull(args) -> int:
    if args.list or not args.name:
        print(catalog_table())
        return 0 if args.list else 2
    try:
        entry = lookup(args.name, args.sha256, args.as_name)
        model = pull(entry, progress=not args.quiet)
    except (CatalogError, PullError) as e:
        print(f"llmd pull: {e}", file=sys.stderr)
        return 2
    print(f"{model.name}: {model.path}\n  {model.repo}/{model.file} at {model.revision}, sha256 {model.sha256}")
    return 0


def run_list(args) -> int:
    rows = list(available())
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
        return 0
    if not rows:
        print(f"no models yet: `llmd pull NAME` downloads one (`llmd pull --list`); llmd also finds Ollama's "
              f"models ($OLLAMA_MODELS) and GGUF files in the Hub's cache")
        return 0
    table = [("NAME", "SIZE", "TYPE", "FROM", "PATH")] + [(r.name, human(r.size), r.kind, r.source, r.path)
                                                          for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(4)]
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t[:4], widths)) + "  " + t[4])
    return 0


def available() -> Iterator[Listed]:
    for m in pulled_models():
        yield Listed(m.name, m.size, gguf_kind(m.path), "llmd", m.path)
    for p in loose_files():
        yield Listed(p.name, p.stat().st_size, gguf_kind(p), "llmd", str(p))
    for m in ollama_store.list_models():
        yield Listed(m.name, m.size, gguf_kind(m.path), "ollama", str(m.path))
    for name, path, size in hub_files():
        yield Listed(name, size, gguf_kind(path), "hub", str(path))


def hub_files() -> Iterator[tuple[str, Path, int]]:
    """Every GGUF file in the Hub's cache, as owner/repo/file (the snapshot ``main`` points to) or
    owner/repo/file@commit: the names `--model` resolves."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound
    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        for rev in sorted(repo.revisions, key=lambda r: r.commit_hash):
            for f in sorted(rev.files, key=lambda f: f.file_name):
                rel = f.file_path.relative_to(rev.snapshot_path).as_posix()
                if repo.repo_type == "model" and rel.lower().endswith(".gguf"):
                    at = "" if "main" in rev.refs else f"@{rev.commit_hash}"
                    yield f"{repo.repo_id}/{rel}{at}", f.file_path, f.size_on_disk


def gguf_kind(path) -> str:
    """``architecture quantization`` from a GGUF header, or ``?`` where it cannot be read."""
    import gguf
    try:
        spans, meta = read_header(path, {int(t): s for t, s in gguf.GGML_QUANT_SIZES.items()})
    except GGUFError:
        return "?"
    arch = meta.get("general.architecture", (None, "?"))[1]
    ftype = meta.get("general.file_type", (None, None))[1]
    try:
        quant = gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:                 # no file type written: the type holding the most bytes
        weight: dict[int, int] = {}
        for s in spans:
            weight[s.type] = weight.get(s.type, 0) + s.nbytes
        quant = gguf.GGMLQuantizationType(max(weight, key=weight.get)).name if weight else ""
    return f"{arch} {quant}".strip()


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def run_rm(args) -> int:
    targets = removal(args.name)
    if not targets:
        print(f"llmd rm: {args.name}: {elsewhere(args.name)}", file=sys.stderr)
        return 2
    for t in targets:
        print(f"{'would remove' if args.dry_run else 'removed'} {t}")
        if not args.dry_run:
            shutil.rmtree(t) if t.is_dir() else t.unlink()
    return 0


def removal(name: str) -> list[Path]:
    """What `rm NAME` deletes: a pulled model's folder, or a loose GGUF file with its stamp."""
    model = find_pulled(name)
    if model is not None:
        folder = models_dir() / Path(model.path).relative_to(models_dir()).parts[0]
        return [folder]
    loose = models_dir() / name
    if "/" not in name and loose in loose_files():
        stamp = loose.with_name(loose.name + ".verified")
        return [loose] + ([stamp] if stamp.is_file() else [])
    return []


def elsewhere(name: str) -> str:
    found = ollama_store.find(name)
    if found is not None:
        return (f"not in llmd's cache; it is in Ollama's store ({found.path}), which llmd does not change: "
                f"`ollama rm {found.name}` removes it")
    if any(n == name or n.startswith(name + "@") for n, _, _ in hub_files()):
        return "not in llmd's cache; it is in the Hub's cache, which llmd does not change: `hf cache` manages it"
    return f"no such model in llmd's cache ({models_dir()}); `llmd list` shows the models"
