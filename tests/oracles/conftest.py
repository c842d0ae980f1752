"""The real libraries behind the presets, each run in a worker interpreter, and the tally
of what the differential tests compared (printed at the end of the run).

A worker (``anchor_worker.py``) imports its libraries once and answers requests on a
pipe. The test environment runs PyTorch, DeepSpeed, megatron-core, jmp, flax and Keras;
``.ci/oracles`` builds the two that cannot live in it (DeepSpeed 0.17.0, and Paddle,
which needs NumPy < 2.4) under ``$SCALER_CORE_ORACLES`` (default: ``.oracles`` in the
checkout). An anchor whose library is missing is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("anchor_worker.py")
ORACLES = Path(os.environ.get("SCALER_CORE_ORACLES", ROOT / ".oracles"))

#: What each anchor's worker needs in the test environment's interpreter.
_NEEDS = {
    "torch": ("torch",),
    "deepspeed": ("torch", "deepspeed"),
    "megatron": ("torch", "megatron.core"),
    "jmp": ("jax", "jmp"),
    "flax": ("jax", "flax"),
    "keras": ("keras",),
}


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _groups() -> dict[str, tuple[list[str], list[str], dict[str, str], str]]:
    """Worker name -> (interpreter command, anchors, extra environment, why missing)."""
    here = [n for n, mods in _NEEDS.items() if all(_has(m) for m in mods)]
    ds_old = ORACLES / "deepspeed-0.17.0"
    paddle = ORACLES / "paddle" / "bin" / "python"
    path = os.pathsep.join(p for p in (str(ds_old), os.environ.get("PYTHONPATH", "")) if p)
    build = f"not built: run .ci/oracles (looked in {ORACLES}; set SCALER_CORE_ORACLES)"
    return {
        "torch": (
            [sys.executable],
            [n for n in ("torch", "deepspeed", "megatron") if n in here],
            {},
            "needs torch 2.13.0, deepspeed and megatron-core (dependency group oracles)",
        ),
        "jax": (
            [sys.executable],
            [n for n in ("jmp", "flax", "keras") if n in here],
            {"KERAS_BACKEND": "numpy"},
            "needs jmp, flax and keras (dependency group oracles)",
        ),
        "deepspeed@0.17.0": (
            [sys.executable],
            ["deepspeed"] if ds_old.is_dir() and _has("torch") else [],
            {"PYTHONPATH": path},
            f"DeepSpeed 0.17.0 {build}",
        ),
        "paddle": (
            [str(paddle)],
            ["paddle", "paddle_static"] if paddle.exists() else [],
            {},
            f"the Paddle venv {build}",
        ),
    }


#: Anchor key (as the tests name it) -> (worker, anchor name inside the worker).
WHERE = {
    "torch": ("torch", "torch"),
    "deepspeed": ("torch", "deepspeed"),
    "deepspeed@0.17.0": ("deepspeed@0.17.0", "deepspeed"),
    "megatron": ("torch", "megatron"),
    "paddle": ("paddle", "paddle"),
    "paddle_static": ("paddle", "paddle_static"),
    "jmp": ("jax", "jmp"),
    "flax": ("jax", "flax"),
    "keras": ("jax", "keras"),
}


class Anchors:
    """The worker processes; all are started on the first request, so they import
    their libraries side by side."""

    def __init__(self) -> None:
        self.groups = _groups()
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.versions: dict[str, str] = {}
        self.started = 0.0

    def _start_all(self) -> None:
        self.started = time.perf_counter()
        for name, (cmd, anchors, env, _) in self.groups.items():
            if anchors:
                self.procs[name] = subprocess.Popen(
                    [*cmd, str(WORKER), *anchors],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    env={**os.environ, **env},
                    cwd=ROOT,
                )

    def _read(self, worker: str) -> Any:
        proc = self.procs[worker]
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the {worker} oracle worker exited ({proc.poll()}); run "
                f"`python {WORKER} ...` by hand to see why"
            )
        return json.loads(line)

    def version(self, key: str) -> str:
        """The library release behind ``key``; skips the test when it is missing."""
        worker, anchor = WHERE[key]
        _, anchors, _, why = self.groups[worker]
        if anchor not in anchors:
            missing = [m for m in _NEEDS.get(key, ()) if not _has(m)]
            if missing:
                why = f"needs {', '.join(missing)} (dependency group oracles; torch==2.13.0)"
            pytest.skip(f"{key}: {why}")
        if not self.procs:
            self._start_all()
        if worker not in self.versions:
            ready = self._read(worker)["ready"]
            for name, release in ready.items():
                self.versions[f"{worker}/{name}"] = release
            self.versions[worker] = "started"
        return self.versions[f"{worker}/{anchor}"]

    def run(self, key: str, cases: list[tuple[dict[str, Any], list[bool]]]) -> list[Any]:
        """The anchor's trajectory for each ``(params, flags)`` case."""
        self.version(key)
        worker, anchor = WHERE[key]
        proc = self.procs[worker]
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"anchor": anchor, "cases": cases}) + "\n")
        proc.stdin.flush()
        answer: list[Any] = self._read(worker)
        return answer

    def close(self) -> None:
        # The workers hold nothing worth a clean exit (the libraries' own teardown, a
        # process group among them, takes seconds): end them.
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


@pytest.fixture(scope="session")
def anchors() -> Iterator[Anchors]:
    pool = Anchors()
    yield pool
    pool.close()


#: preset -> {"against": release, "sequences": n, "steps": n, "differences": {kind: n}}
TALLY: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="session")
def oracle_tally() -> dict[str, dict[str, Any]]:
    """Where the differential tests record what they compared (see the summary hook)."""
    return TALLY


#: Seconds spent in the differential tests (setup, call and teardown of each).
_SECONDS = [0.0]
_TIMED = ("test_presets_anchors.py", "test_preset_apex.py")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid.split("::")[0].endswith(_TIMED):
        _SECONDS[0] += report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TALLY:
        return
    terminalreporter.section("presets against their libraries (step by step)")
    terminalreporter.write_line(
        f"{_SECONDS[0]:.1f}s in {' and '.join(_TIMED)} (library imports in the workers included)"
    )
    for name in sorted(TALLY):
        t = TALLY[name]
        seen = ", ".join(f"{k} x{v}" for k, v in sorted(t["differences"].items())) or "none"
        terminalreporter.write_line(
            f"{name:<24} vs {t['against']:<40} {t['sequences']:>4} sequences "
            f"{t['steps']:>7} steps equal; stated differences met: {seen}"
        )
