"""A third-party backend, PaddlePaddle's (``examples/paddle_backend.py``), written from the
public protocol alone and held to the whole contract suite, in Paddle itself.

Paddle needs NumPy < 2.4, so it lives in its own venv, which ``.ci/oracles`` builds under
``$SCALER_CORE_ORACLES`` (default ``.oracles`` in the checkout), as ``conftest.py`` finds it.
One worker runs there, with this checkout first on ``PYTHONPATH`` (its scaler_core is the
one imported): it loads the example, runs ``check_backend`` over every check, runs broken
copies of the example (each must fail the check that names its fault), and reports what
Paddle's CPU does where the example works around it. The tests below read its report.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from scaler_core.testing import BACKEND_CHECKS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "paddle_backend.py"
ORACLES = Path(os.environ.get("SCALER_CORE_ORACLES", ROOT / ".oracles"))
PADDLE = ORACLES / "paddle" / "bin" / "python"
#: The example's length, ruff-formatted, workarounds for Paddle's CPU kernels included: a
#: backend written from the page and scaler_core.backend_kit fits in 60 lines.
PAGE = 60

#: Runs in the Paddle venv; prints one JSON line. ``sys.argv[1]`` is the example's path.
WORKER = r'''
import importlib.util, json, sys, time, warnings
import copy

start = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Paddle's import warns about a missing ccache
    import paddle
import ml_dtypes
import numpy as np

import scaler_core as sc
from scaler_core.backend_kit import inverse_scale
from scaler_core.testing import BACKEND_CHECKS, check_backend

paddle.set_device("cpu")
spec = importlib.util.spec_from_file_location("paddle_backend", sys.argv[1])
pb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pb)  # registers the backend "paddle"
report = {"paddle": paddle.__version__, "numpy": np.__version__}
report["import_s"] = time.perf_counter() - start
BF16 = np.dtype(ml_dtypes.bfloat16)


def asarray(a):  # bfloat16 through its bits: Paddle takes no ml_dtypes array
    if a.dtype == BF16:
        return paddle.to_tensor(a.view(np.uint16), dtype="bfloat16")
    return paddle.to_tensor(a)


def to_numpy(t):  # Paddle hands a bfloat16 tensor's bits back as uint16
    return t.numpy().view(BF16) if t.dtype == paddle.bfloat16 else t.numpy()


def run(backend):
    """The checks that ran, or the message of the first that failed."""
    start = time.perf_counter()
    try:
        out = check_backend(backend, asarray=asarray, to_numpy=to_numpy)
    except sc.BackendContractError as exc:
        out = str(exc)
    return out, time.perf_counter() - start


report["checks"], report["checks_s"] = run("paddle")


class InputDetection(pb.PaddleBackend):
    """Flags the gradients as given, not as they are stored after unscaling."""

    def measure(self, leaves, scale, *, write):
        found = self.any(*(~paddle.isfinite(g).all() for g in leaves[1]))
        grads, _, norm = super().measure(leaves, scale, write=write)
        return grads, found, norm


class Unclamped(pb.PaddleBackend):
    """The clip coefficient max_norm / (norm + 1e-6) without its clamp at 1."""

    def clip(self, leaves, scale, norm, max_norm, skip):
        xp, inv = pb.XP, inverse_scale(pb.XP, scale)
        coef = xp.float32(1.0) / (norm + xp.float32(1e-6)) * xp.float32(max_norm)
        for g in leaves[1]:
            paddle.assign(pb.where(self.any(skip), g, pb.times(pb.times(g, inv), coef)), g)
        return leaves[0]


class WritesWhenMeasuring(pb.PaddleBackend):
    """measure(write=False) stores the unscaled values all the same."""

    def measure(self, leaves, scale, *, write):
        return super().measure(leaves, scale, write=scale is not None)


class ClipsSkippedSteps(pb.PaddleBackend):
    """clip writes on a skipped step too."""

    def clip(self, leaves, scale, norm, max_norm, skip):
        return super().clip(leaves, scale, norm, max_norm, False)


def namespace_with(**members):
    xp = copy.copy(pb.XP)
    for name, member in members.items():
        setattr(xp, name, member)
    return lambda self, *values: xp


class FloatIsBool(pb.PaddleBackend):
    """isdtype calls every floating dtype a bool (and anything else)."""

    namespace = namespace_with(
        isdtype=lambda d, kind: pb.XP.isdtype(d, kind) or pb.XP.isdtype(d, "real floating")
    )


def plain_where(cond, a, b):
    like = b if isinstance(b, paddle.Tensor) else a
    a, b = (v if isinstance(v, paddle.Tensor) else paddle.full([], v, like.dtype) for v in (a, b))
    return paddle.where(cond, a, b)


class PlainWhere(pb.PaddleBackend):
    """paddle.where for 16-bit floats, which Paddle's CPU has no kernel for."""

    namespace = namespace_with(where=plain_where)


report["broken"] = {}
for broken in (
    InputDetection, Unclamped, WritesWhenMeasuring, ClipsSkippedSteps, FloatIsBool, PlainWhere
):
    message, seconds = run(broken())
    report["broken"][broken.__name__] = {"message": message, "seconds": seconds}

# float16 at large scales: every finite float16, unscaled by the backend and cast plainly.
bits = np.arange(0x7C00, dtype=np.uint16)
host = np.concatenate([bits, bits | 0x8000]).view(np.float16)
report["float16"] = {}
for power in (53, 60, 64, 70):
    scale = 2.0**power
    inv = np.float32(1.0 / np.float64(np.float32(scale)))
    want = (host.astype(np.float32) * inv).astype(np.float16).view(np.uint16)
    grads = [paddle.to_tensor(host)]
    sc.unscale(grads, scale)
    plain = (paddle.to_tensor(host).astype("float32") * paddle.full([], float(inv), "float32"))
    plain = plain.astype("float16").numpy().view(np.uint16)
    report["float16"][power] = {
        "backend_wrong": int((grads[0].numpy().view(np.uint16) != want).sum()),
        "plain_cast_wrong": int((plain != want).sum()),
    }

# A layer's own gradients, unscaled in place through dispatch from the arrays.
paddle.seed(0)
layer = paddle.nn.Linear(4, 3)
(layer(paddle.ones([2, 4])).sum() * 1024.0).backward()
grads = {name: p.grad for name, p in layer.named_parameters()}
before = {name: g.numpy().copy() for name, g in grads.items()}
tree, found = sc.unscale(grads, 1024.0)
report["layer"] = {
    "backend": type(sc.backend_for(grads)).__name__,
    "found": sc.get_backend("paddle").to_bool(found),
    "flag": [str(found.dtype), list(found.shape)],
    "same_tensors": all(tree[n] is grads[n] for n in grads),
    "unscaled": all(
        np.array_equal(p.grad.numpy(), before[n] / np.float32(1024.0))
        for n, p in layer.named_parameters()
    ),
}
print(json.dumps(report))
'''


@pytest.fixture(scope="module")
def paddle_report() -> dict[str, Any]:
    """The worker's report (one run of the Paddle venv's interpreter for all tests)."""
    if not PADDLE.exists():
        pytest.skip(
            f"the Paddle venv is not built: run .ci/oracles (looked for {PADDLE}; set "
            f"SCALER_CORE_ORACLES)"
        )
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    done = subprocess.run(
        [str(PADDLE), "-c", WORKER, str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        pytest.fail(
            f"the Paddle worker exited with {done.returncode} (scaler_core needs NumPy and "
            f"ml_dtypes in the Paddle venv: the oracles-paddle dependency group):\n"
            f"{done.stderr[-3000:]}"
        )
    report: dict[str, Any] = json.loads(lines[-1])
    report["worker_s"] = time.perf_counter() - start
    return report


def test_the_example_fits_on_a_page() -> None:
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= PAGE, f"{EXAMPLE.name} has {len(lines)} lines, more than {PAGE}"


def test_the_worker_ran_the_pinned_paddle(paddle_report: dict[str, Any]) -> None:
    assert paddle_report["paddle"] == "3.3.1"
    assert tuple(int(n) for n in paddle_report["numpy"].split(".")[:2]) < (2, 4)


def test_every_contract_check_passes(paddle_report: dict[str, Any]) -> None:
    assert paddle_report["checks"] == list(BACKEND_CHECKS), paddle_report["checks"]


#: Each broken copy, the check that must catch it first, and what its message must say.
CAUGHT = {
    "InputDetection": ("unscale_values", "flagged False, not True"),
    "Unclamped": ("norm_and_clip", "clamped at 1"),
    # measure(write=False) then clip: the values are unscaled twice
    "WritesWhenMeasuring": ("norm_and_clip", "did not store the unscaled values times"),
    "ClipsSkippedSteps": ("norm_and_clip", "wrote to the gradients of a skipped step"),
    "FloatIsBool": ("namespace", "isdtype(asarray(2.0, dtype=float32).dtype, 'bool')"),
    "PlainWhere": ("namespace", "where(flag(True), <an array>, <another>) raised"),
}


@pytest.mark.parametrize("broken", sorted(CAUGHT))
def test_a_broken_copy_fails_the_check_that_names_its_fault(
    paddle_report: dict[str, Any], broken: str
) -> None:
    message = paddle_report["broken"][broken]["message"]
    assert isinstance(message, str), f"{broken} passed every check: {message}"
    check, says = CAUGHT[broken]
    first = re.match(r"check '(\w+)' failed for backend 'paddle': ", message)
    assert first is not None, message
    assert first.group(1) == check, message
    assert says in message, message


def test_float16_is_rounded_as_the_rules_say_where_paddles_cast_is_not(
    paddle_report: dict[str, Any],
) -> None:
    """Every finite float16 unscaled at scales 2**53 to 2**70, against NumPy's rounding: the
    example's bits are the rules', while Paddle's own float32 -> float16 cast on the CPU turns
    results of magnitude 2**-89 to 2**-77 into subnormals, not +-0 (the workaround in
    ``times`` is what keeps the example right)."""
    counts = paddle_report["float16"]
    assert all(c["backend_wrong"] == 0 for c in counts.values()), counts
    assert any(c["plain_cast_wrong"] > 0 for c in counts.values()), counts


def test_a_layers_gradients_are_unscaled_in_place(paddle_report: dict[str, Any]) -> None:
    assert paddle_report["layer"] == {
        "backend": "PaddleBackend",
        "found": False,
        "flag": ["paddle.bool", []],
        "same_tensors": True,
        "unscaled": True,
    }
