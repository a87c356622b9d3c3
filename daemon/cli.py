"""The `llmd serve` subcommand, for the main command line to mount.

    sub = parser.add_subparsers()
    add_serve_parser(sub)
    args = parser.parse_args(); sys.exit(args.func(args))

Its flags are derived from the settings' fields (EngineConfig and DaemonSettings, llmd.options).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from llmd.options import add_flags, given
from llmd.runtime.config import EngineConfig

from . import settings as settings_mod
from .serve import serve
from .settings import DaemonSettings


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="run the llmd daemon on a local ZeroMQ socket",
                              description="Run the llmd daemon. Settings come from /etc/llmd/llmd.toml, "
                              "$XDG_CONFIG_HOME/llmd/llmd.toml, LLMD_* variables and these flags, in "
                              "increasing precedence; each flag --NAME-WITH-DASHES is the key name_with_underscores "
                              "of llmd.toml and the variable LLMD_NAME_WITH_UNDERSCORES.")
    p.add_argument("--model", "--engine", dest="model", help=EngineConfig.__dataclass_fields__["model"].metadata["help"])
    add_flags(p.add_argument_group("engine"), EngineConfig, skip=("model",))
    add_flags(p.add_argument_group("daemon"), DaemonSettings)
    p.add_argument("--config", metavar="FILE", help="user configuration file instead of $XDG_CONFIG_HOME/llmd/llmd.toml")
    p.add_argument("--print-config", action="store_true",
                   help="print the merged settings and where each came from, then exit")
    p.set_defaults(func=run_serve)
    return p


def run_serve(args) -> int:
    """Load settings and run the daemon; once it has started, this ends the process itself."""
    try:
        s, source = settings_mod.load(given(args, settings_mod.Settings),
                                      user_file=Path(args.config) if args.config else None)
    except settings_mod.SettingsError as e:
        print(f"llmd serve: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(settings_mod.describe(s, source))
        return 0
    code = serve(s)
    # Exit at once: interpreter teardown with torch loaded takes seconds, which would eat into
    # systemd's stop timeout after the drain is already complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
