"""The daemon's settings: a frozen dataclass validated when built, and the layered loader.

Precedence, lowest first: built-in defaults, /etc/llmd/llmd.toml, $XDG_CONFIG_HOME/llmd/llmd.toml
(or ~/.config), LLMD_* environment variables, command-line flags. ``load`` also returns where
each value came from, for ``llmd serve --print-config``.
"""
from __future__ import annotations

import dataclasses
import grp
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, get_args, get_origin, get_type_hints

from llmd.runtime.config import DEVICES, KV_DTYPES

from . import paths

SYSTEM_CONFIG = Path("/etc/llmd/llmd.toml")


class SettingsError(ValueError):
    code = "config"


@dataclass(frozen=True)
class Settings:
    model: Optional[str] = None           # model directory (required to serve)
    socket: str = ""                      # ipc socket path; "" means the default location
    group: Optional[str] = None           # group owning the socket and its directory
    tcp: Optional[str] = None             # extra tcp:// endpoint; none unless asked for
    dtype: str = "float32"
    device: str = "auto"                  # one of llmd.runtime.config.DEVICES
    threads: Optional[int] = None         # torch threads for the engine; None keeps torch's default
    kv_memory: str = "256MiB"
    block_size: int = 16
    max_batch_tokens: int = 512
    prefix_cache: bool = True
    kv_dtype: str = "auto"                # one of llmd.runtime.config.KV_DTYPES
    # speculative decoding: "auto" (an engine directory's own draft, else n-gram lookup for greedy
    # requests), "ngram" (for every request), "none", or a draft model directory
    draft: Optional[str] = "auto"
    num_speculative_tokens: Optional[int] = None   # most proposals per step; None: 8 for ngram, 4 for a draft
    adaptive_speculation: bool = True     # let measured costs and acceptance pick the depth
    max_queue: int = 64                   # requests in flight (queued + running) before `busy`
    max_message_bytes: int = 1 << 20      # ZMQ_MAXMSGSIZE; larger frames drop the connection
    send_hwm: int = 1000                  # messages buffered per client before it counts as stuck
    send_buffer_bytes: int = 0            # kernel send buffer per connection (SO_SNDBUF); 0: the OS default
    heartbeat_ivl_ms: int = 1000
    heartbeat_timeout_ms: int = 3000
    keepalive_s: float = 0.25             # probe clients with work in flight but no output this long
    drain_grace_s: float = 10.0           # on SIGTERM, time to finish in-flight work before cancelling
    warmup: bool = True
    log_level: str = "info"

    def __post_init__(self):
        hints = get_type_hints(Settings)
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name), hints[f.name])
        positive = ("block_size", "max_batch_tokens", "num_speculative_tokens", "max_queue", "max_message_bytes", "send_hwm",
                    "heartbeat_ivl_ms", "heartbeat_timeout_ms")
        for name in positive:
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("keepalive_s", "drain_grace_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise SettingsError(f"{name} must be a finite number >= 0, got {v}")
        if self.threads is not None and self.threads <= 0:
            raise SettingsError(f"threads must be positive, got {self.threads}")
        if self.tcp is not None and not self.tcp.startswith("tcp://"):
            raise SettingsError(f"tcp must be a tcp://host:port endpoint, got {self.tcp!r}")
        if self.group is not None:
            try:
                grp.getgrnam(self.group)
            except KeyError:
                raise SettingsError(f"group {self.group!r} does not exist: create it (groupadd), or leave group "
                                    "unset for a socket only its owner can use") from None
        if self.device not in DEVICES:
            raise SettingsError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise SettingsError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise SettingsError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else paths.default_socket_path()

    @property
    def endpoint(self) -> str:
        return paths.endpoint(self.socket_path)


def _check_type(name: str, value: Any, hint) -> None:
    allowed = get_args(hint) if get_origin(hint) is not None else (hint,)
    for t in allowed:
        if t is type(None) and value is None:
            return
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if t in (str, bool) and type(value) is t:
            return
    names = " or ".join("none" if t is type(None) else t.__name__ for t in allowed)
    raise SettingsError(f"{name} must be {names}, got {value!r}")


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def user_config_path(env) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".config")
    return Path(base) / "llmd" / "llmd.toml"


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SettingsError(f"{path}: {e}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise SettingsError(f"{path}: unknown setting(s) {', '.join(unknown)}")
    return data


def _from_env_text(name: str, text: str):
    hint = get_type_hints(Settings)[name]
    kinds = get_args(hint) or (hint,)
    if type(None) in kinds and text.lower() in ("", "none"):
        return None
    try:
        if bool in kinds:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if int in kinds:
            return int(text)
        if float in kinds:
            return float(text)
    except ValueError:
        raise SettingsError(f"LLMD_{name.upper()}={text!r} is not a valid {name}") from None
    return text


def load(flags: dict | None = None, env=None, system_file: Path | None = SYSTEM_CONFIG,
         user_file: Path | None = None) -> tuple[Settings, dict[str, str]]:
    """Merge the layers; return the settings and, per field, the source of its value."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    source = {name: "default" for name in FIELDS}

    def layer(data: dict, where: str):
        for k, v in data.items():
            values[k] = v
            source[k] = where

    if system_file is not None:
        layer(_read_toml(system_file), str(system_file))
    user_file = user_config_path(env) if user_file is None else user_file
    layer(_read_toml(user_file), str(user_file))
    layer({n: _from_env_text(n, env[f"LLMD_{n.upper()}"]) for n in FIELDS if f"LLMD_{n.upper()}" in env}, "environment")
    layer({k: v for k, v in (flags or {}).items() if v is not None}, "command line")
    if not values.get("socket"):
        values["socket"] = str(paths.default_socket_path(env))
    return Settings(**values), source


def describe(settings: Settings, source: dict[str, str]) -> str:
    """One line per setting: ``name = value    # source`` (TOML-like, for --print-config)."""
    width = max(len(n) for n in FIELDS)
    lines = []
    for name in FIELDS:
        value = getattr(settings, name)
        shown = "# unset" if value is None else (repr(value).lower() if isinstance(value, bool) else
                                                  f'"{value}"' if isinstance(value, str) else repr(value))
        lines.append(f"{name:<{width}} = {shown:<40} # {source[name]}")
    return "\n".join(lines)
