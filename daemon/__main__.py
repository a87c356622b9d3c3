"""`python -m llmd.daemon serve ...`: the daemon's command without the main CLI."""
import argparse
import sys

from .cli import add_serve_parser


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmd.daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
