"""Hostile GGUF files: a real file with one field made to lie (counts, lengths, offsets, types, UTF-8,
version, magic), each case the reader must refuse with a typed error."""
import struct


def offset_after(data: bytes, key: bytes) -> int:
    """Offset just past the length-prefixed string ``key`` (a metadata key or tensor name)."""
    i = data.rindex(struct.pack("<Q", len(key)) + key)
    return i + 8 + len(key)


def hostile(data: bytes) -> dict[str, bytes]:
    b = bytearray(data)
    cases = {}
    def patched(at: int, fmt: str, value) -> bytes:
        c = bytearray(b)
        struct.pack_into(fmt, c, at, value)
        return bytes(c)
    cases["tensor count"] = patched(8, "<Q", 1 << 62)
    cases["kv count"] = patched(16, "<Q", 1 << 62)
    tokens = offset_after(data, b"tokenizer.ggml.tokens") + 4 + 4          # value type, element type
    cases["array count"] = patched(tokens, "<Q", 1 << 60)
    cases["string length"] = patched(tokens + 8, "<Q", 1 << 50)
    embd = offset_after(data, b"token_embd.weight")
    cases["dimension"] = patched(embd + 4, "<Q", 1 << 38)
    cases["tensor type"] = patched(embd + 4 + 16, "<I", 9999)
    cases["tensor offset"] = patched(embd + 4 + 16 + 4, "<Q", len(data) * 4)
    cases["value type"] = patched(offset_after(data, b"general.architecture"), "<I", 77)
    key = data.index(b"general.architecture")
    cases["bad utf-8"] = bytes(b[:key]) + b"\xff\xfe" + bytes(b[key + 2:])
    cases["version"] = patched(4, "<I", 1)
    cases["magic"] = b"GGUX" + bytes(b[4:])
    for n in (3, 23, tokens, embd, len(data) // 2, len(data) - 1):
        cases[f"truncated at {n}"] = bytes(b[:n])
    return cases
