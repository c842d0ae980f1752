"""The norm in the unscale pass, and clipping folded in: every backend, every NumPy path.

What is checked: the norm equals the exactly rounded norm of the stored unscaled
values within one float32 ulp; unscale_and_norm writes exactly what unscale writes;
clipping stores PyTorch's arithmetic (the unscaled value times its float32
coefficient); a skipped step (inf planted, or a reduce that says skip) writes
nothing; PyTorch's clip_grad_norm_ gives the same coefficient and the same
clipped gradients for the same norm; a bad max_norm changes nothing.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core import _ops
from scaler_core.backends._numpy import REFERENCE, NumpyBackend
from scaler_core.backends._numpy_reference import clip_in_place, unscaled_copy

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
PATHS = {
    "numba": lambda: NumpyBackend(use_numba=True),
    "numpy": lambda: NumpyBackend(use_numba=False),
    "reference": lambda: REFERENCE,
}


def _coefficient(norm: Any, max_norm: float) -> np.float32:
    """The core's clip coefficient of a host norm, as a NumPy float32."""
    with np.errstate(all="ignore"):
        return np.float32(_ops.clip_coefficient(np, np.float32(norm), max_norm))


def _backend(name: str) -> Any:
    if name == "numba":
        pytest.importorskip("numba")
    return PATHS[name]()


def _exact_norm(arrays: list[np.ndarray]) -> float:
    """The norm of the values, summed exactly (math.fsum), as a Python float."""
    squares = [float(v) ** 2 for a in arrays for v in a.astype(np.float64).ravel()]
    return math.sqrt(math.fsum(squares))


def _ulps(a: float, b: float) -> int:
    return abs(int(np.float32(a).view(np.int32)) - int(np.float32(b).view(np.int32)))


@st.composite
def trees(draw: Any, max_leaves: int = 6) -> list[np.ndarray]:
    n = draw(st.integers(1, max_leaves))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for _ in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        size = draw(st.sampled_from([1, 7, 16, 33, 1000, 140_000]))
        values = rng.standard_normal(size) * 2.0 ** draw(st.integers(-8, 8))
        a = values.astype(dtype)
        if draw(st.booleans()) and size > 1:  # strided and Fortran leaves too
            a = np.asfortranarray(np.resize(a, (2, size // 2 or 1)))
            if draw(st.booleans()):
                a = a[:, ::-1]
        out.append(np.array(a) if draw(st.booleans()) else a)
    return out


def _copy(tree: list[np.ndarray]) -> list[np.ndarray]:
    return [a.copy(order="K") for a in tree]


@pytest.mark.parametrize("path", list(PATHS))
@settings(max_examples=40, deadline=None)
@given(tree=trees(), power=st.integers(-4, 12))
def test_unscale_norm_writes_what_unscale_writes_and_the_norm_is_exact(
    path: str, tree: list[np.ndarray], power: int
) -> None:
    backend = _backend(path)
    scale = 2.0**power
    want = _copy(tree)
    _ops.unscale(REFERENCE, want, scale)
    got = _copy(tree)
    _, found, norm = _ops.unscale_and_norm(backend, got, scale)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert not found
    assert type(norm) is np.float32
    assert _ulps(float(norm), _exact_norm(want)) <= 1


@pytest.mark.parametrize("path", list(PATHS))
@settings(max_examples=40, deadline=None)
@given(tree=trees(), power=st.integers(-4, 12), max_norm=st.floats(1e-3, 1e4))
def test_clip_stores_the_unscaled_value_times_pytorchs_coefficient(
    path: str, tree: list[np.ndarray], power: int, max_norm: float
) -> None:
    backend = _backend(path)
    scale = 2.0**power + (0.5 if power > 2 else 0.0)  # not only powers of two
    inv = np.float32(1.0) / np.float32(scale)
    got = _copy(tree)
    _, found, norm = _ops.unscale_and_clip(backend, got, scale, max_norm)
    assert not found
    unscaled = [unscaled_copy(a, float(inv)) for a in tree]
    assert _ulps(float(norm), _exact_norm(unscaled)) <= 1
    coef = _coefficient(norm, max_norm)
    for g, original, u in zip(got, tree, unscaled, strict=True):
        want = original.copy(order="K")
        clip_in_place(want, u, coef)
        assert np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(want).tobytes()


@pytest.mark.parametrize("path", list(PATHS))
def test_the_norm_is_the_same_on_every_numpy_path(path: str) -> None:
    rng = np.random.default_rng(3)
    tree = [rng.standard_normal(n).astype(np.float32) for n in (300_001, 5, 131_072, 64)]
    norms = {name: _ops.unscale_and_norm(_backend(name), _copy(tree), 8.0)[2] for name in PATHS}
    mine = norms[path]
    assert all(_ulps(float(mine), float(n)) <= 1 for n in norms.values())


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_skipped_step_writes_nothing(path: str, dtype: Any) -> None:
    backend = _backend(path)
    tree = [np.linspace(-3, 3, 1000).astype(dtype), np.ones(40, dtype)]
    tree[1][7] = np.inf
    before = [a.tobytes() for a in tree]
    _, found, norm = _ops.unscale_and_clip(backend, tree, 4.0, 0.5)
    assert found
    assert not math.isfinite(float(norm))
    assert [a.tobytes() for a in tree] == before


@pytest.mark.parametrize("path", list(PATHS))
def test_reduce_decides_and_a_skip_it_demands_writes_nothing(path: str) -> None:
    backend = _backend(path)
    tree = [np.full(100, 3.0, np.float32)]
    seen = []

    def reduce(found: Any) -> Any:
        seen.append(bool(found))
        return np.bool_(True)  # another replica overflowed

    _, found, _ = _ops.unscale_and_clip(backend, tree, 2.0, 1.0, reduce)
    assert seen == [False]
    assert bool(found)
    assert np.all(tree[0] == 3.0)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "1", 1e39, 1e-46])
def test_a_bad_max_norm_is_refused_before_anything_changes(path: str, bad: Any) -> None:
    tree = [np.full(10, 4.0, np.float32)]
    with pytest.raises(sc.InvalidArgumentError, match="max_norm="):
        _ops.unscale_and_clip(_backend(path), tree, 2.0, bad)
    assert np.all(tree[0] == 4.0)


def test_clip_with_coefficient_one_is_exactly_unscale() -> None:
    tree = [np.array([3.0, 4.0], np.float32) * 1024]
    got = _copy(tree)
    sc.unscale_and_clip(got, 1024.0, 1e6)
    want = _copy(tree)
    sc.unscale(want, 1024.0)
    assert np.array_equal(got[0], want[0])


# -- PyTorch as the oracle ------------------------------------------------------------


def test_the_coefficient_is_pytorchs_bit_for_bit() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    for _ in range(3000):
        norm = np.float32(math.exp(rng.uniform(-20, 20)))
        max_norm = float(math.exp(rng.uniform(-10, 10)))
        theirs = torch.clamp(max_norm / (torch.tensor(norm) + 1e-6), max=1.0).item()
        assert np.float32(theirs) == _coefficient(norm, max_norm)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_unscale_and_clip_equals_pytorchs_unscale_then_clip_grad_norm(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    shapes = [(64, 33), (1000,), (7,), (3, 5, 9)]
    values = [(rng.standard_normal(s) * 300).astype(dtype) for s in shapes]
    params = [torch.nn.Parameter(torch.zeros(s, dtype=getattr(torch, dtype))) for s in shapes]
    for p, v in zip(params, values, strict=True):
        p.grad = torch.from_numpy(v.copy())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(torch.optim.SGD(params, lr=0.1))
    total = torch.nn.utils.clip_grad_norm_(params, 2.0, foreach=True)

    ours = [v.copy() for v in values]
    _, found, norm = sc.unscale_and_clip(ours, 1024.0, 2.0)
    assert not found
    # PyTorch sums in the gradients' dtype, scaler-core in float64: the norms agree to
    # float32 rounding, and for PyTorch's norm our arithmetic gives PyTorch's gradients.
    assert float(norm) == pytest.approx(total.item(), rel=1e-5)
    inv = float(np.float32(1.0) / np.float32(1024.0))
    for p, v in zip(params, values, strict=True):
        want = v.copy()
        clip_in_place(want, unscaled_copy(v, inv), _coefficient(total.item(), 2.0))
        if dtype == "float32":
            assert np.array_equal(p.grad.numpy(), want)
        else:  # PyTorch's coefficient is float64 for float64 gradients, ours float32
            np.testing.assert_allclose(p.grad.numpy(), want, rtol=1e-7)


# -- the other backends ---------------------------------------------------------------


def _jax() -> Any:
    return pytest.importorskip("jax")


def test_jax_norm_clip_and_skip() -> None:
    jax = _jax()
    jnp = jax.numpy
    rng = np.random.default_rng(2)
    host = {"a": rng.standard_normal(5000).astype(np.float32) * 64, "b": np.ones(3, np.float16)}
    grads = jax.tree_util.tree_map(jnp.asarray, host)
    out, found, norm = jax.jit(lambda g: sc.unscale_and_clip(g, 64.0, 1.0))(grads)
    unscaled = [unscaled_copy(host["a"], 1 / 64), unscaled_copy(host["b"], 1 / 64)]
    exact = _exact_norm(unscaled)
    assert not bool(found)
    assert float(norm) == pytest.approx(exact, rel=4e-7)  # float32 sums without x64
    coef = _coefficient(norm, 1.0)
    want = unscaled[0].copy()
    clip_in_place(want, unscaled[0], coef)
    assert np.array_equal(np.asarray(out["a"]), want)

    host["a"][3] = np.nan
    bad = jax.tree_util.tree_map(jnp.asarray, host)
    out, found, norm = sc.unscale_and_clip(bad, 64.0, 1.0)
    assert bool(found)
    assert not math.isfinite(float(norm))
    assert np.array_equal(np.asarray(out["a"]), host["a"], equal_nan=True)
    _, _, norm2 = sc.unscale_and_norm(grads, 64.0)
    assert float(norm2) == pytest.approx(exact, rel=4e-7)


def test_torch_cpu_runs_the_numpy_kernels_and_writes_nothing_on_a_skip() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    host = [rng.standard_normal(n).astype(np.float32) * 32 for n in (1000, 17)]
    tensors = [torch.from_numpy(a.copy()) for a in host]
    _, found, norm = sc.unscale_and_clip(tensors, 32.0, 0.5)
    numpy_tree = _copy(host)
    _, _, want_norm = sc.unscale_and_clip(numpy_tree, 32.0, 0.5)
    assert not bool(found)
    assert float(norm) == float(want_norm)
    assert all(np.array_equal(t.numpy(), a) for t, a in zip(tensors, numpy_tree, strict=True))
    bf16 = [torch.ones(8, dtype=torch.bfloat16) * 4]
    _, _, n16 = sc.unscale_and_norm(bf16, 2.0)
    assert float(n16) == pytest.approx(math.sqrt(8 * 4.0))
    assert bf16[0][0].item() == 2.0
    tensors[1][3] = math.inf
    before = [t.clone() for t in tensors]
    _, found, _ = sc.unscale_and_clip(tensors, 32.0, 0.5)
    assert bool(found)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))


def test_a_tensor_given_twice_counts_once_as_unscale_treats_it_once() -> None:
    torch = pytest.importorskip("torch")
    t = torch.tensor([6.0, 8.0]) * 4
    _, _, norm = sc.unscale_and_norm([t, t], 4.0)
    assert float(norm) == 10.0
    assert t.tolist() == [6.0, 8.0]
    a = np.array([6.0, 8.0], np.float32) * 4
    assert float(sc.unscale_and_clip([a, a], 4.0, 100.0)[2]) == 10.0


@pytest.mark.parametrize("path", list(PATHS))
def test_clipping_arrays_that_share_memory_reads_every_one_before_writing(path: str) -> None:
    """Two views overlapping in memory: each is clipped from its values before the
    call (all read, then all written, the later array's write last), as PyTorch's
    ``_foreach_mul_`` of unscaled copies would store them."""
    rng = np.random.default_rng(11)
    base = (rng.standard_normal(50) * 64).astype(np.float32)
    want_base = base.copy()
    views = [base[:30], base[20:]]
    scale, max_norm = 64.0, 0.5
    inv = float(np.float32(1.0) / np.float32(scale))
    unscaled = [unscaled_copy(v, inv) for v in (want_base[:30].copy(), want_base[20:].copy())]
    _, found, norm = _ops.unscale_and_clip(_backend(path), views, scale, max_norm)
    assert not found
    assert _ulps(float(norm), _exact_norm(unscaled)) <= 1
    coef = _coefficient(norm, max_norm)
    assert coef < 1.0  # the clip really scales
    clip_in_place(want_base[:30], unscaled[0], coef)
    clip_in_place(want_base[20:], unscaled[1], coef)
    assert base.tobytes() == want_base.tobytes()
