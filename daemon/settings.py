"""The daemon's settings: its own (``DaemonSettings``) and the engine's (``EngineConfig``), declared once
each and merged into one flat namespace, ``Settings``, whose names are llmd.toml's keys.

Precedence, lowest first: built-in defaults, /etc/llmd/llmd.toml, $XDG_CONFIG_HOME/llmd/llmd.toml
(or ~/.config), LLMD_* environment variables, command-line flags. ``load`` also returns where
each value came from, for ``llmd serve --print-config``. An unknown key in a file, or an unknown
LLMD_* variable, is an error that names it and where it was.
"""
from __future__ import annotations

import dataclasses
import grp
import ipaddress
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, get_type_hints

from llmd import protocol
from llmd.options import OptionError, check_value, env_name, parse_text
from llmd.runtime.config import EngineConfig, setting
from llmd.runtime.errors import InvalidRequest

SYSTEM_CONFIG = Path("/etc/llmd/llmd.toml")
# LLMD_* variables that are not settings: the system service's socket, and the test suite's own
OTHER_VARIABLES = ("LLMD_SYSTEM", "LLMD_SOCKET", "LLMD_DEMO_MODELS", "LLMD_TEST_THREADS")
LOG_LEVELS = ("debug", "info", "warning", "error")


class SettingsError(OptionError):
    code = "config"


@dataclass(frozen=True)
class DaemonSettings:
    """What only the daemon has: where it listens, how it treats clients, how it stops."""

    socket: str = setting("", help="ipc socket path (default $XDG_RUNTIME_DIR/llmd/llmd.sock, or /run/llmd/llmd.sock)")
    group: Optional[str] = setting(
        None, help="let this group's members connect: socket 0660 in a 0750 directory, both the group's (default: no "
                   "group, the socket is the owner's alone, 0600 in 0700); a directory that already exists is left as it is")
    tcp: Optional[str] = setting(None, help="also listen on this tcp://HOST:PORT endpoint (off unless given)")
    http: Optional[str] = setting(
        None, help="also serve `llmd http`'s HTTP front (OpenAI, llama.cpp and Ollama dialects, /metrics) on "
                   "HOST:PORT, for example 127.0.0.1:8080 (off unless given; loopback only unless http_allow_remote)")
    http_allow_remote: bool = setting(False, help="let `http` be a non-loopback address (needs http_api_key_file)")
    http_api_key_file: Optional[str] = setting(
        None, help="the HTTP front requires 'Authorization: Bearer KEY' with the key in this file")
    max_queue: int = setting(64, unit="requests", help="requests in flight (queued and running) before new ones are "
                                                       "refused with `busy`")
    max_message_bytes: int = setting(1 << 20, unit="bytes", help="largest message a client may send; a larger one "
                                                                 "drops the connection")
    send_hwm: int = setting(1000, unit="messages", help="messages buffered per client before it counts as stuck")
    send_buffer_bytes: int = setting(0, unit="bytes", help="kernel send buffer per connection (0: the OS default)")
    heartbeat_ivl_ms: int = setting(1000, unit="ms", help="interval of the ZeroMQ heartbeats to each client")
    heartbeat_timeout_ms: int = setting(3000, unit="ms", help="a client silent this long is dropped")
    keepalive_s: float = setting(0.25, unit="seconds",
                                 help="probe clients with work in flight but no output for this long")
    drain_grace_s: float = setting(10.0, unit="seconds",
                                   help="on SIGTERM, time to let in-flight requests finish before cancelling them")
    warmup: bool = setting(True, help="run one short request through the engine before reporting ready")
    warm: Optional[str] = setting(
        None, help="prompts to compute into the prefix cache (and the kv_disk tier) once the model is loaded, at "
                   "batch priority while clients are served: a JSON Lines file, one {\"prompt\": TEXT} or "
                   "{\"messages\": [{\"role\": ..., \"content\": ...}]} a line, optionally with \"cache_salt\" "
                   "(at most 256 prompts, 8 MiB; a bad file stops the start with its line named)")
    log_level: str = setting("info", help="log verbosity", choices=LOG_LEVELS)


def http_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port); raises SettingsError."""
    host, sep, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise SettingsError(f"http must be HOST:PORT, for example 127.0.0.1:8080, got {value!r}")
    return host, int(port)


def check_http(value: str, allow_remote: bool, key_file: Optional[str]) -> None:
    """The HTTP front's address, refused as `llmd http` refuses it: loopback only unless asked, and
    then only with a key."""
    host, _ = http_address(value)
    if _is_loopback(host):
        return
    if not allow_remote:
        raise SettingsError(f"refusing to listen on {host}: only 127.0.0.1, ::1 or localhost by default; set "
                            "http_allow_remote (--http-allow-remote) with http_api_key_file to serve other machines")
    if not key_file:
        raise SettingsError(f"refusing to listen on {host} without a key: set http_api_key_file "
                            "(--http-api-key-file FILE; clients then send 'Authorization: Bearer <key>')")


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _settings_fields():
    """EngineConfig's fields (its model optional: the daemon may start without one and say so), then
    DaemonSettings'; the two must not share a name."""
    clash = {f.name for f in dataclasses.fields(EngineConfig)} & {f.name for f in dataclasses.fields(DaemonSettings)}
    assert not clash, f"EngineConfig and DaemonSettings both declare {clash}"
    for cls in (EngineConfig, DaemonSettings):
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            optional = f.default is dataclasses.MISSING
            yield (f.name, Optional[hints[f.name]] if optional else hints[f.name],
                   dataclasses.field(default=None if optional else f.default, metadata=f.metadata))


class _SettingsChecks:
    def __post_init__(self):
        try:
            for f in dataclasses.fields(self):
                check_value(type(self), f.name, getattr(self, f.name), "settings")
        except OptionError as e:
            raise SettingsError(str(e)) from None
        positive = ("max_queue", "max_message_bytes", "send_hwm", "heartbeat_ivl_ms", "heartbeat_timeout_ms")
        for name in positive:
            if getattr(self, name) <= 0:
                raise SettingsError(f"{name} must be positive, got {getattr(self, name)}")
        if self.send_buffer_bytes < 0:
            raise SettingsError(f"send_buffer_bytes must be >= 0, got {self.send_buffer_bytes}")
        for name in ("keepalive_s", "drain_grace_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise SettingsError(f"{name} must be a finite number >= 0, got {v}")
        if self.tcp is not None and not self.tcp.startswith("tcp://"):
            raise SettingsError(f"tcp must be a tcp://host:port endpoint, got {self.tcp!r}")
        if self.http is not None:
            check_http(self.http, self.http_allow_remote, self.http_api_key_file)
        if self.warm is not None and not self.warm.strip():
            raise SettingsError("warm must be the path of a file of prompts (JSON Lines)")
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.group is not None:
            try:
                grp.getgrnam(self.group)
            except KeyError:
                raise SettingsError(f"group {self.group!r} does not exist: create it (groupadd), or leave group "
                                    "unset for a socket only its owner can use") from None
        try:
            self.engine_config(model=self.model or "-")
        except InvalidRequest as e:
            raise SettingsError(str(e)) from None

    def engine_config(self, **overrides) -> EngineConfig:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**{**values, **overrides})

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else protocol.default_socket_path()

    @property
    def endpoint(self) -> str:
        return protocol.endpoint(self.socket_path)


Settings = dataclasses.make_dataclass("Settings", list(_settings_fields()), bases=(_SettingsChecks,), frozen=True,
                                      namespace={"__doc__": "The daemon's settings and the engine's, as in llmd.toml.",
                                                 "__module__": __name__})
FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
DAEMON_FIELDS = tuple(f.name for f in dataclasses.fields(DaemonSettings))
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineConfig))


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
        raise SettingsError(f"{path}: unknown setting(s) {', '.join(unknown)}; the settings are listed by "
                            "`llmd serve --print-config`")
    try:
        return {k: check_value(Settings, k, v, str(path)) for k, v in data.items()}
    except OptionError as e:
        raise SettingsError(str(e)) from None


def _read_env(env) -> dict:
    names = {env_name(n): n for n in FIELDS}
    unknown = sorted(k for k in env if k.startswith("LLMD_") and k not in names and k not in OTHER_VARIABLES)
    if unknown:
        raise SettingsError(f"the environment: unknown setting variable(s) {', '.join(unknown)}; a setting's "
                            "variable is LLMD_ and its name in capitals (`llmd serve --print-config` lists them)")
    try:
        return {n: parse_text(Settings, n, env[v], v) for v, n in names.items() if v in env}
    except OptionError as e:
        raise SettingsError(str(e)) from None


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
    layer(_read_env(env), "environment")
    layer({k: v for k, v in (flags or {}).items() if v is not None}, "command line")
    if not values.get("socket"):
        values["socket"] = str(protocol.default_socket_path(env))
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
