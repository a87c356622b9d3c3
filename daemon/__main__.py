"""`python -m llmd.daemon serve|status ...`: the daemon's commands without the main CLI."""
import argparse
import sys

from .cli import add_serve_parser, add_status_parser


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmd.daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_status_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
