"""Every code block in README.md runs as written.

The convention (follow it when you add a README section):

* Every fenced block tagged ``python`` is executed as a script, each in a fresh
  Python process started from an empty temporary folder, and must exit 0. End a
  block with an ``assert`` on what it claims, so the test checks behaviour.
* A block that imports an optional library (any of :data:`OPTIONAL`, found by
  parsing its ``import`` statements) is skipped when that library is not
  importable. A block that imports ``cupy`` also needs a GPU.
* For needs that imports do not show, put an HTML comment on the line(s) right
  before the block:
  ``<!-- readme-test: requires gpu -->`` (names are importable modules or
  ``gpu``, separated by spaces), or ``<!-- readme-test: skip REASON -->`` for a
  block that must never run (say why).
* Blocks tagged ``bash``, ``text`` or anything else are not executed. The two
  command lines at the top of the README are checked separately: each is one
  line, and the demo line is run (at a small size).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from scaler_core import _cli

README = Path(__file__).resolve().parents[2] / "README.md"

#: Optional libraries a block may import; it is skipped when one is missing.
OPTIONAL = frozenset(
    {
        "cupy",
        "equinox",
        "flax",
        "hypothesis",
        "jax",
        "jmp",
        "keras",
        "matplotlib",
        "mpi4py",
        "numba",
        "optax",
        "sklearn",
        "torch",
        "tqdm",
    }
)
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*readme-test:\s*(requires|skip)\b(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of the README."""

    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    markers: tuple[tuple[str, str], ...]

    @property
    def id(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        return f"line{self.line}-{self.lang}-{first[:30]}"


def parse_blocks(text: str) -> list[Block]:
    """Fenced blocks with the ``readme-test`` markers on the lines just above them."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"README.md line {start + 1}: code fence never closed")
        markers: list[tuple[str, str]] = []
        j = start - 1
        while j >= 0 and (lines[j].strip() == "" or _MARKER.match(lines[j])):
            marker = _MARKER.match(lines[j])
            if marker:
                markers.append((marker.group(1), marker.group(2).strip()))
            j -= 1
        blocks.append(Block(fence.group(1), "\n".join(body) + "\n", start + 1, tuple(markers)))
        i += 1
    return blocks


BLOCKS = parse_blocks(README.read_text(encoding="utf-8"))
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang == "python"]


def imported_modules(code: str) -> set[str]:
    """Top-level names of every module the code imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names


@cache
def has_gpu() -> bool:
    """Whether CuPy is installed and sees at least one GPU."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # any CUDA failure means no usable GPU
        return False


@cache
def has_mpi() -> bool:
    """Whether mpi4py finds an MPI library (probed in a child: importing MPI initialises it)."""
    probe = subprocess.run(
        [sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, check=False
    )
    return probe.returncode == 0


def missing_requirements(block: Block) -> list[str]:
    """What this block needs that this machine lacks."""
    needs = imported_modules(block.code) & OPTIONAL
    for kind, args in block.markers:
        if kind == "requires":
            needs.update(args.split())
    if "cupy" in needs:
        needs.add("gpu")
    missing = []
    for need in sorted(needs):
        if need == "gpu":
            if not has_gpu():
                missing.append("a GPU")
        elif importlib.util.find_spec(need) is None:
            missing.append(need)
        elif need == "mpi4py" and not has_mpi():
            missing.append("an MPI library mpi4py can load (tests/test_mpi.py fails on that)")
    return missing


def test_readme_has_python_blocks() -> None:
    assert len(PYTHON_BLOCKS) >= 2, "the README lost its quickstarts"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.id for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    for kind, reason in block.markers:
        if kind == "skip":
            pytest.skip(f"README.md line {block.line}: marked skip: {reason}")
    missing = missing_requirements(block)
    if missing:
        pytest.skip(f"README.md line {block.line} needs {', '.join(missing)}")
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, (
        f"README.md block at line {block.line} failed:\n{result.stdout}\n{result.stderr}"
    )


# ----------------------------------------------------------- the top commands
def _top_commands() -> tuple[str, str]:
    """The first two bash blocks: the demo command line and the test command line."""
    bash = [b for b in BLOCKS if b.lang == "bash"]
    assert len(bash) >= 2, "the README must open with the demo and test command lines"
    demo, tests = bash[0], bash[1]
    assert PYTHON_BLOCKS
    assert demo.line < tests.line < PYTHON_BLOCKS[0].line
    for block in (demo, tests):
        assert len(block.code.strip().splitlines()) == 1, f"line {block.line}: one line only"
    return demo.code.strip(), tests.code.strip()


def test_top_test_command_is_pytest_after_installing_the_test_extra() -> None:
    _, tests = _top_commands()
    install, _, run = tests.partition(" && ")
    assert install.startswith("pip install")
    extras = re.search(r'"\.\[([\w,-]+)\]"', install)  # ".[test]" or ".[test,fast]"
    assert extras is not None, install
    assert "test" in extras.group(1).split(","), install
    assert run == "pytest", "CI (.ci/run) runs plain pytest: keep the README's line the same"
    assert "\npytest\n" in (README.parent / ".ci" / "run").read_text(encoding="utf-8")


def test_top_demo_command_runs(tmp_path: Path) -> None:
    """The README's demo line, after its install, at a small size."""
    demo, _ = _top_commands()
    install, _, run = demo.partition(" && ")
    assert install.startswith("pip install")
    assert '".[demo]"' in install
    argv = shlex.split(run)
    assert argv[:2] == ["scaler-core", "demo"]
    _cli.build_parser().parse_args(argv[1:])  # every option it shows exists
    if "--plot" in argv:
        pytest.importorskip("matplotlib", reason="the demo line draws a plot")
    small = ["--steps", "20", "--dataset", "synthetic"]  # argparse: the last value wins
    result = subprocess.run(
        [sys.executable, "-m", "scaler_core", *argv[1:], *small],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "float16 + scaler-core" in result.stdout
    if "--plot" in argv:
        plot = argv[argv.index("--plot") + 1]
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markers_are_understood() -> None:
    text = (
        "<!-- readme-test: requires gpu nosuchmodule -->\n"
        "```python\nimport numpy\n```\n\n"
        "<!-- readme-test: skip shows a pattern only -->\n\n"
        "```python\nimport torch\n```\n"
    )
    first, second = parse_blocks(text)
    assert first.markers == (("requires", "gpu nosuchmodule"),)
    assert "nosuchmodule" in missing_requirements(first)
    assert second.markers == (("skip", "shows a pattern only"),)
    assert imported_modules("import jax.numpy as jnp\nfrom optax import adam\n") == {
        "jax",
        "optax",
    }
