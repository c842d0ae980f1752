"""scaler-core leaves the host's threading settings as it found them.

numba's parallel kernels start a thread pool on their first use in a process; with
the OpenMP threading layer that start sets the calling thread's OpenMP thread count
to numba's, which is PyTorch's intra-op count when both share one OpenMP runtime
(``torch.set_num_threads(1)`` before, all cores after). Each check runs in a fresh
process, so the first parallel kernel of the process is the one under test, reached
through each public entry point.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest

pytest.importorskip("numba", reason="only numba's parallel kernels start threads")
pytest.importorskip("torch", reason="the settings checked are PyTorch's and numba's")

#: Every entry point that can reach a parallel kernel first, on a set big enough to
#: run on the threads (8 MiB of float32).
_CALLS = {
    "unscale-numpy": "sc.unscale(arrays(), 1024.0)",
    "unscale_and_norm-numpy": "sc.unscale_and_norm(arrays(), 1024.0)",
    "unscale_and_clip-numpy": "sc.unscale_and_clip(arrays(), 1024.0, 1.0)",
    "find_non_finite-numpy": "sc.find_non_finite(arrays())",
    "unscale_and_norm-torch": "sc.unscale_and_norm(tensors(), 1024.0)",
    "unscale_and_clip-torch": "sc.unscale_and_clip(tensors(), 1024.0, 1.0)",
    "drop-in-unscale_and_clip_": "drop_in()",
}

_SCRIPT = """
import os, sys
import torch

user_numba = {user_numba}
if user_numba:  # the user sets numba's count first (which starts numba's threads)
    import numba
    numba.set_num_threads(1)
torch.set_num_threads(1)
torch.set_num_interop_threads(1)
ENV = ("OMP_", "KMP_", "MKL_", "OPENBLAS_", "NUMBA_", "GOMP_")

def settings():
    out = {{"torch": torch.get_num_threads(), "interop": torch.get_num_interop_threads()}}
    out.update((k, v) for k, v in os.environ.items() if k.startswith(ENV))
    if user_numba:
        out["numba"] = numba.get_num_threads()
    return out

before = settings()  # also starts PyTorch's own threading (its lazy init)
import numpy as np
import scaler_core as sc

def arrays():
    return [np.full(1 << 18, 2.0, np.float32) for _ in range(8)]

def tensors():
    return [torch.full((1 << 18,), 2.0) for _ in range(8)]

def drop_in():
    from scaler_core.torch import GradScaler

    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    scaler.scale(model(torch.ones(2, 512)).sum()).backward()
    scaler.unscale_and_clip_(opt, 1.0)

{call}
import numba
layer = numba.threading_layer()  # raises unless the parallel kernels started threads
after = settings()
assert after == before, f"before {{before}}, after {{after}} ({{layer}})"
print("ok", layer)
"""


def _run(
    run_python: Callable[..., str], call: str, *, user_numba: bool, layer: str | None = None
) -> None:
    env = {} if layer is None else {"NUMBA_THREADING_LAYER": layer}
    out = run_python(_SCRIPT.format(call=call, user_numba=user_numba), env=env)
    assert out.split()[0] == "ok"


@pytest.mark.parametrize("call", list(_CALLS.values()), ids=list(_CALLS))
def test_the_first_parallel_kernel_leaves_torch_threads_alone(
    call: str, run_python: Callable[..., str]
) -> None:
    """``torch.set_num_threads(1)`` (and the interop count, and the OpenMP, MKL and
    numba environment) hold after the process's first parallel kernel, whichever
    entry point runs it."""
    _run(run_python, call, user_numba=False)


@pytest.mark.parametrize(
    ("layer", "call"),
    [("default", "drop-in-unscale_and_clip_"), ("workqueue", "unscale-numpy")],
)
def test_a_numba_thread_count_set_by_the_user_holds(
    layer: str, call: str, run_python: Callable[..., str]
) -> None:
    """``numba.set_num_threads(1)`` set by the user holds, as do PyTorch's counts, on
    numba's default layer and on its workqueue layer."""
    _run(run_python, _CALLS[call], user_numba=True, layer=layer)


def test_without_a_threading_layer_the_one_thread_kernels_serve(
    run_python: Callable[..., str],
) -> None:
    """Where numba's threads cannot start (a threading layer that is not installed), a
    large set runs on the calling thread with the same results, instead of failing."""
    if importlib.util.find_spec("tbb") is not None:
        pytest.skip("TBB is installed: numba's tbb layer would start")
    call = (
        "grads = arrays(); _, found = sc.unscale(grads, 2.0)\n"
        "assert not found and all((g == 1.0).all() for g in grads)\n"
        "from scaler_core.backends import _numpy\n"
        "assert _numpy._THREADS_PID[0] == -1, _numpy._THREADS_PID\n"
        "print('ok'); raise SystemExit(0)"
    )
    _run(run_python, call, user_numba=False, layer="tbb")
