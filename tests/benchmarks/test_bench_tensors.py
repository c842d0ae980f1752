"""benchmarks/bench_tensors.py works: its contenders agree, its report holds every row and
goal (not timings), and bad options get one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from common_commands import run_command

SCRIPT = "benchmarks/bench_tensors.py"


def _run(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_command(sys.executable, SCRIPT, *argv, timeout=timeout)


def test_the_tensor_bench_times_every_row_at_every_count(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "tensors.json"
    run = _run(
        *("--counts", "1,40", "--reps", "2", "--warmup", "0"), "--json", str(out), timeout=300
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    rows = {(r["row"], r["gradients"], r["tensors"]) for r in report["rows"]}
    assert rows == {
        (row, grads, n) for row in ("plain", "clip") for grads in ("kept", "fresh") for n in (1, 40)
    }
    assert all(r["pytorch_ms"] > 0 and r["dropin_ms"] > 0 for r in report["rows"])
    assert report["functional"]["arrays"] == 2000
    assert set(report["goals"]) == {
        "clip_at_2000",
        "plain_at_every_count",
        "functional_unnamed_over_named",
    }
    assert report["goals"]["clip_at_2000"]["speedup"] is None  # no 2,000 in this run


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (("--counts", "1,x"), "--counts='1,x'"),
        (("--counts", "0"), "--counts='0'"),
        (("--reps", "0"), "--reps=0"),
        (("--numpy-count", "-1"), "--numpy-count=-1"),
    ],
)
def test_the_tensor_bench_refuses_bad_options_in_one_line(
    argv: tuple[str, ...], names: str
) -> None:
    pytest.importorskip("torch")
    run = _run(*argv, timeout=120)
    assert run.returncode == 2
    assert names in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
