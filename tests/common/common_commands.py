"""Command lines run from the repository root, as a user runs them (the benchmark
scripts' tests: their output, files and exit codes)."""

from __future__ import annotations

import subprocess
from pathlib import Path

#: The repository root: where the README's commands run.
ROOT = Path(__file__).resolve().parents[2]


def run_command(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``argv`` run from :data:`ROOT`, its output captured as text, never checked."""
    return subprocess.run(
        list(argv), capture_output=True, text=True, check=False, cwd=ROOT, timeout=timeout
    )
