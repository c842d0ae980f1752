"""tests/README.md names only what exists: files, hypothesis profiles, markers, fixtures.

A path from the repository root (``tests/core/test_config.py``) must exist; a file or
folder named alone (``test_contract.py``, ``mpi_scripts/``) must exist under tests/;
``<name>`` in either stands for any part (``test_<library>_backend.py``).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PAGE = TESTS / "README.md"
CONFTEST = TESTS / "conftest.py"

_ROOTS = ("tests", "scaler_core", "backends", "benchmarks", "docs", "examples", ".ci")
_PATH = re.compile(rf"(?<![\w./<>-])((?:{'|'.join(map(re.escape, _ROOTS))})/[\w./<>*-]*[\w>*])")
_NAMED = re.compile(r"`([\w<>./-]+(?:\.py|\.md|\.toml|/))`")
_LINK = re.compile(r"\]\(([^)#\s]+)")


def _text() -> str:
    return PAGE.read_text(encoding="utf-8")


def _glob(name: str) -> str:
    return re.sub(r"<\w+>", "*", name)


def _under_tests(name: str, paths: list[str]) -> bool:
    """Whether a file or folder of tests/ (``paths``, from tests/) ends in ``name``."""
    pattern = _glob(name).rstrip("/")
    return any(
        fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p, f"*/{pattern}") for p in paths
    )


def test_every_path_named_exists() -> None:
    text = _text()
    missing = sorted(
        {path for path in _PATH.findall(text) if not list(ROOT.glob(_glob(path).rstrip("/")))}
    )
    assert not missing, f"tests/README.md names paths the repository does not hold: {missing}"


def test_every_file_named_alone_exists_under_tests() -> None:
    """A bare name (``test_contract.py``, ``torch_scripts/``) is a file or folder of tests/;
    ``__init__.py`` is named as what tests/ must not hold, and it holds none."""
    assert not list(TESTS.rglob("__init__.py")), "tests/ is not a package (README.md says so)"
    paths = [p.relative_to(TESTS).as_posix() for p in TESTS.rglob("*")]
    named = {n for n in _NAMED.findall(_text()) if not n.startswith(_ROOTS) and n != "__init__.py"}
    named -= {"pyproject.toml", "README.md"}  # the repository root's, checked next
    assert (ROOT / "pyproject.toml").is_file()
    assert (ROOT / "README.md").is_file()
    missing = sorted(n for n in named if not _under_tests(n, paths))
    assert not missing, f"tests/README.md names files tests/ does not hold: {missing}"


def test_links_resolve() -> None:
    for target in _LINK.findall(_text()):
        assert (PAGE.parent / target).exists(), f"tests/README.md links to missing {target}"


def test_the_profiles_are_the_registered_ones() -> None:
    from hypothesis import settings

    text = _text()
    table = text[text.index("| profile |") :].split("\n\n")[0].splitlines()[2:]
    shown = set()
    for row in table:
        name = re.match(r"\| `(\w+)` \|", row)
        assert name is not None, f"tests/README.md's profile table: {row!r}"
        shown.add(name.group(1))
    conftest = CONFTEST.read_text(encoding="utf-8")
    registered = set(re.findall(r'register_profile\(\s*"(\w+)"', conftest))
    assert shown == registered
    for name in set(re.findall(r"HYPOTHESIS_PROFILE=(\w+)", text)):
        settings.get_profile(name)  # raises for a profile nobody registered


def test_the_markers_are_the_registered_ones() -> None:
    """The page names every marker pyproject.toml registers, and selects no other."""
    text = _text()
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^markers = \[(.*?)^\]", pyproject, flags=re.S | re.M)
    assert block is not None, "pyproject.toml registers no markers"
    registered = set(re.findall(r'^\s*"(\w+)\s*[:(]', block.group(1), flags=re.M))
    assert registered, block.group(0)
    assert all(f"`{name}`" in text for name in registered), registered
    for name in re.findall(r'-m "(?:not )?(\w+)"', text):
        assert name in registered, f"tests/README.md selects the unregistered marker {name!r}"


def test_the_shared_fixtures_are_named() -> None:
    fixtures = re.findall(r"@pytest\.fixture\s*\ndef (\w+)", CONFTEST.read_text(encoding="utf-8"))
    assert fixtures
    text = _text()
    assert all(f"`{name}`" in text for name in fixtures), fixtures
