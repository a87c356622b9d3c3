"""The one codec: msgpack maps to and from bytes, with hard limits and no extension types.

Bytes exist only at the socket. Everything above this module sees plain dicts, lists, str,
int, float, bool, None and bytes; nothing is ever pickled or evaluated.
"""
from __future__ import annotations

import msgpack

MAX_MESSAGE_BYTES = 1 << 20        # also set as ZMQ_MAXMSGSIZE on the daemon's socket
MAX_STR_LEN = 1 << 20
MAX_BIN_LEN = 1 << 16
MAX_ARRAY_LEN = 1 << 17            # token id lists
MAX_MAP_LEN = 64
MAX_DEPTH = 8                      # no valid message nests deeper


class CodecError(ValueError):
    """The bytes are not one msgpack map within the limits."""

    code = "bad_message"


def _refuse_ext(code: int, data: bytes):
    raise CodecError(f"msgpack extension type {code} is not allowed")


def _depth(obj, limit: int) -> int:
    """Nesting depth of containers, stopping as soon as ``limit`` is passed."""
    stack = [(obj, 1)]
    deepest = 0
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(node, dict):
            stack.extend((v, d + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, d + 1) for v in node if isinstance(v, (dict, list)))
    return deepest


def unpack(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """Decode one message. Raises CodecError for anything but a bounded map with str keys."""
    if len(data) > max_bytes:
        raise CodecError(f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True, timestamp=0,
            ext_hook=_refuse_ext, max_str_len=MAX_STR_LEN, max_bin_len=MAX_BIN_LEN,
            max_array_len=MAX_ARRAY_LEN, max_map_len=MAX_MAP_LEN, max_ext_len=0)
    except CodecError:
        raise
    except Exception as e:  # FormatError, StackError, ExtraData, UnicodeDecodeError, ValueError...
        raise CodecError(f"not a valid msgpack message: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise CodecError(f"a message must be a msgpack map, not {type(obj).__name__}")
    if not all(isinstance(k, str) for k in obj):
        raise CodecError("message keys must be strings")
    if _depth(obj, MAX_DEPTH) > MAX_DEPTH:
        raise CodecError(f"message nests deeper than {MAX_DEPTH} levels")
    return obj


def pack(message: dict) -> bytes:
    """Encode one message (a map of plain values). Raises CodecError for anything else."""
    try:
        return msgpack.packb(message, use_bin_type=True, strict_types=False, datetime=False)
    except Exception as e:
        raise CodecError(f"cannot encode message: {e}") from None
