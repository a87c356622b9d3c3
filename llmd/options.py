"""Settings derived from dataclass fields: command-line flags, settings-file values, ``LLMD_*`` text.

A settings dataclass (``EngineConfig``, the daemon's ``DaemonSettings``) declares each setting once,
as a field with ``metadata={"help": ..., "unit": ..., "choices": ...}``. From a field named
``max_num_seqs`` this module derives the flag ``--max-num-seqs`` (``--X/--no-X`` for a bool), the
settings-file key ``max_num_seqs`` and the variable ``LLMD_MAX_NUM_SEQS``, each read into the
field's type. Pure Python: no torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from typing import Any, Iterable, get_args, get_origin, get_type_hints


class OptionError(ValueError):
    code = "config"


def kinds(cls, name: str) -> tuple:
    """The types a field accepts: ``Optional[int]`` -> (int, NoneType); ``str | int`` -> (str, int)."""
    hint = get_type_hints(cls)[name]
    return get_args(hint) if get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def env_name(name: str) -> str:
    return f"LLMD_{name.upper()}"


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_value(cls, name: str, value: Any, where: str) -> Any:
    """A value read from a settings file, checked against the field's type (an int is no bool, a
    float may be written as an int)."""
    for t in kinds(cls, name):
        if t is type(None) and value is None:
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                break
            return float(value)
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t in (str, bool) and type(value) is t:
            return value
    names = " or ".join("none" if t is type(None) else t.__name__ for t in kinds(cls, name))
    raise OptionError(f"{where}: {name} must be {names}, got {value!r}")


def parse_text(cls, name: str, text: str, where: str) -> Any:
    """A value written as text (an ``LLMD_*`` variable or a flag) read into the field's type."""
    allowed = kinds(cls, name)
    if type(None) in allowed and (text.strip() == "" or (text.strip().lower() == "none" and str not in allowed)):
        return None             # a str setting may take the value "none" itself (draft = "none")
    low = text.strip().lower()
    if bool in allowed:
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
    for t in (int, float):
        if t in allowed:
            try:
                return t(text)
            except ValueError:
                pass
    if str in allowed:
        return text
    names = " or ".join("none" if t is type(None) else t.__name__ for t in allowed)
    raise OptionError(f"{where}: {name} must be {names}, got {text!r}")


def describe_field(f: dataclasses.Field) -> str:
    """The help line: its text, then unit and default."""
    help_text = f.metadata.get("help", "")
    extra = []
    if f.metadata.get("unit"):
        extra.append(f.metadata["unit"])
    if f.default is not dataclasses.MISSING and f.default is not None:
        extra.append(f"default {str(f.default).lower() if isinstance(f.default, bool) else f.default}")
    return help_text + (f" ({'; '.join(extra)})" if extra else "")


def add_flags(parser: argparse.ArgumentParser, cls, skip: Iterable[str] = ()) -> None:
    """One flag per field of ``cls``. Flags default to None (not given), so the field's own default, or a
    settings file, stays in force unless the flag is given."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        allowed = kinds(cls, f.name)
        kw: dict[str, Any] = {"default": None, "help": describe_field(f).replace("%", "%%"), "dest": f.name}
        if bool in allowed:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _flag_type(cls, f.name)
            kw["metavar"] = (f.metadata.get("unit") or f.name).upper().replace(" ", "_")
            if f.metadata.get("choices"):
                kw["choices"] = f.metadata["choices"]
                kw.pop("metavar")
        parser.add_argument(flag_name(f.name), **kw)


def _flag_type(cls, name: str):
    def read(text: str):
        try:
            return parse_text(cls, name, text, flag_name(name))
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    read.__name__ = name
    return read


def given(args: argparse.Namespace, cls, skip: Iterable[str] = ()) -> dict:
    """The fields of ``cls`` whose flags were given."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and getattr(args, f.name, None) is not None}
