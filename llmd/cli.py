"""The `llmd` command line: one dispatcher, each subcommand's module imported only when used."""
from __future__ import annotations

import argparse
import sys

from llmd import __version__
from llmd.clients.cli import add_client_parsers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmd", description="llmd: a local low-latency LLM inference daemon.")
    parser.add_argument("--version", action="version", version=f"llmd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # each subcommand's module is imported here, by name, so that the client commands stay light
    for module, adders in (("llmd.generate", ("add_generate_parser",)),
                           ("llmd.bench.cli", ("add_bench_parser",)),
                           ("llmd.daemon.cli", ("add_serve_parser",)),
                           ("llmd.training.distill", ("add_distill_parser",)),
                           ("llmd.export.cli", ("add_export_parser",)),
                           ("llmd.clients.cli", ("add_client_parsers",)),
                           ("llmd.bench.doctor_cli", ("add_doctor_parser",)),
                           ("llmd.import_cli", ("add_import_parser",)),
                           ("llmd.models_real", ("add_models_parser",)),
                           ("llmd.models_cli", ("add_models_parsers",))):
        try:
            mod = __import__(module, fromlist=list(adders))
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        for name in adders:
            if hasattr(mod, name):
                getattr(mod, name)(sub)
    return parser


CLIENT_COMMANDS = ("run", "complete", "lsp", "voice", "batch", "status", "http")


def build_client_parser() -> argparse.ArgumentParser:
    """Only the client commands: they start fast and never import torch."""
    parser = argparse.ArgumentParser(prog="llmd")
    add_client_parsers(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    light = bool(argv) and argv[0] in CLIENT_COMMANDS
    parser = build_client_parser() if light else build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
