"""Shared test setup: hypothesis profiles, a loader for the repository's scripts, and an
environment whose BLAS gives the shipped numbers.

``ci`` (the default) is derandomized, so a red CI run is reproducible;
``wheel`` is ``ci`` with 10 examples, for CI's run against the built wheel;
``explore`` runs many more random examples locally:
``HYPOTHESIS_PROFILE=explore pytest``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from common_loading import load_file
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=100,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "explore",
    deadline=None,
    max_examples=2000,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# CI's second run, against the built wheel (.ci/run): the wheel's files are the checkout's,
# byte for byte (CI checks), and the full suite has just tried them at ci's 100 examples.
# What can differ there is what imports and which files are found, which the first example
# of every test already meets; 10 keep each property test running a few shapes.
settings.register_profile("wheel", parent=settings.get_profile("ci"), max_examples=10)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _load_repo_module(relative: str) -> ModuleType:
    """A file of the repository (``benchmarks/...``) loaded by path, as its stem."""
    return load_file(ROOT / relative)


@pytest.fixture
def repo_module() -> Callable[[str], ModuleType]:
    """Load a script of the repository that is not part of the package, by path."""
    return _load_repo_module


def _has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return False


@pytest.fixture
def pinned_blas_env() -> dict[str, str]:
    """``os.environ`` with OpenBLAS held to its Haswell (AVX2) kernels, for a subprocess.

    The demo's numbers and the shipped traces come from float32 matrix products, whose
    rounding depends on the kernel OpenBLAS picks for the CPU (its AVX-512 kernels sum
    in another order than its AVX2 ones, and a training run amplifies the difference).
    They were made with the Haswell kernels; a process started with this environment
    computes them bit for bit again on any x86-64 CPU with AVX2. Skips elsewhere.
    """
    import numpy as np

    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"]
    if platform.machine() not in ("x86_64", "AMD64") or not _has_avx2():
        pytest.skip("the shipped numbers need OpenBLAS's x86-64 AVX2 kernels; no AVX2 here")
    if "openblas" not in str(blas).lower():
        pytest.skip(f"the shipped numbers were made with OpenBLAS; NumPy here uses {blas}")
    return {**os.environ, "OPENBLAS_CORETYPE": "Haswell"}


@pytest.fixture
def run_python() -> Callable[..., str]:
    """Run a Python snippet in a fresh interpreter; its stdout, once it exits 0.

    ``env`` adds to (or overrides) this process's environment; ``stdin`` is fed to it.
    A nonzero exit fails the test with the end of the snippet's stderr.
    """

    def run(code: str, *, env: dict[str, str] | None = None, stdin: str | None = None) -> str:
        result = subprocess.run(
            [sys.executable, "-c", code],
            input=stdin,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    return run


#: Lines tests ask to see at the end of the run (``summary_line``), in order.
_SUMMARY: list[str] = []


@pytest.fixture
def summary_line() -> Callable[[str], None]:
    """Print a line in pytest's terminal summary (what a test counted), captured or not."""
    return _SUMMARY.append


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _SUMMARY:
        terminalreporter.section("counts")
        for line in _SUMMARY:
            terminalreporter.write_line(line)
