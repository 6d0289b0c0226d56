"""The ``fastllm`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastllm`` console script."""
    parser = argparse.ArgumentParser(prog="fastllm", description="fastllm command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="show what fastllm sees on this machine")
    args = parser.parse_args(argv)
    if args.command == "env":
        from fastllm import __version__

        print(f"fastllm {__version__}, Python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
