"""The ``scaler-core`` command line (also ``python -m scaler_core``): the applications.

The library never imports this package; it imports the library's public and
private modules like any application would.

Each command lives in its own module, listed in :data:`COMMANDS`. A command
module provides ``add_parser(subparsers)``, which adds its subparser and sets
``run=FUNCTION`` as a default; ``FUNCTION(args)`` returns the exit code. Adding a
command is one line here.

Errors the user can fix (bad settings, a backend or optional package that is not
installed) are :class:`~scaler_core.ScalerError`\\ s: the CLI prints them as one
line on stderr and exits with code 2, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from scaler_core._errors import ScalerError

__all__ = ["COMMANDS", "build_parser", "main", "plain_text"]

#: Modules that each add one subcommand with ``add_parser(subparsers)``.
COMMANDS: tuple[str, ...] = ("scaler_core._cli.demo", "scaler_core._cli.simulate")

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_USAGE, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n"
        )


def _one_line(message: str) -> str:
    return " ".join(message.split())


#: reStructuredText in the docstrings that help texts are taken from: a role
#: (:func:`~a.b`, whose ``~`` keeps the last name), a ``literal``, `interpreted`
#: text, *emphasis* and **strong** (a word right after the opening star), and an
#: escaped space (``\ ``, which joins a word to the markup before it).
_ROLE = re.compile(r":\w+:`(~)?([^`]*)`")
_LITERAL = re.compile(r"``([^`]*)``")
_INTERPRETED = re.compile(r"`([^`]*)`")
_STRONG = re.compile(r"(?<![\w*])\*\*(\S[^*]*?)\*\*(?![\w*])")
_EMPHASIS = re.compile(r"(?<![\w*])\*(\S[^*]*?)\*(?![\w*])")


def plain_text(rst: str) -> str:
    """``rst`` (a docstring's reStructuredText) as plain text for a ``--help`` page.

    >>> plain_text("the ``max_abs_grad`` of :class:`~scaler_core.ScalerState`, a *trace*")
    'the max_abs_grad of ScalerState, a trace'
    """
    text = _ROLE.sub(lambda m: m.group(2).rpartition(".")[2] if m.group(1) else m.group(2), rst)
    text = _LITERAL.sub(r"\1", text)
    text = _INTERPRETED.sub(r"\1", text)
    text = _STRONG.sub(r"\1", text)
    text = _EMPHASIS.sub(r"\1", text)
    return text.replace("\\ ", "")


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with every command of :data:`COMMANDS` registered.

    >>> build_parser().parse_args(["demo", "--steps", "5"]).steps
    5
    """
    parser = _Parser(
        prog="scaler-core",
        description="scaler-core: a framework-agnostic dynamic loss scaler.",
    )
    from scaler_core import __version__  # noqa: PLC0415 (the package imports this lazily)

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
        0 on success, 2 for bad input (one line on stderr), 130 on Ctrl-C, 1 when
        stdout is closed early.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args))
    except ScalerError as exc:
        print(f"scaler-core {args.command}: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"scaler-core {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``scaler-core demo | head``): stop quietly, and keep
        # Python from complaining again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
