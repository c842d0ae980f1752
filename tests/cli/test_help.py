"""Every command's ``--help`` is plain text: no reStructuredText from the docstrings."""

from __future__ import annotations

import argparse
import re

import pytest

from scaler_core._cli import COMMANDS, build_parser

#: What reStructuredText markup looks like in a docstring: ``literals``, :roles:`x`,
#: *emphasis*, **strong**, `interpreted`, and escaped spaces.
_RST = re.compile(r"``|:\w+:`|(?<![\w*])\*{1,2}\w[^*\n]*\*{1,2}(?![\w*])|`[^`\n]+`|\\ ")


def _helps() -> dict[str, str]:
    parser = build_parser()
    helps = {"scaler-core": parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps.update({name: sub.format_help() for name, sub in action.choices.items()})
    return helps


@pytest.mark.parametrize("command", ["scaler-core", *(m.rpartition(".")[2] for m in COMMANDS)])
def test_help_has_no_restructuredtext_markup(command: str) -> None:
    text = _helps()[command]
    assert not _RST.findall(text), (command, _RST.findall(text))


def test_the_simulate_help_keeps_the_module_docstring_words() -> None:
    text = " ".join(_helps()["simulate"].split())
    assert "(max_abs_grad). From the latter" in text
    assert "A trace is what a training run saw" in text


@pytest.mark.parametrize(
    ("rst", "plain"),
    [
        ("the ``max_abs_grad`` column", "the max_abs_grad column"),
        ("see :func:`scaler_core.update`", "see scaler_core.update"),
        ("a :class:`~scaler_core.ScalerState`", "a ScalerState"),
        ("a *trace* and **two**", "a trace and two"),
        ("``found``\\ s", "founds"),
        ("`interpreted`", "interpreted"),
        ("2 * 3 * 4, a*b", "2 * 3 * 4, a*b"),
        ("max_abs_grad * scale > 65504", "max_abs_grad * scale > 65504"),
    ],
)
def test_plain_text_strips_the_markup_docstrings_use(rst: str, plain: str) -> None:
    from scaler_core._cli import plain_text

    assert plain_text(rst) == plain
