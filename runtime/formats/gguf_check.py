"""A bounded walk over a GGUF header before the `gguf` package reads it.

The package trusts the file: an array that claims 2**60 elements makes it loop and allocate until
memory runs out, and a tensor may point past the end of the file. This walk reads only lengths and
counts, checks each one against the bytes that remain and against fixed limits, and raises
``GGUFError`` naming the field. What it accepts, the package can read in memory proportional to the
header (every count is bounded) without touching data outside the file.

    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x   (key: string, type: u32, value)        string = u64 length + UTF-8 bytes
    tensor_count x (name: string, n_dims: u32, dims: n_dims x u64, type: u32, offset: u64)
    padding to `general.alignment` (default 32) | tensor data (each offset relative to here)
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

MAX_KV = 1 << 16                  # metadata entries
MAX_TENSORS = 1 << 16
MAX_ARRAY_ELEMENTS = 1 << 21      # all array elements together (a 256k vocabulary's tokens, types, merges)
MAX_STRING = 1 << 24              # one string (chat templates are the longest)
MAX_NAME = 1 << 10                # a key or a tensor name
MAX_DIMS = 4
MAX_ELEMENTS = 1 << 40            # one tensor

SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


def is_gguf_file(path: str | Path) -> bool:
    """A GGUF file by its first four bytes, whatever its name (an Ollama blob has no extension)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


class GGUFError(ModelLoadError):
    """A GGUF file is malformed, hostile or uses something llmd does not support. Names the file
    and the field."""


@dataclass(frozen=True)
class TensorSpan:
    name: str
    type: int
    dims: tuple[int, ...]
    start: int                    # absolute offset in the file
    nbytes: int


SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q",
                  12: "<d"}
NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
         12: "<f8"}


class _Walk:
    def __init__(self, path: Path, buf, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0
        self.elements = 0
        self.meta: dict = {}          # key -> value, read as the walk passes it

    def fail(self, what: str, msg: str):
        raise GGUFError(f"{self.path}: {what}: {msg} (at byte {self.pos}); the file is truncated, corrupt or not a "
                        "GGUF model")

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            self.fail(what, f"needs {n} bytes but {self.size - self.pos} remain")
        b = self.buf[self.pos:self.pos + n]
        self.pos += n
        return b

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def string(self, what: str, limit: int = MAX_STRING, decode: bool = False):
        n = self.u64(what)
        if n > limit:
            self.fail(what, f"a string of {n} bytes (at most {limit})")
        raw = self.take(n, what)
        if not decode:
            return None
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            self.fail(what, "not valid UTF-8")

    def value(self, vtype: int, what: str, in_array: bool = False):
        """The value at the walk's position (a Python scalar, str, or for an array a list), checked."""
        if vtype in SCALAR_SIZES:
            raw = self.take(SCALAR_SIZES[vtype], what)
            v = struct.unpack(SCALAR_FORMATS[vtype], raw)[0]
            return bool(v) if vtype == 7 else v
        if vtype == STRING:
            return self.string(what, decode=True)
        if vtype == ARRAY and not in_array:
            return self.array(what)
        self.fail(what, f"unknown value type {vtype}" if vtype != ARRAY else "an array of arrays")

    def array(self, what: str) -> list:
        itype, count = self.u32(what), self.u64(what)
        self.elements += count
        if self.elements > MAX_ARRAY_ELEMENTS:
            self.fail(what, f"{count} array elements (at most {MAX_ARRAY_ELEMENTS} in all)")
        least = SCALAR_SIZES.get(itype, 8)
        if count * least > self.size - self.pos:
            self.fail(what, f"{count} elements cannot fit in the {self.size - self.pos} bytes left")
        if itype in SCALAR_SIZES:
            import numpy as np
            values = np.frombuffer(self.take(count * least, what), dtype=NUMPY[itype]).tolist()
            return [bool(v) for v in values] if itype == 7 else values
        if itype == STRING:
            return self.strings(count, what)
        return [self.value(itype, what, in_array=True) for _ in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row (a vocabulary): lengths read and checked one by one, decoded."""
        out, buf, pos, size = [], self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if size - pos < 8:
                self.pos = pos
                self.fail(what, f"needs 8 bytes but {size - pos} remain")
            n = unpack(buf, pos)[0]
            pos += 8
            if n > MAX_STRING or n > size - pos:
                self.pos = pos
                self.fail(what, f"a string of {n} bytes (at most {min(MAX_STRING, size - pos)} here)")
            try:
                out.append(str(buf[pos:pos + n], "utf-8"))
            except UnicodeDecodeError:
                self.pos = pos
                self.fail(what, "not valid UTF-8")
            pos += n
        self.pos = pos
        return out


def check_header(path: str | Path, quant_sizes: dict[int, tuple[int, int]]) -> list[TensorSpan]:
    """Walk the header of ``path``; return every tensor's span once all of them lie inside the file.
    ``quant_sizes`` maps each known tensor type to (elements per block, bytes per block)."""
    return read_header(path, quant_sizes)[0]


def read_header(path: str | Path, quant_sizes: dict[int, tuple[int, int]]) -> tuple[list[TensorSpan], dict]:
    """``check_header``'s spans, and the metadata: key -> (GGUF value type, value)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFError(f"{path}: {size} bytes is too short for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                w = _Walk(path, buf, size)
                spans = _walk(w, quant_sizes)
                return spans, w.meta
    except OSError as e:
        raise GGUFError(f"{path}: cannot read: {e}") from None


def _walk(w: _Walk, quant_sizes) -> list[TensorSpan]:
    if w.take(4, "magic") != b"GGUF":
        w.fail("magic", "the file does not start with 'GGUF'")
    version = w.u32("GGUF.version")
    if version not in (2, 3):
        w.fail("GGUF.version", f"version {version} (llmd reads little-endian GGUF versions 2 and 3)")
    n_tensors, n_kv = w.u64("GGUF.tensor_count"), w.u64("GGUF.kv_count")
    if n_kv > MAX_KV or n_kv * 13 > w.size:
        w.fail("GGUF.kv_count", f"{n_kv} metadata entries")
    if n_tensors > MAX_TENSORS or n_tensors * 32 > w.size:
        w.fail("GGUF.tensor_count", f"{n_tensors} tensors")
    alignment = 32
    for i in range(n_kv):
        key = w.string(f"metadata key {i}", MAX_NAME, decode=True)
        vtype = w.u32(key)
        if key == "general.alignment":
            if vtype != 4:
                w.fail(key, "must be a uint32")
            alignment = struct.unpack("<I", w.take(4, key))[0]
            if alignment == 0 or alignment & (alignment - 1) or alignment > 1 << 16:
                w.fail(key, f"{alignment} is not a power of two up to 65536")
            w.meta[key] = (vtype, alignment)
        else:
            w.meta[key] = (vtype, w.value(vtype, key))
    infos = [_tensor_info(w, i, quant_sizes) for i in range(n_tensors)]
    data_start = -(-w.pos // alignment) * alignment
    spans, names = [], set()
    for name, ttype, dims, offset, nbytes in infos:
        if name in names:
            w.fail(f"tensor {name}", "appears twice")
        names.add(name)
        if offset % alignment:
            w.fail(f"tensor {name}", f"offset {offset} is not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start + nbytes > w.size:
            w.fail(f"tensor {name}", f"its {nbytes} bytes at offset {start} run past the end of the "
                   f"{w.size}-byte file")
        spans.append(TensorSpan(name, ttype, dims, start, nbytes))
    return spans


def _tensor_info(w: _Walk, i: int, quant_sizes):
    name = w.string(f"tensor {i}'s name", MAX_NAME, decode=True)
    what = f"tensor {name}"
    n_dims = w.u32(what)
    if not 1 <= n_dims <= MAX_DIMS:
        w.fail(what, f"{n_dims} dimensions (1 to {MAX_DIMS})")
    dims = tuple(w.u64(what) for _ in range(n_dims))
    elements = 1
    for d in dims:
        elements *= d
    if not 1 <= elements <= MAX_ELEMENTS or 0 in dims:
        w.fail(what, f"shape {list(dims)}")
    ttype = w.u32(what)
    if ttype not in quant_sizes:
        w.fail(what, f"unknown tensor type {ttype}")
    block, type_size = quant_sizes[ttype]
    if dims[0] % block:
        w.fail(what, f"its rows of {dims[0]} are not whole blocks of {block}")
    offset = w.u64(what)
    return name, ttype, dims, offset, elements // block * type_size
