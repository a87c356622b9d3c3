"""The kernels' three switches, as EngineConfig declares them (``kernels``, ``amx``, ``kernel_cache``),
resolved: a value the engine was given, else the setting's ``LLMD_*`` variable (named and read as the
daemon's settings read it, so the offline API and the benchmarks honour the same variables), else
its default. One set of switches holds for a process: the library it loads and the tile unit are
process-wide."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping, Optional

from llmd.options import OptionError, env_name, parse_text

from ..config import EngineConfig
from ..errors import InvalidRequest

NAMES = ("kernels", "amx", "kernel_cache")
_FIELDS = {f.name: f for f in fields(EngineConfig) if f.name in NAMES}
KERNELS = _FIELDS["kernels"].metadata["choices"]        # auto, avx512, avx2, off


@dataclass(frozen=True)
class Switches:
    kernels: str = "auto"
    amx: bool = True
    kernel_cache: Optional[str] = None      # None: $XDG_CACHE_HOME/llmd, else ~/.cache/llmd

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise InvalidRequest(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if not isinstance(self.amx, bool):
            raise InvalidRequest(f"amx must be true or false, got {self.amx!r}")
        if self.kernel_cache is not None and not (isinstance(self.kernel_cache, str) and self.kernel_cache.strip()):
            raise InvalidRequest(f"kernel_cache must be a directory path, got {self.kernel_cache!r}")


def from_environment(env: Mapping[str, str] | None = None, **given) -> Switches:
    """``given``'s values (None: not given), each other switch from its ``LLMD_*`` variable where set."""
    env = os.environ if env is None else env
    values = {k: v for k, v in given.items() if v is not None}
    for name in NAMES:
        var = env_name(name)
        if name in values or var not in env:
            continue
        try:
            value = parse_text(EngineConfig, name, env[var], var)
            if value is not None:
                Switches(**{name: value})             # checked alone, so that the error names its variable
                values[name] = value
        except OptionError as e:
            raise InvalidRequest(str(e)) from None
        except InvalidRequest as e:
            raise InvalidRequest(f"{var}: {e}") from None
    return Switches(**values)
