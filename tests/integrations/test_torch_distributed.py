"""``GradScaler(process_group=...)``: ranks that check different gradients skip together.

Two real processes over ``torch.distributed`` (gloo, on the CPU) run
``torch_scripts/sharded.py``: each rank owns half the parameters, as under ZeRO or
FSDP, and an inf lands in rank 1's half only. With the process group both ranks
make the same decisions and end with the same state and parameters; without it
they part ways (which is what the group is for).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")
dist = pytest.importorskip("torch.distributed")

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in"),
]
SCRIPT = Path(__file__).resolve().parent / "torch_scripts" / "sharded.py"
TIMEOUT_S = 120.0  # a healthy run takes a few seconds; only a hang comes near it


def _run(tmp_path: Path, mode: str) -> list[dict[str, Any]]:
    init = tmp_path / f"store-{mode}"
    outs = [tmp_path / f"rank{r}-{mode}.pt" for r in range(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(r), "2", str(init), str(outs[r]), mode],
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


def test_ranks_decide_together_over_the_process_group(tmp_path: Path) -> None:
    rank0, rank1 = _run(tmp_path, "group")
    assert rank0["decisions"] == rank1["decisions"]
    assert rank0["decisions"].count(False) == 4  # the four injected steps, on both ranks
    assert rank0["state"] == rank1["state"]
    assert rank0["state"]["scaler_core"]["state"]["skipped_steps"] == 4
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(a, b)


def test_without_the_group_the_ranks_part_ways(tmp_path: Path) -> None:
    rank0, rank1 = _run(tmp_path, "none")
    assert rank0["decisions"].count(False) == 0  # rank 0 never saw rank 1's inf
    assert rank1["decisions"].count(False) == 4
    assert rank0["state"]["scale"] != rank1["state"]["scale"]
