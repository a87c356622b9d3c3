"""llama.cpp's quantization of the same model, measured on the export gate's own token windows, so an
export's summary can print its figures beside llama.cpp's for the same format.

Two programs of one llama.cpp build do the work: its ``llama-quantize`` (the GGUF the model came from,
quantized again to the format compared; ``--allow-requantize``, since a shipped GGUF is often already
quantized) and llmd's ``llama-windows`` (``bench/llama_windows.cpp``: token windows teacher-forced
through llama.cpp's library, returning each position's next-token NLL and top-1 id).
``bench/build_llama_server.sh`` builds both from the source vendored in llama-cpp-python's source
distribution. They are looked for in ``$LLMD_LLAMA_CPP`` (a folder), then in that script's ``bin``
folder (``$LLMD_LLAMA_SERVER_DIR``, else a source checkout's ``.cache/llama-server``), then on PATH. Nothing here listens on a socket.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmd.runtime.formats.gguf_import import cache_root, file_sha256

from .quality import Predictions

# llmd's quantized formats -> the llama.cpp types of the same width compared with them
COMPARED = {"int8": ("Q8_0",), "w8a8": ("Q8_0",), "int4": ("Q4_0", "Q4_1")}
PROGRAMS = ("llama-quantize", "llama-windows")
QUANTIZE_TIMEOUT_S = 1800
WINDOWS_TIMEOUT_S = 1800
BUILD_HINT = "bench/build_llama_server.sh builds llama.cpp's tools from source"
# where bench/build_llama_server.sh builds (its own LLMD_LLAMA_SERVER_DIR, else a source checkout's .cache)
BUILD_DIR = Path(os.environ.get("LLMD_LLAMA_SERVER_DIR")
                 or Path(__file__).resolve().parents[1] / ".cache" / "llama-server")
CHECKOUT_BIN = BUILD_DIR / "bin"


class LlamaCppError(RuntimeError):
    pass


@dataclass(frozen=True)
class Tools:
    quantize: Path
    windows: Path


def find_tools() -> Tools | None:
    """llama.cpp's programs, or None where they are not all found."""
    folders = []
    if env := os.environ.get("LLMD_LLAMA_CPP"):
        folders.append(Path(env))
    folders.append(CHECKOUT_BIN)
    for folder in folders:
        paths = [folder / p for p in PROGRAMS]
        if all(p.is_file() and os.access(p, os.X_OK) for p in paths):
            return Tools(*paths)
    found = [shutil.which(p) for p in PROGRAMS]
    return Tools(*map(Path, found)) if all(found) else None


def cache_dir() -> Path:
    """Beside the GGUF imports: ``$XDG_CACHE_HOME/llmd/llamacpp``."""
    return cache_root().parent / "llamacpp"


def quantize(tools: Tools, gguf: Path, ftype: str, cache: Path | None = None, threads: int | None = None) -> Path:
    """``gguf`` quantized by llama.cpp to ``ftype`` (Q8_0, Q4_0, ...), kept in the cache by the source's
    hash: made once."""
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{file_sha256(gguf, progress=False)[:16]}.{ftype}.gguf"     # named by the source's content
    if out.exists():
        return out
    part = out.with_name(f"{out.name}.{os.getpid()}.partial")     # two exports at once each write their own
    cmd = [str(tools.quantize), "--allow-requantize", str(gguf), str(part), ftype, str(threads or os.cpu_count() or 1)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=QUANTIZE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        part.unlink(missing_ok=True)
        raise LlamaCppError(f"llama-quantize took over {QUANTIZE_TIMEOUT_S} s on {gguf}") from e
    if r.returncode != 0:
        part.unlink(missing_ok=True)
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise LlamaCppError(f"llama-quantize could not make {ftype} from {gguf}: {' / '.join(tail)}")
    part.rename(out)
    return out


def predict(tools: Tools, gguf: Path, windows: torch.Tensor, threads: int | None = None) -> Predictions:
    """Each window through llama.cpp from an empty cache, teacher-forced: next-token NLL and top-1 at
    every position, as ``quality.predict`` gives them for llmd's models."""
    n, t = windows.shape
    ids = windows.to(torch.int32).numpy().astype("<i4").tobytes()
    with tempfile.TemporaryFile() as out:
        cmd = [str(tools.windows), str(gguf), str(threads or torch.get_num_threads()), str(n), str(t)]
        try:
            r = subprocess.run(cmd, input=ids, stdout=out, stderr=subprocess.PIPE, timeout=WINDOWS_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise LlamaCppError(f"llama-windows took over {WINDOWS_TIMEOUT_S} s on {gguf}") from e
        if r.returncode != 0:
            raise LlamaCppError(f"llama-windows failed on {gguf}: {r.stderr.decode(errors='replace').strip()}")
        out.seek(0)
        data = out.read()
    per = (t - 1) * 4 + t * 4
    if len(data) != n * per:
        raise LlamaCppError(f"llama-windows returned {len(data)} bytes for {n} windows of {t} tokens "
                            f"(expected {n * per})")
    rows = np.frombuffer(data, dtype=np.uint8).reshape(n, per)
    nll = torch.from_numpy(rows[:, :(t - 1) * 4].copy().view("<f4").astype(np.float32))
    top1 = torch.from_numpy(rows[:, (t - 1) * 4:].copy().view("<i4").astype(np.int64))
    return Predictions(nll, top1)
