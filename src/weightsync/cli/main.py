"""`weightsync` command line: one module per subcommand.

Each subcommand module defines `add_parser(subparsers)` and `run(args) -> int`.
Modules are imported only when their subcommand runs, so `weightsync --help`
stays fast. Exit codes: 0 success, 1 failure, 2 usage.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# subcommand -> module under weightsync.cli
SUBCOMMANDS = {
    "demo": "demo",
    "serve": "serve",
    "bench": "bench",
    "tiny-model": "tiny_model",
    "inspect": "inspect",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightsync",
        description="Verified weight sync from RL trainers to vLLM, SGLang and the embedded engine.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        try:
            mod = importlib.import_module(f"weightsync.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"weightsync.cli.{module}":
                raise
            continue  # subcommand not built yet
        mod.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    mod = importlib.import_module(f"weightsync.cli.{SUBCOMMANDS[args.command]}")
    try:
        return int(mod.run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
