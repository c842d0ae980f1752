"""The ``scaler-core`` command line (also ``python -m scaler_core``).

Each command lives in its own module, listed in :data:`COMMANDS`. A command
module provides ``add_parser(subparsers)``, which adds its subparser and sets
``run=FUNCTION`` as a default; ``FUNCTION(args)`` returns the exit code.

Errors the user can fix are :class:`~scaler_core.ScalerError`\\ s: printed as one
line on stderr, exit code 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ._errors import ScalerError

__all__ = ["COMMANDS", "build_parser", "main"]

#: Modules that each add one subcommand with ``add_parser(subparsers)``.
COMMANDS: tuple[str, ...] = ("scaler_core._simulate",)

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every command of :data:`COMMANDS` registered.

    >>> build_parser().parse_args(["simulate", "spikes", "--dtype", "bfloat16"]).dtype
    'bfloat16'
    """
    from . import __version__  # noqa: PLC0415 (the package imports this module lazily)

    parser = argparse.ArgumentParser(
        prog="scaler-core", description="scaler-core: a framework-agnostic dynamic loss scaler."
    )
    parser.add_argument("--version", action="version", version=f"scaler-core {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it).

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` by default.

    Returns:
        0 on success, 2 for bad input (one line on stderr).
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ScalerError as exc:
        print(f"scaler-core {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
