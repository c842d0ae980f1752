"""benchmarks/bench_mlx.py works: its contenders agree, its report holds every row (not
timings), and bad options get one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from common_commands import run_command

SCRIPT = "benchmarks/bench_mlx.py"
ROWS = {"scaler_core", "scaler_core_clip", "naive", "naive_clip", "copy"}


def _run(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_command(sys.executable, SCRIPT, *argv, timeout=timeout)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_bench_checks_the_rows_then_times_them_all(tmp_path: Path, dtype: str) -> None:
    pytest.importorskip("mlx.core")
    out = tmp_path / "mlx.json"
    run = _run(
        *("--small", "--sets", "gpt2,many", "--many", "12", "--reps", "2"),
        *("--dtype", dtype, "--json", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["command"].endswith(f"--dtype {dtype} --json {out}")
    gpt2, many = report["results"]
    assert (gpt2["set"], gpt2["leaves"], many["set"], many["leaves"]) == ("gpt2", 148, "many", 12)
    for result in (gpt2, many):
        assert result["dtype"] == dtype
        assert set(result["median_ms"]) == ROWS
        assert all(len(s) == 2 for s in result["samples_s"].values())
        assert result["check"]["norm_rel_err"] <= 1e-6
        assert set(result["ratios"]) == {
            "naive_over_scaler_core",
            "naive_clip_over_scaler_core_clip",
            "scaler_core_over_copy",
            "scaler_core_clip_over_copy",
            "naive_over_copy",
        }
    assert "| gpt2 (148 x " in report["table"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (("--sets", "gpt3"), "--sets='gpt3'"),
        (("--dtype", "float64"), "--dtype='float64'"),
        (("--reps", "0"), "--reps=0"),
    ],
)
def test_mlx_bench_refuses_bad_options_in_one_line(argv: tuple[str, ...], names: str) -> None:
    run = _run(*argv, timeout=120)
    assert run.returncode == 2
    assert names in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
