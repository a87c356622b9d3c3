"""llmd's own CPU kernels for the decode step, built on first use: quantized products (quant.c),
float32 products (f32.c), paged attention (attention.c), rmsnorm / silu*mul / rotary (rows.c), and
every layer of a decode step in one call (decode.c).

The C sources are compiled once per machine with the system C compiler into a cache directory
(the ``kernel_cache`` setting, else ``$XDG_CACHE_HOME/llmd``, else ``~/.cache/llmd``; used only when
owned by this user and writable by no one else, so nobody can plant a library there; else a fresh
private temporary directory) and loaded with ctypes, each entry point bound by its declaration in kernels.h
(read with cffi's C parser); it links the OpenMP runtime torch has already loaded, so both share one
thread pool.

Two libraries come from the same sources: one for AVX-512 with VNNI, and (``LLMD_AVX2`` defined,
avx2.h) one for CPUs with AVX2, FMA and F16C only, whose every 512-bit operation is a pair of 256-bit
ones giving the same numbers (int8's products have an AVX2 loop of their own, with the same exact
sums). ``lib()`` loads the first this CPU runs; ``variant()`` names it. ``available()`` is False,
with ``why()`` saying why, when there is no compiler, the CPU has neither, or the kernels are off:
every caller then uses torch's ops, slower but the same formulas.

Three settings of EngineConfig reach the library through ``configure`` (the engine calls it before it
loads a model): ``kernels`` (auto, avx512, avx2, off), ``amx`` (the tile unit on or off, passed into
C by ``llmd_set_amx``) and ``kernel_cache``. A switch no engine set is read from its ``LLMD_*``
variable (switches.py). The first load fixes them for the process.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import cffi
import torch

from ..errors import InvalidRequest
from .switches import Switches, from_environment

log = logging.getLogger("llmd.kernels")
_HERE = Path(__file__).parent
_SOURCES = [_HERE / name for name in ("quant.c", "f32.c", "attention.c", "rows.c", "decode.c", "blocks.c")]
_HEADER = _HERE / "kernels.h"
_lib: ctypes.CDLL | None = None
_why = ""
_tried = False
_variant = ""
_switches: Switches | None = None      # configure()'s; fixed by the first lib()
VARIANTS = ("avx512", "avx2")         # the libraries lib() tries, the faster first

def _private(d: Path) -> bool:
    """Ours and writable by nobody else: a shared directory could hold a planted library."""
    st = d.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _cache_dir(asked: str | None) -> Path:
    """``asked`` (the kernel_cache setting), else the user's cache, whichever is private first."""
    env_home = os.environ.get("XDG_CACHE_HOME")
    for d in (asked, env_home and Path(env_home) / "llmd", Path.home() / ".cache" / "llmd"):
        if not d:
            continue
        try:
            Path(d).mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(d, os.W_OK) and _private(Path(d)):
                return Path(d)
        except OSError:
            continue
    return Path(tempfile.mkdtemp(prefix="llmd-kernels-"))     # private (0700), rebuilt per process


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (install gcc)")
    return cc


def compile_command(cc: str, sources: list[Path], out: Path, variant: str = "avx512") -> list[str]:
    """How the kernel library is built."""
    defines = ["-DLLMD_AVX2"] if variant == "avx2" else []
    # no contraction of a product and a sum into one FMA: the kernels write their FMAs out, and the
    # compiler fuses differently for 512 and 256 bits, so the two libraries would round differently
    return [cc, "-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", *defines, "-o", str(out),
            *map(str, sources), "-lm"]


_API_BEGIN, _API_END = "/* llmd API begin", "/* llmd API end */"
# the C types the entry points' declarations use, as ctypes passes them (any pointer: an address)
_CTYPES = {"int": ctypes.c_int, "float": ctypes.c_float, "void": None}


@lru_cache(maxsize=None)
def _ffi():
    """A cffi parser holding the entry points' declarations, read from kernels.h (its API block). Only
    the declarations come from it: calls go through ctypes, which takes a tensor's address as an int
    where a cffi call would need a cast per pointer."""
    text = _HEADER.read_text()
    ffi = cffi.FFI()
    ffi.cdef(text[text.index(_API_BEGIN):text.index(_API_END)])
    return ffi


def _ctype(t):
    if t.kind == "pointer":
        return ctypes.c_void_p
    if t.cname not in _CTYPES:
        raise TypeError(f"kernels.h declares a {t.cname} argument, which llmd.runtime.kernels does not pass")
    return _CTYPES[t.cname]


def bind(so: ctypes.CDLL) -> ctypes.CDLL:
    """Give each entry point of ``so`` its signature as kernels.h declares it (the library is built
    from the same sources as the header, so it has every one)."""
    ffi = _ffi()
    declared = ffi.dlopen(so._name)
    for name in dir(declared):
        fn_type = ffi.typeof(getattr(declared, name))
        fn = getattr(so, name)
        fn.argtypes, fn.restype = [_ctype(a) for a in fn_type.args], _ctype(fn_type.result)
    return so


@lru_cache(maxsize=None)
def struct(name: str) -> type[ctypes.Structure]:
    """The ctypes form of a struct kernels.h declares (its fields in the header's order)."""
    fields = _ffi().typeof(name).fields
    return type(name, (ctypes.Structure,), {"_fields_": [(f, _ctype(t.type)) for f, t in fields]})


def _build(variant: str, cache: str | None) -> Path:
    src = b"".join(p.read_bytes() for p in [*_SOURCES, _HEADER, _HERE / "avx2.h"])
    cc = compiler()
    tag = hashlib.sha256(src + " ".join(compile_command(cc, [], Path("-"), variant)).encode()).hexdigest()[:16]
    out = _cache_dir(cache) / f"kernels-{variant}-{tag}.so"
    if out.exists() and _private(out):
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    done = subprocess.run(compile_command(cc, _SOURCES, tmp, variant), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"compiling llmd's kernels failed: {done.stderr.strip()[-400:]}")
    os.replace(tmp, out)          # atomic: a concurrent build never loads a half-written file
    return out


def configure(kernels: str | None = None, amx: bool | None = None, kernel_cache: str | None = None) -> None:
    """Set the switches (EngineConfig's ``kernels``, ``amx``, ``kernel_cache``; None: not given, so the
    ``LLMD_*`` variable, else the default). Before the library loads they choose it; once it has, a value
    other than the one in force is refused (InvalidRequest), since the library and the tile unit serve the
    whole process. A library asked for by name (avx512, avx2) is loaded here, and refused where it
    cannot load. A new cache directory only holds libraries built after it."""
    global _switches
    asked = from_environment(kernels=kernels, amx=amx, kernel_cache=kernel_cache)
    if not _tried:
        _switches = asked
        if kernels in VARIANTS and lib() is None:
            raise InvalidRequest(f"kernels = {kernels} cannot be honoured: {_why}; set kernels = auto to load the "
                                 "library this CPU runs")
        return
    current = switches()
    clash = {}
    if kernels is not None and kernels not in (current.kernels, _variant or None):
        clash["kernels"] = (current.kernels, kernels)
    if amx is not None and amx != current.amx:
        clash["amx"] = (current.amx, amx)
    if clash:
        said = lambda i: ", ".join(f"{n} = {str(v[i]).lower()}" for n, v in clash.items())
        raise InvalidRequest(f"llmd's CPU kernels were set up in this process with {said(0)}; {said(1)} takes "
                             "effect only in a new process (one library and one tile-unit choice a process: the "
                             "first engine's)")
    if kernel_cache is not None:
        _switches = Switches(current.kernels, current.amx, asked.kernel_cache)


def switches() -> Switches:
    """The switches in force (or that the first load will use)."""
    return _switches if _switches is not None else from_environment()


def lib() -> ctypes.CDLL | None:
    """The loaded library, or None (see ``why()``). Built at most once per process, with the switches
    ``configure`` set (or the environment's)."""
    global _lib, _why, _tried, _variant, _switches
    if _tried:
        return _lib
    _switches = switches()
    _tried = True
    wanted = _switches.kernels
    if wanted == "off":
        _why = "turned off (kernels = off: the --kernels flag, llmd.toml or LLMD_KERNELS)"
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _why = f"llmd's kernels are written for x86-64 (AVX-512 or AVX2), not {platform.machine()}"
        log.info("%s; torch's kernels are used", _why)
        return None
    failed = []                  # a library that did not build goes on to the next (an older assembler)
    for name in [wanted] if wanted in VARIANTS else VARIANTS:
        try:
            so = load(name)
        except (OSError, RuntimeError) as e:
            failed.append(f"{name}: {e}")
            continue
        if so is not None:
            _lib, _variant = so, name
            log.info("llmd's CPU kernels: the %s library%s", name, "" if _switches.amx else ", AMX off")
            return _lib
    if failed:
        _why = "; ".join(failed)
        log.warning("llmd's CPU kernels are unavailable (%s); decoding uses torch's kernels, which are much "
                    "slower. Install a C compiler (gcc) to build them.", _why)
    elif wanted in VARIANTS:
        _why = f"the {wanted} library (kernels = {wanted}) does not run on this CPU"
        log.warning("%s; torch's kernels are used (much slower): set kernels = auto (LLMD_KERNELS=auto) to load "
                    "the library it runs", _why)
    else:
        _why = "this CPU has neither AVX-512 with VNNI nor AVX2 with FMA and F16C"
        log.warning("llmd's CPU kernels need AVX-512 with VNNI, or AVX2 with FMA and F16C; this CPU has "
                    "neither, so torch's kernels are used (much slower)")
    return None


def load(variant: str) -> ctypes.CDLL | None:
    """The ``variant`` library (built if need be), bound, with the amx switch in force; None where this
    CPU cannot run it. Raises RuntimeError or OSError when it cannot be built or loaded. Tests load
    both where both run."""
    s = switches()
    so = bind(ctypes.CDLL(str(_build(variant, s.kernel_cache))))
    if not so.llmd_cpu_ok():
        return None
    so.llmd_set_amx(int(s.amx))
    return so


def cache_dir() -> Path:
    """The directory libraries are built into with the switches in force."""
    return _cache_dir(switches().kernel_cache)


def variant() -> str:
    """The library loaded: "avx512", "avx2", or "" (none)."""
    lib()
    return _variant


def available() -> bool:
    return lib() is not None


def why() -> str:
    lib()
    return _why


def traced(x: torch.Tensor) -> bool:
    """True inside a graph being traced or compiled (a fake tensor, or a tracer running)."""
    return type(x) is not torch.Tensor or torch.compiler.is_compiling() or torch.jit.is_tracing()


def usable(x: torch.Tensor, has_gradient: bool = True) -> bool:
    """True when the kernels may run on ``x``: loaded, a real CPU tensor, no gradient being recorded
    (the kernels have no backward: training keeps torch's ops, and the engine runs under
    ``inference_mode``), and not inside a graph being traced or compiled (those keep torch's ops,
    which they can capture). ``has_gradient=False`` is for an op that has none anyway (argmax).
    Called per product: the cheap checks come first."""
    return (type(x) is torch.Tensor and (_lib is not None or (not _tried and available())) and x.is_cpu
            and not (has_gradient and torch.is_grad_enabled()) and not traced(x))
