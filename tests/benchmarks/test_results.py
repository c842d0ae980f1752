"""benchmarks/results/ holds the current results only, in one naming scheme, each cited.

The scheme is benchmarks/_results.py's. Docs and scripts cite a result by its path from
the repository root; ``{1,2,3}`` and ``*`` in a cited path stand for several files, as in
a shell, and a shell variable (``$n``) for a run's number. Every cited file must exist,
and every file must be cited: a run that no doc shows any more is deleted (git keeps it).
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
#: The files that can cite a result: docs, scripts, configuration.
_SUFFIXES = {".md", ".py", ".sh", ".toml"}
_CITED = re.compile(r"benchmarks/results/([\w.{},*$-]*)")


def _results() -> list[str]:
    """The names in benchmarks/results/, less the harness's unfinished writes (``*.tmp``,
    which git ignores)."""
    return sorted(p.name for p in RESULTS.iterdir() if p.suffix != ".tmp")


def _citing_files() -> Iterator[Path]:
    """Every file that may cite a result: the suffixes above and .ci's scripts, outside
    hidden folders, virtual environments, build outputs and the results themselves."""
    for folder, subfolders, files in os.walk(ROOT):
        here = Path(folder)
        subfolders[:] = sorted(
            name
            for name in subfolders
            if (not name.startswith(".") or name == ".ci")
            and name not in {"build", "dist", "__pycache__"}
            and not name.endswith(".egg-info")
            and not (here / name / "pyvenv.cfg").exists()
            and here / name != RESULTS
        )
        for name in sorted(files):
            path = here / name
            if (path.suffix in _SUFFIXES or here.name == ".ci") and path != Path(__file__):
                yield path


def expand(cited: str) -> list[str]:
    """A cited name as shell patterns: ``a-{1,2}.json`` is ``a-1.json`` and ``a-2.json``;
    ``$n`` is a run's number."""
    cited = re.sub(r"\$\{?\w+\}?", "[0-9]*", cited)
    braces = re.search(r"\{([^{}]*)\}", cited)
    if braces is None:
        return [cited]
    head, tail = cited[: braces.start()], cited[braces.end() :]
    return [name for alt in braces.group(1).split(",") for name in expand(head + alt + tail)]


def citations() -> dict[str, list[str]]:
    """Each cited name pattern, and where it is cited (``docs/jax.md:381``)."""
    found: dict[str, list[str]] = {}
    for path in _citing_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in _CITED.finditer(text):
            cited = match.group(1).rstrip(".,")  # the end of a sentence is not the name's
            if not cited:  # the folder itself
                continue
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(ROOT).as_posix()}:{line}"
            for name in expand(cited):
                found.setdefault(name, []).append(where)
    return found


def test_expand_reads_a_citation_as_the_shell_would() -> None:
    assert expand("a-{1,2,3}.json") == ["a-1.json", "a-2.json", "a-3.json"]
    assert expand("a{,-hot}-{1,2}.json") == ["a-1.json", "a-2.json", "a-hot-1.json", "a-hot-2.json"]
    assert expand("clip-cpu-$n.json") == ["clip-cpu-[0-9]*.json"]
    assert not fnmatch.fnmatchcase("clip-cpu-dropin-1.json", "clip-cpu-[0-9]*.json")


def test_every_result_follows_the_naming_scheme(
    repo_module: Callable[[str], ModuleType],
) -> None:
    scheme = repo_module("benchmarks/_results.py")
    assert all(script.is_file() for script in scheme.benchmarks().values())
    odd = [name for name in _results() if scheme.pattern().fullmatch(name) is None]
    assert not odd, (
        f"benchmarks/results/ holds {odd}: name each <benchmark>-<device>[-<variant>]-<n>.json "
        f"(benchmarks/_results.py), with a benchmark of {sorted(scheme.benchmarks())}"
    )


def test_every_cited_result_exists() -> None:
    names = _results()
    cited = citations()
    assert cited, "no doc cites benchmarks/results/ any more: the search is broken"
    missing = {
        pattern: where for pattern, where in cited.items() if not fnmatch.filter(names, pattern)
    }
    assert not missing, f"cited, but not in benchmarks/results/: {missing}"


def test_every_result_is_cited() -> None:
    """Only the results a doc shows are kept: a result no one cites is an old run."""
    cited = list(citations())
    uncited = [name for name in _results() if not any(fnmatch.fnmatchcase(name, p) for p in cited)]
    assert not uncited, (
        f"benchmarks/results/ holds {uncited}, which nothing cites by its path "
        f"benchmarks/results/NAME: cite it where its numbers are shown, or delete it "
        f"(git keeps the history)"
    )


def test_a_new_run_takes_the_next_number(
    repo_module: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    scheme = repo_module("benchmarks/_results.py")
    for name in ("unscale-cpu-1.json", "unscale-cpu-3.json", "unscale-cpu-hot-7.json"):
        (tmp_path / name).write_text("{}")
    (tmp_path / "clip-cpu-5.json").write_text("{}")
    assert scheme.next_result("unscale", "cpu", folder=tmp_path) == tmp_path / "unscale-cpu-4.json"
    assert (
        scheme.next_result("unscale", "cpu", "hot", folder=tmp_path).name
        == "unscale-cpu-hot-8.json"
    )
    assert scheme.next_result("unscale", "cpu", "small", folder=tmp_path).name == (
        "unscale-cpu-small-1.json"
    )
    assert scheme.next_result("jax", "gpu", "sync-tree", folder=tmp_path).name == (
        "jax-gpu-sync-tree-1.json"
    )
    for bad in (("unscale", "tpu", ""), ("unscale", "cpu", "Hot"), ("bench_clip", "cpu", "")):
        with pytest.raises(ValueError, match="does not follow"):
            scheme.next_result(*bad, folder=tmp_path)
