"""PyTorch's own GradScaler tests, run with ``scaler_core.torch.GradScaler`` in its place.

PyTorch's wheel does not ship its test files, so this needs a PyTorch source
checkout of the installed version: set ``PYTORCH_TEST_DIR`` to its ``test/``
folder. The selection is what ``-k grad_scal`` and ``-k pickle_gradscaler`` pick
in ``test_torch.py``, on the CPU; the plugin ``pytorch_suite/swap_gradscaler.py``
points ``torch.amp.GradScaler`` and ``torch.GradScaler`` at scaler-core's class
before the file is imported. Without the checkout the suite test skips; the
plugin itself is always tested.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="PyTorch's tests need PyTorch")

pytestmark = pytest.mark.torch
HERE = Path(__file__).resolve().parent / "pytorch_suite"
SELECTION = "(grad_scal or pickle_gradscaler) and not cuda"  # the CPU instances


def _pytest(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "swap_gradscaler", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def test_the_plugin_puts_scaler_cores_class_in_pytorchs_place(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(
        "import torch\n"
        "import scaler_core.torch\n\n"
        "def test_probe():\n"
        "    for made in (torch.amp.GradScaler('cpu'), torch.GradScaler(device='cpu')):\n"
        "        assert type(made) is scaler_core.torch.GradScaler\n"
        "    assert isinstance(made, torch.amp.grad_scaler.GradScaler)\n"
    )
    run = _pytest("-q", "test_probe.py", cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout


def test_pytorchs_own_grad_scaler_tests_pass_with_the_drop_in() -> None:
    folder = os.environ.get("PYTORCH_TEST_DIR")
    if not folder:
        pytest.skip(
            "PyTorch's test files are not in its wheel: set PYTORCH_TEST_DIR to the test/ "
            f"folder of a PyTorch {torch.__version__.split('+')[0]} source checkout"
        )
    test_file = Path(folder) / "test_torch.py"
    assert test_file.is_file(), f"PYTORCH_TEST_DIR={folder!r} holds no test_torch.py"
    run = _pytest(
        "-q", "-W", "default", str(test_file), "-k", SELECTION, cwd=Path(folder), timeout=1200
    )
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
