"""How the files in ``benchmarks/results/`` are named: one scheme, defined here only.

``<benchmark>-<device>[-<variant>]-<n>.json``, for example ``clip-cpu-1.json``,
``clip-cpu-dropin-2.json``, ``unscale-cpu-hot-3.json``:

* ``benchmark``: the script that measured it, without ``bench_`` and with ``-`` for
  ``_`` (``clip`` is ``bench_clip.py``, ``optax-clip`` is ``bench_optax_clip.py``,
  ``mpi-found-reduce`` is ``mpi_found_reduce.py``); ``unscale`` is ``python -m benchmarks``;
* ``device``: where it ran, as the scripts' ``--device`` spells it (``cpu``, ``cuda``,
  ``gpu``);
* ``variant`` (none for a script's default run): what sets the run apart, an option
  (``hot`` for ``--cache hot``, ``sync-tree`` for ``--sync tree``, ``small``) or what
  it was run to measure (``dropin``, ``watch``); lowercase words joined by ``-``;
* ``n``: 1, 2, 3 ... for the runs of one command.

A result written up by hand (a table of several runs) is a ``.md`` file named the same
way. The folder holds the current results only: each file is cited, by its path from
the repository root, in a doc that shows its numbers, and a run no doc cites any more
is deleted (git keeps it). ``tests/benchmarks/test_results.py`` checks all of this.
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEVICES = ("cpu", "cuda", "gpu")
SUFFIXES = (".json", ".md")
_WORDS = r"[a-z0-9]+(?:-[a-z0-9]+)*"


def benchmarks() -> dict[str, Path]:
    """Every benchmark's name in the scheme, and the file that runs it."""
    names = {"unscale": HERE / "__main__.py"}
    for script in sorted(HERE.glob("*.py")):
        if not script.name.startswith("_"):
            names[script.stem.removeprefix("bench_").replace("_", "-")] = script
    return names


def pattern() -> re.Pattern[str]:
    """A results file's name, with groups ``benchmark``, ``device``, ``variant``, ``n``."""
    names = "|".join(re.escape(name) for name in sorted(benchmarks(), key=len, reverse=True))
    suffixes = "|".join(re.escape(suffix) for suffix in SUFFIXES)
    return re.compile(
        rf"(?P<benchmark>{names})-(?P<device>{'|'.join(DEVICES)})"
        rf"(?:-(?P<variant>{_WORDS}))?-(?P<n>[1-9][0-9]*)(?:{suffixes})"
    )


def next_result(benchmark: str, device: str, variant: str = "", folder: Path = RESULTS) -> Path:
    """Where a new run's JSON goes: the next ``n`` after the same runs in ``folder``.

    Raises:
        ValueError: The name would not follow the scheme (an unknown benchmark or
            device, a variant that is not lowercase words joined by ``-``).
    """
    stem = "-".join(part for part in (benchmark, device, variant) if part)
    scheme = pattern()
    taken = [
        int(match["n"])
        for path in folder.glob(f"{stem}-*")
        if (match := scheme.fullmatch(path.name))
        and (match["benchmark"], match["device"], match["variant"] or "")
        == (benchmark, device, variant)
    ]
    name = f"{stem}-{max(taken, default=0) + 1}.json"
    match = scheme.fullmatch(name)
    if match is None or (match["benchmark"], match["device"]) != (benchmark, device):
        raise ValueError(
            f"{name!r} does not follow <benchmark>-<device>[-<variant>]-<n>.json, with a "
            f"benchmark of {sorted(benchmarks())} and a device of {list(DEVICES)}"
        )
    return folder / name
