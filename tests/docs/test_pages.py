"""Every code block in README.md and in every docs/*.md page runs as written.

The convention (follow it when you add a page or a section; docs/development.md
says the same for contributors):

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
* Every page has a title, the README links to every page, and the pages import
  public names only.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from scaler_core import _cli
from scaler_core._lifecycle import TRANSITIONS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The README first, then the docs pages in name order.
PAGES = [README, *sorted(DOCS.glob("*.md"))]

#: Optional libraries a block may import; it is skipped when one is missing.
OPTIONAL = frozenset(
    {
        "accelerate",
        "cupy",
        "datasets",
        "deepspeed",
        "equinox",
        "flax",
        "hypothesis",
        "jax",
        "jmp",
        "keras",
        "matplotlib",
        "megatron",
        "mlx",
        "mmengine",
        "mpi4py",
        "numba",
        "optax",
        "sklearn",
        "timm",
        "torch",
        "tqdm",
        "transformers",
        "trl",
    }
)
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*readme-test:\s*(requires|skip)\b(.*?)-->\s*$")


def _name(page: Path) -> str:
    """The page's path from the repository root (``README.md``, ``docs/jax.md``)."""
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    markers: tuple[tuple[str, str], ...]
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

    @property
    def id(self) -> str:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        return f"{self.page}:{self.line}-{self.lang}-{first[:30]}"


def parse_blocks(text: str, page: str = "README.md") -> list[Block]:
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
            raise AssertionError(f"{page} line {start + 1}: code fence never closed")
        markers: list[tuple[str, str]] = []
        j = start - 1
        while j >= 0 and (lines[j].strip() == "" or _MARKER.match(lines[j])):
            marker = _MARKER.match(lines[j])
            if marker:
                markers.append((marker.group(1), marker.group(2).strip()))
            j -= 1
        blocks.append(
            Block(fence.group(1), "\n".join(body) + "\n", start + 1, tuple(markers), page)
        )
        i += 1
    return blocks


BLOCKS = parse_blocks(README.read_text(encoding="utf-8"))
PAGE_BLOCKS = {
    _name(page): parse_blocks(page.read_text(encoding="utf-8"), _name(page)) for page in PAGES
}
PYTHON_BLOCKS = [b for blocks in PAGE_BLOCKS.values() for b in blocks if b.lang == "python"]


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
            missing.append(
                "an MPI library mpi4py can load (tests/integrations/test_mpi.py fails on that)"
            )
    return missing


def test_pages_have_python_blocks() -> None:
    assert len(PYTHON_BLOCKS) >= 2, "the pages lost their quickstarts"
    quickstart = [b for b in PAGE_BLOCKS["docs/numpy.md"] if b.lang == "python"]
    assert quickstart, "docs/numpy.md lost its quickstart"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.id for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    for kind, reason in block.markers:
        if kind == "skip":
            pytest.skip(f"{block.where}: marked skip: {reason}")
    missing = missing_requirements(block)
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)}")
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
        f"{block.where}: the block failed:\n{result.stdout}\n{result.stderr}"
    )


# ------------------------------------------------------------------ the pages
@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_page_has_a_title_and_an_introduction(page: Path) -> None:
    lines = page.read_text(encoding="utf-8").splitlines()
    assert lines, f"{_name(page)} is empty"
    assert re.fullmatch(r"# \S.*", lines[0]), f"{_name(page)} must start with a '# title' line"
    intro = next((ln for ln in lines[1:] if ln.strip()), "")
    assert not intro.startswith("#"), f"{_name(page)}: a short introduction comes before a section"


def test_readme_links_to_every_page() -> None:
    readme = README.read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", readme))
    pages = {_name(p) for p in PAGES[1:]}
    assert pages, "there are no docs pages"
    assert pages <= linked, f"the README's contents miss {sorted(pages - linked)}"
    assert linked <= pages, f"the README links to missing pages {sorted(linked - pages)}"


#: An import of a private module or name of scaler-core, or a command line that runs a
#: private module (``python -m scaler_core._cli.x``: users run ``scaler-core`` or
#: ``python -m scaler_core``). A file path in prose, to read, is fine.
_PRIVATE = re.compile(
    r"^\s*(?:from\s+scaler_core(?:\.\w+)*\._\w+\s+import"
    r"|import\s+scaler_core(?:\.\w+)*\._\w+"
    r"|from\s+scaler_core(?:\.\w+)*\s+import\s[^#\n]*\b_\w+)"
    r"|scaler_core\.backends\._\w+"
    r"|-m\s+scaler_core(?:\.\w+)*\._\w+",
    re.MULTILINE,
)
#: Names that moved or were renamed; the pages must not mention them.
_GONE = re.compile(
    r"_simulate|_numpy_fused|jax_utils|jax_optax|scaler_core\.gpu|scaler_core\.distributed"
    r"|allreduce_found|nccl_reduce_found|state_to_device"
)
#: A path that climbs out of a folder (``../x``), and a document named in capitals
#: (``NOTES.md``): each must resolve inside the repository.
_CLIMB = re.compile(r"(?:\.\./)+[\w./-]+")
_CAPS_DOC = re.compile(r"\b[A-Z][A-Z_]{2,}\.md\b")


def _user_files() -> list[Path]:
    return [*PAGES, *sorted((ROOT / "examples").glob("**/*.py"))]


@pytest.mark.parametrize("path", _user_files(), ids=[_name(p) for p in _user_files()])
def test_user_docs_name_public_modules_only(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    private = sorted({m.group(0) for m in _PRIVATE.finditer(text)})
    assert not private, f"{_name(path)} names private modules: {private}"
    gone = sorted({m.group(0) for m in _GONE.finditer(text)})
    assert not gone, f"{_name(path)} names what no longer exists: {gone}"
    climbs = {m.group(0) for m in _CLIMB.finditer(text)}
    outside = sorted(p for p in climbs if not _inside(path.parent / p))
    assert not outside, f"{_name(path)} points outside the repository: {outside}"
    docs = {m.group(0) for m in _CAPS_DOC.finditer(text)}
    missing = sorted(d for d in docs if not (ROOT / d).is_file() and not (DOCS / d).is_file())
    assert not missing, f"{_name(path)} names documents the repository does not hold: {missing}"


def _inside(target: Path) -> bool:
    """Whether ``target`` exists and lies inside the repository."""
    resolved = target.resolve()
    return resolved.is_relative_to(ROOT) and resolved.exists()


def test_relative_links_between_pages_resolve() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:\s]+\.md)(?:#[\w-]+)?\)", text):
            assert (page.parent / target).is_file(), f"{_name(page)} links to missing {target}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_anchors_between_pages_resolve() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)#([\w-]+)\)", text):
            linked = page if not target else page.parent / target
            assert anchor in _anchors(linked), f"{_name(page)}: no #{anchor} in {_name(linked)}"


# ------------------------------------------------------- the order of a step
def phase_table() -> str:
    """The facade's phase table as docs/reference.md shows it: rows = phases, columns =
    calls, each cell the next phase or "refused"."""
    calls = list(next(iter(TRANSITIONS.values())))
    rows = [
        "| phase | " + " | ".join(f"`{call.value}`" for call in calls) + " |",
        "|---" * (len(calls) + 1) + "|",
    ]
    for phase, outcomes in TRANSITIONS.items():
        assert list(outcomes) == calls, f"phase {phase} lists other calls"
        cells = [
            "refused" if isinstance(outcomes[call], str) else f"`{outcomes[call].name}`"
            for call in calls
        ]
        rows.append(f"| `{phase.name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _section(page: Path, title: str) -> str:
    text = page.read_text(encoding="utf-8")
    start = text.index(f"\n{title}\n")
    end = text.find("\n## ", start + len(title) + 2)
    return text[start : None if end < 0 else end]


def test_reference_shows_exactly_the_phase_table() -> None:
    section = _section(DOCS / "reference.md", "## The order of a step")
    shown = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert "\n".join(shown) == phase_table()


def test_reference_names_every_backend_check_in_order() -> None:
    from scaler_core.testing import BACKEND_CHECKS

    section = _section(DOCS / "reference.md", "## Checking a backend")
    prose = section.split("```")[0]
    named = [n for n in re.findall(r"`(\w+)`", prose) if n in BACKEND_CHECKS]
    assert named == list(BACKEND_CHECKS)


#: The header of docs/reference.md's table of the backend's members.
_MEMBERS_HEADER = "| member | required | what it does |"
#: Members a backend may add, looked up by name where they are used (scaler_core/_report.py
#: finds ``non_finite_counts`` with getattr): not in the protocol, not in BACKEND_MEMBERS.
_OPTIONAL_MEMBERS = {"non_finite_counts"}


def backend_member_rows() -> dict[str, str]:
    """docs/reference.md's table of backend members: each name and its "required" cell."""
    lines = _section(DOCS / "reference.md", "## Backends").splitlines()
    assert _MEMBERS_HEADER in lines, f"## Backends lost its table headed {_MEMBERS_HEADER!r}"
    start = lines.index(_MEMBERS_HEADER)
    assert re.fullmatch(r"(\|---)+\|", lines[start + 1]), lines[start + 1]
    members: dict[str, str] = {}
    for row in itertools.takewhile(lambda ln: ln.startswith("|"), lines[start + 2 :]):
        first, required, *_ = (cell.strip() for cell in row.strip("|").split("|"))
        name = re.fullmatch(r"`(\w+)`", first)
        assert name is not None, f"{row!r}: the first cell must be a member name in backticks"
        assert name.group(1) not in members, f"{name.group(1)} is listed twice"
        members[name.group(1)] = required
    return members


def test_reference_lists_every_namespace_duty() -> None:
    """docs/reference.md's namespace table names the members of NAMESPACE_DUTIES, in order."""
    from scaler_core.testing import NAMESPACE_DUTIES

    page = (DOCS / "reference.md").read_text(encoding="utf-8")
    header = "| namespace member | how the core calls it | what it must give |"
    assert header in page, f"docs/reference.md lost its namespace table headed {header!r}"
    rows = page[page.index(header) :].splitlines()[2:]
    rows = list(itertools.takewhile(lambda row: row.startswith("|"), rows))
    listed = [re.match(r"\| `(\w+)` \|", row) for row in rows]
    assert all(listed), rows
    assert [m.group(1) for m in listed if m] == list(NAMESPACE_DUTIES)


def test_reference_lists_every_backend_member() -> None:
    """The table names exactly the protocol's members: those a backend writes ("yes"),
    those the core writes once ("inherited"), and the optional ones."""
    import scaler_core as sc
    from scaler_core._backend import CORE_MEMBERS, KERNEL_MEMBERS

    rows = backend_member_rows()
    assert set(rows.values()) <= {"yes", "inherited", "optional"}, rows
    for cell, members in (("yes", KERNEL_MEMBERS), ("inherited", CORE_MEMBERS)):
        listed = tuple(sorted(name for name, c in rows.items() if c == cell))
        assert listed == tuple(sorted(members)), (
            f"docs/reference.md's {cell!r} members miss {sorted({*members} - {*listed})} and "
            f"add {sorted({*listed} - {*members})}, against scaler_core.Backend"
        )
    optional = {name for name, cell in rows.items() if cell == "optional"}
    assert optional == _OPTIONAL_MEMBERS
    numpy = sc.get_backend("numpy")
    assert all(callable(getattr(numpy, name, None)) for name in optional)  # built-ins have them


# ----------------------------------------------------------- the top commands
def _top_commands() -> tuple[str, str]:
    """The first two bash blocks: the demo command line and the test command line."""
    bash = [b for b in BLOCKS if b.lang == "bash"]
    assert len(bash) >= 2, "the README must open with the demo and test command lines"
    demo, tests = bash[0], bash[1]
    assert BLOCKS[:2] == [demo, tests], "the two command lines are the README's first blocks"
    readme_python = [b for b in BLOCKS if b.lang == "python"]
    assert all(demo.line < tests.line < b.line for b in readme_python)
    for block in (demo, tests):
        assert len(block.code.strip().splitlines()) == 1, f"line {block.line}: one line only"
    return demo.code.strip(), tests.code.strip()


def test_top_commands_open_the_first_screen() -> None:
    demo, tests = [b for b in BLOCKS if b.lang == "bash"][:2]
    assert tests.line < 40, "the two commands must be on the README's first screen"
    why = README.read_text(encoding="utf-8").splitlines().index("## Why")
    assert why < 40, "the README's Why starts on its first screen"
    assert demo.line < why


def test_top_test_command_is_pytest_after_installing_the_test_extra() -> None:
    _, tests = _top_commands()
    install, _, run = tests.partition(" && ")
    assert install.startswith("pip install")
    extras = re.search(r'"\.\[([\w,-]+)\]"', install)  # ".[test]" or ".[test,fast]"
    assert extras is not None, install
    assert "test" in extras.group(1).split(","), install
    assert run == "pytest", "CI (.ci/run) runs plain pytest: keep the README's line the same"
    assert "\npytest\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


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
    first, second = parse_blocks(text, "docs/example.md")
    assert first.markers == (("requires", "gpu nosuchmodule"),)
    assert "nosuchmodule" in missing_requirements(first)
    assert second.markers == (("skip", "shows a pattern only"),)
    assert first.id.startswith("docs/example.md:2-python")
    assert imported_modules("import jax.numpy as jnp\nfrom optax import adam\n") == {
        "jax",
        "optax",
    }


def test_a_cupy_block_needs_a_gpu() -> None:
    (block,) = parse_blocks("```python\nimport cupy as cp\n```\n", "docs/cupy.md")
    if not has_gpu():
        assert "a GPU" in missing_requirements(block)


def test_every_test_the_guarantees_name_exists() -> None:
    """docs/guarantees.md names the test behind each promise: each must be there."""
    text = (DOCS / "guarantees.md").read_text(encoding="utf-8")
    named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", text)
    assert len(named) >= 20, named
    for path, test in named:
        source = (ROOT / path).read_text(encoding="utf-8")
        if test:
            assert re.search(rf"^(def {test}\(|{test} = )", source, flags=re.M), f"{path}::{test}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_table_is_cut_in_two(page: Path) -> None:
    """A table row after a paragraph line renders as text: a table cut by a paragraph."""
    lines = page.read_text(encoding="utf-8").splitlines()
    fenced = False
    for i, (before, line) in enumerate(itertools.pairwise(["", *lines]), start=1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("|"):
            continue
        assert before.startswith(("|", "#")) or not before.strip(), (
            f"{_name(page)} line {i}: a table row right after a line of text"
        )


#: How the package's descriptions name each built-in backend's library.
_LIBRARY_NAMES = {
    "numpy": "NumPy",
    "cupy": "CuPy",
    "jax": "JAX",
    "torch": "PyTorch",
    "mlx": "MLX",
    "array_api": "Array API",
}


def test_the_package_descriptions_name_every_built_in_backend() -> None:
    """pyproject.toml's description and the package docstrings list the libraries served."""
    import tomllib

    from scaler_core import _registry

    assert set(_LIBRARY_NAMES) <= set(_registry.registered())
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    texts = {
        "pyproject.toml description": pyproject["project"]["description"],
        "scaler_core/__init__.py": ast.get_docstring(
            ast.parse((ROOT / "scaler_core" / "__init__.py").read_text(encoding="utf-8"))
        ),
        "backends/__init__.py": ast.get_docstring(
            ast.parse((ROOT / "backends" / "__init__.py").read_text(encoding="utf-8"))
        ),
    }
    for where, text in texts.items():
        words = " ".join(str(text).split())
        missing = [n for lib, n in _LIBRARY_NAMES.items() if n not in words and lib not in words]
        assert not missing, f"{where} leaves out {missing}: {words[:120]}"


def test_the_reference_pages_paddle_backend_is_the_example_ci_runs() -> None:
    """docs/reference.md shows examples/paddle_backend.py whole, as it is: the backend CI
    holds to the contract suite in Paddle's environment (tests/oracles)."""
    example = (ROOT / "examples" / "paddle_backend.py").read_text(encoding="utf-8")
    page = (DOCS / "reference.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)
    assert example in blocks
