"""The benchmark harnesses work: options, contenders and their JSON (not timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from common_commands import run_command

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """A benchmark command line, run from the repository root."""
    return run_command(*argv, timeout=timeout)


def test_bound_kernel_multiplies_every_element_in_place(
    repo_module: Callable[[str], ModuleType],
) -> None:
    pytest.importorskip("numba")
    bound = repo_module("benchmarks/_bound_kernel.py")
    rng = np.random.default_rng(3)
    # one array spans several 1 MiB work items, with a ragged last one
    grads = [rng.standard_normal(n).astype(np.float32) for n in (1, 1000, 600_000)]
    before = [g.copy() for g in grads]
    table = bound.Table(grads)
    assert table.addrs.size == 1 + 1 + 3
    table.scale(0.5)
    for g, b in zip(grads, before, strict=True):
        np.testing.assert_array_equal(g, b * np.float32(0.5))
    with pytest.raises(ValueError, match="C-contiguous arrays of one dtype"):
        bound.Table([grads[0], grads[1].astype(np.float64)])


def test_harness_hot_cache_run_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "hot.json"
    run = _run(
        *(sys.executable, "-m", "benchmarks", "--small", "--sets", "2000x1024,4x16M"),
        *("--reps", "2", "--warmup", "1", "--cache", "hot", "--out", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["command"].endswith("--cache hot --out " + str(out))
    results = report["results"]
    assert [(r["set"], r["dirty"]) for r in results] == [
        ("2000x1024", False),
        ("2000x1024", True),
        ("4x16M", False),
        ("4x16M", True),
    ]
    for r in results:
        assert r["cache"] == "hot"
        assert all(len(s) == 2 for s in r["samples_s"].values())
        assert {"scaler-core", "naive", "roofline"} <= set(r["median_s"])
        if report["machine"]["numpy_path"] == "numba":
            assert "bound" in r["median_s"]
    assert "| bound |" in report["table"] or "bound" not in results[0]["median_s"]


def test_harness_rejects_an_unknown_cache_mode() -> None:
    run = _run(sys.executable, "-m", "benchmarks", "--small", "--cache", "warm", timeout=120)
    assert run.returncode == 2
    assert "--cache" in run.stderr
    assert "'warm'" in run.stderr


def test_jax_benchmark_runs_every_contender_on_a_tiny_tree(
    repo_module: Callable[[str], ModuleType],
) -> None:
    jax = pytest.importorskip("jax")
    bench = repo_module("benchmarks/bench_jax.py")
    device = jax.devices("cpu")[0]
    rows = bench.run(["many"], small=True, device=device, reps=2, many=12, sync="flag")
    assert [r["contender"] for r in rows] == [
        "scaler_core",
        "jmp_pattern",
        "multiply_only",
        "tiny_outputs",
        "flat_buffer",
    ]
    for r in rows:
        assert r["leaves"] == 12
        assert r["elements"] == 12 * 1024
        assert r["sync"] == "flag"
        assert r["median_ms"] > 0
    assert next(r for r in rows if r["contender"] == "jmp_pattern")["speedup_vs_jmp"] == 1.0


def test_jax_benchmark_waits_on_the_whole_tree_when_asked(
    repo_module: Callable[[str], ModuleType],
) -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    bench = repo_module("benchmarks/bench_jax.py")
    tree = [jnp.full((8,), 4.0), jnp.full((3,), jnp.inf)]
    fn = jax.jit(bench.ours)
    for sync in ("flag", "tree"):
        assert bench.timed(fn, tree, jnp.float32(2.0), sync) > 0
    out, found = fn(tree, jnp.float32(2.0))
    assert bool(found)
    assert float(out[0][0]) == 2.0


def test_torch_bench_runs_both_measurements_and_writes_its_json(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "torch.json"
    run = _run(
        *(sys.executable, "benchmarks/bench_torch.py", "--small", "--reps", "2"),
        *("--cycle-reps", "3", "--warmup", "1", "--json", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    cycle, unscale, route = report["results"]
    assert set(cycle["rows"]) == {"pytorch", "scaler_core"}
    assert cycle["rows"]["scaler_core"]["reps"] == 3
    assert set(unscale["rows"]) == {"pytorch", "scaler_core", "bound_foreach_mul"}
    assert unscale["rows"]["pytorch"]["vs_pytorch"] == 1.0
    assert all(row["GiB_per_s"] > 0 for row in unscale["rows"].values())
    assert {k.split(":")[1] for k in route["rows"]} == {
        "torch_kernel",
        "numpy_fresh_views",
        "numpy_kept_views",
    }


def test_torch_bench_rejects_an_unknown_measurement() -> None:
    pytest.importorskip("torch")
    run = _run(sys.executable, "benchmarks/bench_torch.py", "--only", "cycle,step", timeout=120)
    assert run.returncode == 2
    assert "--only='cycle,step'" in run.stderr


def test_clip_bench_times_every_row_after_checking_them_against_pytorch(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("numba")
    out = tmp_path / "clip.json"
    run = _run(
        *(sys.executable, "benchmarks/bench_clip.py", "--small", "--reps", "1"),
        *("--warmup", "0", "--json", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["status"] == "ok"
    assert [r["set"] for r in report["results"]] == ["gpt2-small", "2000x1024"]
    for r in report["results"]:
        assert list(r["rows"]) == [
            "pytorch",
            "sc_fused",
            "sc_unfused",
            "sc_unscale_norm",
            "bound_2r1w",
            "bound_1r1w",
            "dropin_no_numba",
            "dropin_numba",
        ]
        assert all(row["reps"] == 1 and row["median_ms"] > 0 for row in r["rows"].values())
        assert r["rows"]["pytorch"]["speedup_vs_pytorch"] == 1.0
        assert r["rows"]["bound_2r1w"]["over_bound_2r1w"] == 1.0
        check = r["check"]
        assert check["passed"]
        assert set(check["rows"]) == {
            "pytorch",
            "sc_fused",
            "sc_unfused",
            "sc_unscale_norm",
            "dropin_no_numba",
            "dropin_numba",
        }
        assert set(r["dropin_not_slower"]) == {"dropin_no_numba", "dropin_numba"}
        for name, row in check["rows"].items():
            assert row["found"] is False
            assert row["norm_rel_err"] <= (1e-2 if name == "pytorch" else 1e-5)
        assert check["rows"]["sc_fused"]["max_rel_err"] <= 1e-5
        assert check["exact_norm"] > 1.0  # max_norm is 1.0: the clip wrote
    assert "| gpt2-small | sc_fused |" in report["table"]
    assert report["machine"]["scaler_core_file"].startswith(str(ROOT))  # this checkout's code


def test_clip_bench_without_numba_times_pytorch_and_the_drop_in(tmp_path: Path) -> None:
    """``--no-numba-only``: PyTorch's pair and the drop-in without numba, nothing that
    needs numba (what a process without numba runs)."""
    pytest.importorskip("torch")
    out = tmp_path / "clip.json"
    run = _run(
        *(sys.executable, "benchmarks/bench_clip.py", "--small", "--reps", "1"),
        *("--warmup", "0", "--sets", "2000x1024", "--no-numba-only", "--json", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["machine"]["numba_rows"] is False
    (r,) = report["results"]
    assert list(r["rows"]) == ["pytorch", "dropin_no_numba"]
    assert r["rows"]["dropin_no_numba"]["over_bound_2r1w"] is None
    assert r["check"]["rows"]["dropin_no_numba"]["max_rel_err"] <= 1e-5
    assert "dropin_no_numba" in run.stdout


def test_clip_bench_on_cuda_is_skipped_cleanly_without_a_gpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: the skip path does not apply")
    out = tmp_path / "clip.json"
    run = _run(
        *(sys.executable, "benchmarks/bench_clip.py", "--device", "cuda", "--json", str(out)),
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "skipped" in run.stdout
    assert json.loads(out.read_text())["status"] == "skipped"


def test_optax_clip_bench_checks_both_clips_agree(tmp_path: Path) -> None:
    pytest.importorskip("optax")
    out = tmp_path / "optax.json"
    run = _run(
        *(sys.executable, "benchmarks/bench_optax_clip.py", "--leaves", "3", "--size", "1000"),
        *("--reps", "1", "--json", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert set(report["median_ms"]) == {"unscale_and_clip", "unscale_then_optax_clip", "unscale"}
    assert report["max_rel_diff"] <= 1e-6
    bad = _run(sys.executable, "benchmarks/bench_optax_clip.py", "--reps", "0", timeout=60)
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("spikes", [False, True])
def test_transition_bench_checks_every_form_against_the_host_one(
    tmp_path: Path, spikes: bool
) -> None:
    out = tmp_path / "transition.json"
    run = _run(
        *(sys.executable, "benchmarks/bench_transition.py", "--steps", "300", "--reps", "1"),
        *(["--spikes"] if spikes else []),
        *("--json", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["spikes"] is spikes
    assert {"host_update", "device_update_numpy"} <= set(report["us_per_step"])
    assert report["ratio_to_host"]["host_update"] == 1.0
    bad = _run(sys.executable, "benchmarks/bench_transition.py", "--steps", "0", timeout=60)
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1


def test_jax_loop_bench_checks_jmp_and_the_port_agree_then_times_them(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    out = tmp_path / "loop.json"
    run = _run(
        *(sys.executable, "benchmarks/bench_jax_loop.py", "--width", "16", "--steps", "3"),
        *("--reps", "2", "--json", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert {"scaler_core", "scaler_core_spikes"} <= set(result["us_per_step"])
    assert all(v > 0 for v in result["us_per_step"].values())
    assert set(result["us_per_update"]) == {"spikes_off", "spikes_on"}
    assert all(v > 0 for v in result["us_per_update"].values())
    bad = _run(sys.executable, "benchmarks/bench_jax_loop.py", "--reps", "0", timeout=60)
    assert bad.returncode == 2
    assert "--reps=0, but it must be at least 1" in bad.stderr


def test_step_bench_checks_the_folded_step_then_times_every_row(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("numba")
    out = tmp_path / "step.json"
    run = _run(
        *(sys.executable, "benchmarks/bench_step.py", "--small", "--reps", "2", "--warmup", "0"),
        *("--json", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert set(result["ms"]) == {"pytorch", "sc_unscale_and_clip", "sc_clip_and_step", "bound"}
    assert all(v > 0 for v in result["ms"].values())
    assert result["check"]["ulps_vs_unscale_and_clip"] <= 4.0
    bad = _run(sys.executable, "benchmarks/bench_step.py", "--reps", "0", timeout=60)
    assert bad.returncode == 2
    assert "--reps=0" in bad.stderr


def test_paired_runs_two_checkouts_side_by_side(tmp_path: Path) -> None:
    """benchmarks/paired.py: a checkout of a revision and this tree, each in its worker,
    rounds alternated; it writes the table of both sides and their paired difference."""
    if not (ROOT / ".git").exists():
        pytest.skip("paired.py extracts a revision with git: run it in a git checkout")
    out = tmp_path / "paired.md"
    run = _run(
        *(sys.executable, "benchmarks/paired.py", "--before", "HEAD", "--rounds", "2"),
        *("--calls", "3", "--cases", "update_python_flag,find_non_finite_named"),
        *("--md", str(out)),
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    rows = out.read_text().splitlines()
    assert rows[0].startswith("| case | before")
    assert [r.split("|")[1].strip() for r in rows[2:]] == [
        "`update_python_flag`",
        "`find_non_finite_named`",
    ]
    assert all(" us (" in r for r in rows[2:])
    bad = _run(
        sys.executable, "benchmarks/paired.py", "--before", "HEAD", "--cases", "x", timeout=60
    )
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1
