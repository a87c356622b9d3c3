"""llama.cpp's quantization of a model beside an llmd engine's, on the engine's quality-gate windows
against the same float reference (``llmd bench ENGINE_DIR --against llamacpp-quality``).

Two programs of one llama.cpp build do the work: its ``llama-quantize`` (the GGUF of the model,
quantized again to the format compared; ``--allow-requantize``, since a shipped GGUF is often already
quantized) and llmd's ``llama-windows`` (``bench/llama_windows.cpp``: token windows teacher-forced
through llama.cpp's library, returning each position's next-token NLL and top-1 id).
``bench/build_llama_server.sh`` builds both from the source vendored in llama-cpp-python's source
distribution. They are looked for in ``$LLMD_LLAMA_CPP`` (a folder), then in that script's ``bin``
folder (``$LLMD_LLAMA_SERVER_DIR``, else a source checkout's ``.cache/llama-server``), then on PATH.
Nothing here listens on a socket.

The engine's own row is measured as its export's quality gate measured it (``target_predictions``:
the ONNX graph, the AOT package, else the written weights), on the windows and float reference the
gate used (the text, window count and length its manifest records; the model it was exported from,
a layer at a time), so llmd's row repeats the figures ``llmd export`` printed.
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

from llmd.export import quality
from llmd.export.cli import target_predictions
from llmd.export.stream import float_reference, open_source
from llmd.runtime.formats.gguf_import import cache_root, file_sha256, is_gguf
from llmd.runtime.formats.manifest import read_manifest
from llmd.runtime.formats.quantized import QuantSpec
from llmd.runtime.models.config import ModelConfig

from .llama_server import CACHE

# llmd's quantized formats -> the llama.cpp types of the same width compared with them
COMPARED = {"int8": ("Q8_0",), "w8a8": ("Q8_0",), "int4": ("Q4_0", "Q4_1")}
PROGRAMS = ("llama-quantize", "llama-windows")
QUANTIZE_TIMEOUT_S = 1800
WINDOWS_TIMEOUT_S = 1800
BUILD_HINT = "bench/build_llama_server.sh builds llama.cpp's tools from source"
CHECKOUT_BIN = CACHE / "bin"


class LlamaCppError(RuntimeError):
    """llama.cpp's programs are missing, failed, or cannot compare this engine."""


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
    part = out.with_name(f"{out.name}.{os.getpid()}.partial")     # two runs at once each write their own
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


def predict(tools: Tools, gguf: Path, windows: torch.Tensor, threads: int | None = None) -> quality.Predictions:
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
    return quality.Predictions(nll, top1)


DEFAULT_WINDOWS, DEFAULT_TOKENS = 8, 128     # llmd export's --eval-windows and --eval-tokens


def compare_engine(engine: str | Path, gguf: str | Path | None = None, threads: int | None = None, log=None) -> dict:
    """llmd's engine directory ``engine`` and llama.cpp's quantization of ``gguf`` (default: the GGUF the
    engine was exported from) to the types of the same width, against the engine's float reference on
    its quality-gate windows: {"rows": [{"engine", "ppl_increase", "top1_agreement", ...}], ...}."""
    engine, log = Path(engine), log or (lambda m: None)
    manifest = read_manifest(engine, verify_hashes=False)
    spec = QuantSpec.from_dict(manifest["quantization"])
    if spec.method not in COMPARED:
        raise LlamaCppError(f"{engine} holds {spec.method} weights; llama.cpp is compared with int8, w8a8 and "
                            "int4 engines (Q8_0; Q4_0 and Q4_1)")
    source = Path(manifest["models"]["target"]["source"]["path"])
    if not source.exists():
        raise LlamaCppError(f"the model {engine} was exported from, {source}, is gone: the comparison measures "
                            "both engines against it; put it back or export again")
    gguf = Path(gguf) if gguf else source if is_gguf(source) else None
    if gguf is None:
        raise LlamaCppError(f"{engine} was exported from {source}, not a GGUF file: give a GGUF of the same model "
                            "with --llama-gguf FILE")
    if not gguf.is_file():
        raise LlamaCppError(f"--llama-gguf {gguf}: no such file")
    tools = find_tools()
    if tools is None:
        raise LlamaCppError(f"llama.cpp's tools were not found ({BUILD_HINT})")
    gate = manifest.get("quality", {}).get("gate", {})
    model = open_source(source)
    texts, text_source = quality.heldout_texts(gate.get("eval_file"))
    windows = quality.token_windows(model.tokenizer(), texts, gate.get("eval_tokens", DEFAULT_TOKENS),
                                    gate.get("eval_windows", DEFAULT_WINDOWS))
    log(f"float reference: {source}, {len(windows)} windows of {windows.shape[1]} tokens")
    reference = float_reference(model, windows)
    del model
    mine, measured_on = target_predictions(engine, manifest.get("artifacts", {}),
                                           ModelConfig.from_dir(engine / "target"), spec, windows)
    rows = [_row(f"llmd {spec.method}", quality.compare(reference, mine, None, text_source, measured_on))]
    for ftype in COMPARED[spec.method]:
        log(f"llama.cpp {ftype}: quantizing {gguf}")
        path = quantize(tools, gguf, ftype, threads=threads)
        q = quality.compare(reference, predict(tools, path, windows, threads), None, text_source, "llama.cpp")
        rows.append(_row(f"llama.cpp {ftype}", q) | {"file": str(path)})
    return {"engine": str(engine), "gguf": str(gguf), "reference": str(source), "text": text_source,
            "windows": len(windows), "tokens": int(windows.shape[1]), "rows": rows}


def _row(name: str, q: quality.Quality) -> dict:
    return {"engine": name, "ppl_reference": q.ppl_reference, "ppl_quantized": q.ppl_quantized,
            "ppl_increase": q.ppl_increase, "top1_agreement": q.top1_agreement, "num_tokens": q.num_tokens,
            "measured_on": q.measured_on}


def table(r: dict) -> str:
    lines = [f"engine {r['engine']} against llama.cpp on {r['gguf']}",
             f"float reference {r['reference']}; {r['windows']} windows of {r['tokens']} tokens of {r['text']}", "",
             "| engine and format | perplexity | change | top-1 agreement |", "|---|---|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['engine']} | {row['ppl_reference']:.3f} -> {row['ppl_quantized']:.3f} | "
                     f"{100 * row['ppl_increase']:+.2f} % | {100 * row['top1_agreement']:.2f} % |")
    return "\n".join(lines)
