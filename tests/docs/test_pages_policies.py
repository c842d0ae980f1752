"""The policy, testing-kit and simulator examples of docs/policies.md and docs/simulate.md
run as written and print what their comments say."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import scaler_core as sc
from scaler_core import PolicyViolationError
from scaler_core.testing import check_policy

DOCS = Path(__file__).resolve().parents[2] / "docs"
#: (page, section title): the sections whose examples are checked here. A page's title
#: ("# ...") stands for the whole page.
SECTIONS = (
    ("policies.md", "## Policies and presets"),
    ("policies.md", "## Your own policy"),
    ("policies.md", "## Testing your own policy"),
    ("simulate.md", "# Simulating a trace"),
)


def _section(page: str, title: str) -> str:
    text = (DOCS / page).read_text(encoding="utf-8")
    if title.startswith("# "):
        assert text.startswith(f"{title}\n"), f"docs/{page} lost its title {title!r}"
        return text
    start = text.index(f"\n{title}\n")
    end = text.find("\n## ", start + len(title) + 1)
    return text[start : None if end < 0 else end]


def _blocks(lang: str) -> list[str]:
    return [
        block
        for page, title in SECTIONS
        for block in re.findall(rf"```{lang}\n(.*?)```", _section(page, title), flags=re.S)
    ]


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_examples_run_and_print_what_they_say(index: int) -> None:
    code = _blocks("python")[index]
    namespace: dict[str, Any] = {"__name__": "docs_example"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"docs python block {index}", "exec"), namespace)
        for name, fn in list(namespace.items()):
            if name.startswith("test_") and callable(fn):
                fn()
    printed = out.getvalue().splitlines()
    claims = [line.partition("  # ")[2] for line in code.splitlines() if line.startswith("print(")]
    assert len(printed) == len(claims)
    for line, claim in zip(printed, claims, strict=True):
        if not claim:
            continue
        expected = claim.split(":")[0].split(" (")[0].split(" where")[0].strip()
        assert line.startswith(expected), (line, claim)


def test_bash_examples_run(tmp_path: Path) -> None:
    plots = importlib.util.find_spec("matplotlib") is not None
    for block in _blocks("bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()
            if not command:
                continue
            argv = shlex.split(command)
            if "--plot" in argv and not plots:  # the rest of the line still runs
                at = argv.index("--plot")
                argv = argv[:at] + argv[at + 2 :]
            if argv[0] == "scaler-core":
                argv = [sys.executable, "-m", "scaler_core", *argv[1:]]
            elif argv[0] == "python":
                argv[0] = sys.executable
            subprocess.run(argv, cwd=tmp_path, check=True, capture_output=True, timeout=300)


def test_the_documented_failure_of_capped_is_found() -> None:
    def capped(state: sc.ScalerState, found: Any) -> sc.ScalerState:
        new = sc.update(state, found)
        return dataclasses.replace(new, scale=min(new.scale, 2.0**20))

    with pytest.raises(PolicyViolationError, match=r"broke bounds: invariant broken: "):
        check_policy(capped)


def test_the_shown_nan_burst_table_is_current() -> None:
    shown = re.search(r"```text\n(trace nan-burst.*?)```", _section(*SECTIONS[3]), flags=re.S)
    assert shown is not None
    policies = ["--policy", "torch", "--policy", "jmp", "--policy", "deepspeed"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaler_core",
            "simulate",
            "nan-burst",
            *policies,
            "--policy",
            "megatron",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert proc.stdout == shown.group(1)
