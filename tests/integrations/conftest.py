"""What the integration tests share: a script of ``torch_scripts/`` run on two ranks."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parent / "torch_scripts"
TIMEOUT_S = 120.0  # a healthy run takes a few seconds; only a hang comes near it


@pytest.fixture
def torch_ranks(tmp_path: Path) -> Callable[[str, str], list[dict[str, Any]]]:
    """Run ``torch_scripts/SCRIPT`` as two real processes, gloo over the loopback.

    Each rank is started as ``SCRIPT RANK 2 INIT_FILE OUT_FILE MODE`` (the file store
    of ``torch.distributed``'s group, where the rank ``torch.save``-s its results, and
    the script's own mode); the call returns what each rank saved, rank 0 first, and
    fails the test with a rank's stderr if it exits nonzero or hangs.
    """
    runs = itertools.count()

    def run(script: str, mode: str) -> list[dict[str, Any]]:
        import torch

        tag = f"{next(runs)}-{mode}"
        init = tmp_path / f"store-{tag}"
        outs = [tmp_path / f"rank{r}-{tag}.pt" for r in range(2)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / script), str(r), "2", str(init), str(outs[r]), mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        try:
            results = [p.communicate(timeout=TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                p.kill()
        for r, (p, (_, err)) in enumerate(zip(procs, results, strict=True)):
            assert p.returncode == 0, f"rank {r} failed:\n{err[-3000:]}"
        return [torch.load(o, weights_only=False) for o in outs]

    return run


@pytest.fixture
def as_on_a_gpu(repo_module: Any) -> Any:
    """accelerate's float16 autocast and scaler turned on on the CPU, as on a GPU
    (``torch_scripts/accelerate_gpu_path.py``)."""
    return repo_module("tests/integrations/torch_scripts/accelerate_gpu_path.py").as_on_a_gpu


@pytest.fixture
def fresh_accelerate(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """accelerate keeps one process-wide state: a test that uses it starts and ends
    without one (``pytestmark = pytest.mark.usefixtures("fresh_accelerate")``)."""
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
