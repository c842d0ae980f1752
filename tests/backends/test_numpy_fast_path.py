"""The fused NumPy backend gives exactly the reference's results, on both paths.

Every comparison is bit for bit: the gradients (NaN payloads included, through
their unsigned-integer views) and the flag, against ``NumpyReferenceBackend``, the clear
implementation kept as the oracle.
"""

from __future__ import annotations

import contextlib
import doctest
import operator
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from common_floats import UINT, bits
from hypothesis import given
from hypothesis import strategies as st

from scaler_core import (
    GradientTypeError,
    GradientValueError,
    InvalidArgumentError,
    _ops,
    get_backend,
)
from scaler_core.backends import _numpy as fused
from scaler_core.backends import _plans as plans
from scaler_core.backends._numpy_reference import NumpyReferenceBackend
from scaler_core.testing import scales

REFERENCE = NumpyReferenceBackend()
DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]

try:
    import numba  # noqa: F401
except ImportError:
    HAVE_NUMBA = False
else:
    HAVE_NUMBA = True
needs_numba = pytest.mark.skipif(
    not HAVE_NUMBA, reason="numba is not installed (pip install numba)"
)

#: (id, use_numba, chunk bytes, parallel threshold): small chunks and a zero
#: threshold push tiny arrays through the work-item splitting and the threads.
MODES = [
    pytest.param(True, plans.CHUNK_BYTES, fused._PARALLEL_MIN_BYTES, id="numba", marks=needs_numba),
    pytest.param(True, 64, 0, id="numba-parallel-small-chunks", marks=needs_numba),
    pytest.param(False, plans.CHUNK_BYTES, fused._PARALLEL_MIN_BYTES, id="numpy"),
    pytest.param(False, 64, 0, id="numpy-small-chunks"),
]


@contextlib.contextmanager
def tuned(chunk: int, parallel: int) -> Iterator[None]:
    """Module constants set for one mode; small chunks also get detection batches
    of four work items, so parallel detection runs batch after batch. The chunk size
    is set where the plans split their work items and where the backend imported it."""
    saved = plans.CHUNK_BYTES, fused._PARALLEL_MIN_BYTES, fused._DETECT_BATCH_BYTES
    batch = fused._DETECT_BATCH_BYTES if chunk == plans.CHUNK_BYTES else 4 * chunk
    plans.CHUNK_BYTES = fused.CHUNK_BYTES = chunk
    fused._PARALLEL_MIN_BYTES, fused._DETECT_BATCH_BYTES = parallel, batch
    try:
        yield
    finally:
        plans.CHUNK_BYTES = fused.CHUNK_BYTES = saved[0]
        fused._PARALLEL_MIN_BYTES, fused._DETECT_BATCH_BYTES = saved[1:]


def finfo_of(dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    return ml_dtypes.finfo(dtype) if dtype == np.dtype(ml_dtypes.bfloat16) else np.finfo(dtype)


# -- strategies ---------------------------------------------------------------

LAYOUTS = ["c", "f", "step2", "reversed", "transposed", "offset"]
SPECIAL = [np.nan, np.inf, -np.inf]


@st.composite
def gradient(draw: st.DrawFn) -> tuple[np.ndarray, str]:
    """A float array (a view when the layout asks for one) and its layout name."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    layout = draw(st.sampled_from(LAYOUTS))
    ndim = draw(st.integers(0, 3))
    if ndim == 0:
        layout = "c"  # indexing a 0-d array gives a scalar, not a view
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    if draw(st.integers(0, 9)) == 0 and ndim == 1:
        shape = (draw(st.integers(100, 3000)),)  # crosses the small test chunks
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    big = tuple(2 * n + 1 for n in shape) if layout in ("step2", "reversed", "offset") else shape
    finfo = finfo_of(dtype)
    kind = draw(st.sampled_from(["normal", "near_max", "tiny", "mixed", "raw"]))
    if kind == "raw":  # any bit pattern: NaN payloads, signalling NaNs, -0, subnormals, max
        raw = rng.integers(0, 1 << (8 * dtype.itemsize), big, dtype=np.uint64, endpoint=False)
        base = raw.astype(UINT[dtype.itemsize]).view(dtype)
        values = None
    elif kind == "normal":
        values = rng.standard_normal(big) * 10.0 ** rng.integers(-3, 4)
    elif kind == "near_max":
        values = rng.uniform(0.5, 1.0, big) * float(finfo.max) * rng.choice([-1, 1], big)
    elif kind == "tiny":
        values = rng.uniform(-1.0, 1.0, big) * float(finfo.smallest_normal) * 4
    else:
        values = rng.standard_normal(big) * 10.0 ** rng.integers(-30, 30, big).clip(-300, 300)
    if values is not None:
        with np.errstate(over="ignore"):
            base = np.asarray(values, dtype=np.float64).astype(dtype)
    if layout == "f":
        base = np.asfortranarray(base)
    if layout == "step2":
        arr = base[tuple(slice(None, None, 2) for _ in shape)]
    elif layout == "reversed":
        arr = base[tuple(slice(n - 1, None, -1) if n else slice(None) for n in shape)]
        arr = arr[tuple(slice(0, n) for n in shape)]
    elif layout == "offset":
        arr = base[tuple(slice(1, 1 + n) for n in shape)]
    elif layout == "transposed":
        arr = base.T
    else:
        arr = base
    flat_n = arr.size
    if flat_n:
        where = draw(st.sampled_from(["none", "none", "first", "last", "middle", "random"]))
        index = {"first": 0, "last": flat_n - 1, "middle": flat_n // 2}.get(
            where, draw(st.integers(0, flat_n - 1))
        )
        if where != "none":
            arr[np.unravel_index(index, arr.shape)] = draw(st.sampled_from(SPECIAL))
    return arr, layout


@st.composite
def gradient_sets(draw: st.DrawFn) -> list[np.ndarray]:
    grads = [g for g, _ in draw(st.lists(gradient(), min_size=0, max_size=8))]
    if draw(st.booleans()):  # enough arrays for the backend's address tables
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        fillers = [
            (rng.standard_normal(int(rng.integers(0, 6))) * 100).astype(rng.choice(DTYPES))
            for _ in range(plans._TABLE_MIN_LEAVES)
        ]
        at = draw(st.integers(0, len(grads)))
        grads[at:at] = fillers
    if grads and draw(st.integers(0, 4)) == 0:  # a non-finite value in every array
        for g in grads:
            if g.size:
                g[np.unravel_index(g.size - 1, g.shape)] = np.inf
    return grads


SCALES = st.one_of(
    st.sampled_from([1.0, 2.0**16, 0.5, 2.0**-10, 2.0**-100, 3.0, 2.0**120, 65504.0]),
    scales(),
)


def clone(grads: list[np.ndarray]) -> list[np.ndarray]:
    """Copies with the same memory layout (shape, strides, offset) on fresh buffers."""
    out = []
    for g in grads:
        if g.base is None:
            out.append(g.copy(order="K"))
            continue
        owner = g.base  # the strategies only make views of fresh arrays
        raw = np.empty(owner.nbytes, np.uint8)
        raw[:] = owner.reshape(-1, order="A").view(np.uint8)
        offset = g.__array_interface__["data"][0] - owner.__array_interface__["data"][0]
        out.append(np.ndarray(g.shape, g.dtype, buffer=raw, offset=offset, strides=g.strides))
    return out


def assert_same(left: list[np.ndarray], right: list[np.ndarray]) -> None:
    assert len(left) == len(right)
    for i, (a, b) in enumerate(zip(left, right, strict=True)):
        assert (a.dtype, a.shape, a.strides) == (b.dtype, b.shape, b.strides), i
        np.testing.assert_array_equal(bits(a), bits(b), err_msg=f"leaf {i} ({a.dtype})")


# -- equivalence --------------------------------------------------------------


@pytest.mark.parametrize(("use_numba", "chunk", "parallel"), MODES)
@given(grads=gradient_sets(), scale=SCALES)
def test_unscale_matches_reference(
    use_numba: bool, chunk: int, parallel: int, grads: list[np.ndarray], scale: float
) -> None:
    expected, actual = clone(grads), clone(grads)
    assert_same(expected, grads)
    with np.errstate(all="ignore"):  # the reference warns on overflow; the flag is the answer
        _, want = _ops.unscale(REFERENCE, expected, scale)
    backend = fused.NumpyBackend(use_numba=use_numba)
    with tuned(chunk, parallel):
        _, got = _ops.unscale(backend, actual, scale)
    assert isinstance(got, np.bool_)
    assert got == want
    assert_same(actual, expected)
    # The same set again: a cached plan (numba path, 32+ arrays) gives the same bits.
    with np.errstate(all="ignore"):
        _, want = _ops.unscale(REFERENCE, expected, scale)
    with tuned(chunk, parallel):
        _, got = _ops.unscale(backend, actual, scale)
    assert got == want
    assert_same(actual, expected)


@pytest.mark.parametrize(("use_numba", "chunk", "parallel"), MODES)
@given(grads=gradient_sets())
def test_find_non_finite_matches_reference_and_reads_only(
    use_numba: bool, chunk: int, parallel: int, grads: list[np.ndarray]
) -> None:
    before = clone(grads)
    with tuned(chunk, parallel):
        got = _ops.find_non_finite(fused.NumpyBackend(use_numba=use_numba), grads)
    assert isinstance(got, np.bool_)
    assert got == _ops.find_non_finite(REFERENCE, grads)
    assert_same(grads, before)


@pytest.mark.parametrize(("use_numba", "chunk", "parallel"), MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_inf_among_many_arrays_is_found(
    use_numba: bool, chunk: int, parallel: int, dtype: Any, where: str
) -> None:
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(257).astype(dtype) for _ in range(40)]
    pos = {"first": (0, 0), "middle": (20, 128), "last": (39, 256)}[where]
    grads[pos[0]][pos[1]] = np.inf
    expected = clone(grads)
    backend = fused.NumpyBackend(use_numba=use_numba)
    with tuned(chunk, parallel):
        assert _ops.find_non_finite(backend, grads)
        _, found = _ops.unscale(backend, grads, 4.0)
    assert found
    _ops.unscale(REFERENCE, expected, 4.0)
    assert_same(grads, expected)


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(("where", "batches_run"), [(0, 1), (11, 1), (12, 2), (30, 3), (39, 4)])
def test_parallel_detection_stops_after_the_batch_with_the_hit(
    dtype: Any, where: int, batches_run: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(16).astype(dtype) for _ in range(40)]  # one item each
    grads[where][7] = np.inf
    backend = fused.NumpyBackend(use_numba=True)
    kernels = backend._resolve()
    name = "detect_bits_parallel" if np.dtype(dtype) in plans.EXPONENT else "detect_parallel"
    calls: list[int] = []
    real = getattr(kernels, name)

    def counted(addrs: Any, *rest: Any) -> Any:
        calls.append(addrs.size)
        return real(addrs, *rest)

    monkeypatch.setattr(kernels, name, counted)
    item = grads[0].nbytes
    with tuned(item, 0):  # every array one work item, always parallel
        monkeypatch.setattr(fused, "_DETECT_BATCH_BYTES", 12 * item)  # 12 items a batch
        assert _ops.find_non_finite(backend, grads)
        assert calls == [12, 12, 12, 4][:batches_run]
        calls.clear()
        grads[where][7] = 1.0
        assert not _ops.find_non_finite(backend, grads)
        assert calls == [12, 12, 12, 4]  # a clean set is read whole


@pytest.mark.parametrize(("use_numba", "chunk", "parallel"), MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_unscale_overflow_created_by_unscaling_is_found(
    use_numba: bool, chunk: int, parallel: int, dtype: Any
) -> None:
    top = float(finfo_of(dtype).max)
    grads = [np.full(5, top / 2, dtype=dtype), np.ones(3, dtype)]
    with tuned(chunk, parallel):
        _, found = _ops.unscale(fused.NumpyBackend(use_numba=use_numba), grads, 0.25)
    assert found
    assert np.isinf(grads[0]).all()


# -- the plan cache -------------------------------------------------------------


@pytest.mark.parametrize(("use_numba", "chunk", "parallel"), MODES)
def test_cached_plan_follows_new_values_and_replaced_arrays(
    use_numba: bool, chunk: int, parallel: int
) -> None:
    with tuned(chunk, parallel):
        _cached_plan_follows_new_values_and_replaced_arrays(use_numba)


def _cached_plan_follows_new_values_and_replaced_arrays(use_numba: bool) -> None:
    backend = fused.NumpyBackend(use_numba=use_numba)
    grads = [np.full(16, 2.0, np.float32) for _ in range(64)]
    _, found = _ops.unscale(backend, grads, 2.0)
    assert not found
    assert all((g == 1.0).all() for g in grads)
    grads[10][3] = np.nan  # same arrays, new values: the cached plan still applies
    _, found = _ops.unscale(backend, grads, 2.0)
    assert found
    assert np.isnan(grads[10][3])
    assert grads[11][0] == 0.5
    grads[10] = np.full(16, 8.0, np.float32)  # a replaced array: a new plan
    _, found = _ops.unscale(backend, grads, 2.0)
    assert not found
    assert (grads[10] == 4.0).all()
    assert grads[11][0] == 0.25
    wrapped = {f"w{i}": g for i, g in enumerate(grads)}
    _, found = _ops.unscale(backend, wrapped, 0.5)
    assert not found
    assert (grads[10] == 8.0).all()
    if not use_numba:  # the pure-NumPy path validates every call and caches nothing
        assert not backend._cache.plans
        return
    (plan,) = backend._cache.plans.values()  # same first and last arrays: one slot, replaced
    assert plan.children[10] is grads[10]
    backend.clear_cache()
    assert not backend._cache.plans


@pytest.fixture
def is_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the per-array identity checks of the plan lookup (``operator.is_``)."""
    calls: list[int] = []
    real = operator.is_

    def counted(a: Any, b: Any) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(operator, "is_", counted)
    return calls


@needs_numba
@pytest.mark.parametrize("kind", [list, tuple])
def test_a_set_seen_before_is_recognised_without_a_check_per_array(
    kind: type, is_calls: list[int]
) -> None:
    backend = fused.NumpyBackend(use_numba=True)
    arrays = [np.full(8, 4.0, np.float32) for _ in range(40)]
    first = kind(arrays)
    _ops.unscale(backend, first, 2.0)
    (plan,) = backend._cache.plans.values()
    _ops.unscale(backend, first, 2.0)  # the same container
    _ops.unscale(backend, kind(arrays), 0.5)  # a new container of the same arrays
    assert backend._cache.plans[next(iter(backend._cache.plans))] is plan
    assert is_calls == []  # recognised by one container comparison, not 40 checks
    assert all((a == 2.0).all() for a in arrays)  # 4 / 2 / 2 * 2


@pytest.mark.parametrize("use_numba", [pytest.param(True, marks=needs_numba), False])
@pytest.mark.parametrize("size", [1, 2, 16])
@pytest.mark.parametrize("kind", [list, tuple])
def test_an_equal_but_new_array_is_not_taken_for_the_cached_one(
    use_numba: bool, size: int, kind: type, is_calls: list[int]
) -> None:
    backend = fused.NumpyBackend(use_numba=use_numba)
    arrays: list[Any] = [np.full(size, 4.0, np.float32) for _ in range(40)]
    arrays[7] = None
    _ops.unscale(backend, kind(arrays), 2.0)
    old, new = arrays[20], arrays[20].copy()  # equal values, another array
    arrays[20] = new
    arrays[7] = np.full(size, 2.0, np.float32)  # a None child that became an array
    _ops.unscale(backend, kind(arrays), 0.5)
    assert (old == 2.0).all()  # the replaced array is not touched again
    assert (new == 4.0).all()
    assert (arrays[7] == 4.0).all()
    assert (arrays[0] == 4.0).all()
    # plans over arrays of one element cannot rely on comparisons: every array checked
    # (the pure-NumPy path caches no plan: nothing to look up)
    assert (len(is_calls) > 0) == (size == 1 and use_numba)


@pytest.mark.parametrize("use_numba", [pytest.param(True, marks=needs_numba), False])
def test_an_object_claiming_equality_in_a_cached_set_still_raises(use_numba: bool) -> None:
    class EqualToAnything:
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = None  # type: ignore[assignment]

    backend = fused.NumpyBackend(use_numba=use_numba)
    arrays: list[Any] = [np.full(8, 4.0, np.float32) for _ in range(40)]
    _ops.unscale(backend, arrays, 2.0)
    arrays[5] = EqualToAnything()
    with pytest.raises(GradientTypeError, match=r"grads\[5\] is a .*EqualToAnything"):
        _ops.unscale(backend, arrays, 2.0)
    assert all((a == 2.0).all() for i, a in enumerate(arrays) if i != 5)


@needs_numba
def test_before_numpy_2_2_every_array_is_checked(
    is_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plans, "_EQ_RAISES", False)  # comparisons might only warn
    backend = fused.NumpyBackend(use_numba=True)
    arrays = [np.full(8, 4.0, np.float32) for _ in range(40)]
    _ops.unscale(backend, arrays, 2.0)
    _ops.unscale(backend, list(arrays), 2.0)
    assert len(is_calls) == 40
    assert all((a == 1.0).all() for a in arrays)


@pytest.mark.parametrize("use_numba", [pytest.param(True, marks=needs_numba), False])
def test_cached_plan_does_not_skip_validation_of_a_read_only_set(use_numba: bool) -> None:
    backend = fused.NumpyBackend(use_numba=use_numba)
    grads = [np.ones(4, np.float32) for _ in range(40)]
    grads[5].flags.writeable = False
    assert not _ops.find_non_finite(backend, grads)  # caches a read-only plan
    with pytest.raises(GradientValueError, match=r"grads\[5\] is read-only"):
        _ops.unscale(backend, grads, 2.0)
    assert all((g == 1.0).all() for g in grads)


@pytest.mark.parametrize("use_numba", [pytest.param(True, marks=needs_numba), False])
def test_overlapping_arrays_match_the_reference(use_numba: bool) -> None:
    base = np.arange(1.0, 41.0, dtype=np.float32)
    other = base.copy()
    grads = [base[:30], base[10:], base[::3]]
    expected = [other[:30], other[10:], other[::3]]
    _, found = _ops.unscale(fused.NumpyBackend(use_numba=use_numba), grads, 2.0)
    _, want = _ops.unscale(REFERENCE, expected, 2.0)
    assert found == want
    np.testing.assert_array_equal(base, other)


# -- errors come before any change ---------------------------------------------


@pytest.mark.parametrize("use_numba", [pytest.param(True, marks=needs_numba), False])
@pytest.mark.parametrize("count", [3, 50])
def test_bad_leaf_raises_before_anything_is_modified(use_numba: bool, count: int) -> None:
    backend = fused.NumpyBackend(use_numba=use_numba)
    grads: list[Any] = [np.full(8, 2.0, np.float32) for _ in range(count)]
    grads.append(np.ones(3, np.int32))
    with pytest.raises(GradientTypeError, match=rf"grads\[{count}\] has dtype int32"):
        _ops.unscale(backend, grads, 2.0)
    assert all((g == 2.0).all() for g in grads[:count])
    with pytest.raises(GradientValueError, match=r"scale=0\.0"):
        _ops.unscale(backend, grads[:count], 0.0)
    assert all((g == 2.0).all() for g in grads[:count])


# -- which path, and imports ---------------------------------------------------


def test_default_backend_is_fused_and_reports_its_path() -> None:
    backend = get_backend("numpy")
    assert isinstance(backend, fused.NumpyBackend)
    assert isinstance(backend, NumpyReferenceBackend)
    forced = os.environ.get(fused.ENV_FALLBACK, "") not in ("", "0")
    expected = "numba" if HAVE_NUMBA and not forced else "numpy"
    assert backend.path == expected, backend.path_reason
    assert fused.NumpyBackend(use_numba=False).path == "numpy"


def _run(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
        cwd=os.path.dirname(sys.executable),  # not the repo root: no source shadowing
    )
    return result.stdout.strip()


def test_import_scaler_core_does_not_import_numba() -> None:
    out = _run("import sys, scaler_core; print('numba' in sys.modules)")
    assert out == "False"


def test_env_var_forces_the_numpy_path_without_importing_numba() -> None:
    code = (
        "import sys, numpy as np, scaler_core as sc\n"
        "g = [np.array([2.0, np.inf], np.float32)]\n"
        "_, f = sc.unscale(g, 2.0)\n"
        "print(sc.get_backend('numpy').path, bool(f), g[0][0], 'numba' in sys.modules)"
    )
    assert _run(code, **{fused.ENV_FALLBACK: "1"}) == "numpy True 1.0 False"


def test_docstring_examples_run() -> None:
    result = doctest.testmod(fused, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


# -- a cached plan acts on what each array is now ---------------------------------
_PATHS = [pytest.param(True, id="numba", marks=needs_numba), pytest.param(False, id="numpy")]


def _cached_set(backend: Any, n: int = 40) -> list[np.ndarray]:
    """A set the backend has cached (seen once before)."""
    grads = [np.full(1024, 2.0, np.float32) for _ in range(n)]
    _ops.unscale(backend, grads, 2.0)
    _ops.find_non_finite(backend, grads)
    return grads


def _same_as_reference(backend: Any, grads: list[np.ndarray], scale: float) -> None:
    expected = [g.copy() for g in grads]
    _, want = _ops.unscale(REFERENCE, expected, scale)
    _, got = _ops.unscale(backend, grads, scale)
    assert bool(got) == bool(want)
    for g, e in zip(grads, expected, strict=True):
        assert g.dtype == e.dtype
        assert g.shape == e.shape
        assert g.tobytes() == e.tobytes()


@pytest.mark.parametrize("use_numba", _PATHS)
@pytest.mark.parametrize("size", [4096, 10], ids=["grown", "shrunk"])
def test_a_resized_array_in_a_cached_set(use_numba: bool, size: int) -> None:
    backend = fused.NumpyBackend(use_numba=use_numba)
    grads = _cached_set(backend)
    grads[5].resize(size, refcheck=False)  # may move the buffer, or keep it and shrink
    grads[5][...] = 4.0
    neighbour = np.full(1024, 8.0, np.float32)  # what malloc may place at the old address
    _same_as_reference(backend, grads, 2.0)
    assert neighbour.tolist() == [8.0] * 1024, "the stale plan wrote into another array"


@pytest.mark.parametrize("use_numba", _PATHS)
def test_an_array_retyped_in_place_in_a_cached_set(use_numba: bool) -> None:
    backend = fused.NumpyBackend(use_numba=use_numba)
    grads = _cached_set(backend)
    grads[7].dtype = np.float16  # the same bytes, read as twice as many float16
    grads[7][100] = np.inf
    assert bool(_ops.find_non_finite(backend, grads)) is True
    _same_as_reference(backend, grads, 2.0)
    grads[9].dtype = np.int32
    for call in (
        lambda: _ops.unscale(backend, grads, 2.0),
        lambda: _ops.find_non_finite(backend, grads),
    ):
        with pytest.raises(GradientTypeError, match=r"grads\[9\] has dtype int32"):
            call()


@pytest.mark.parametrize("use_numba", _PATHS)
def test_an_array_made_read_only_in_a_cached_set(use_numba: bool) -> None:
    backend = fused.NumpyBackend(use_numba=use_numba)
    grads = _cached_set(backend)
    grads[3].flags.writeable = False
    before = [g.copy() for g in grads]
    with pytest.raises(GradientValueError, match=r"grads\[3\] is read-only"):
        _ops.unscale(backend, grads, 2.0)
    assert all(g.tobytes() == b.tobytes() for g, b in zip(grads, before, strict=True))
    assert not bool(_ops.find_non_finite(backend, grads))  # reading a read-only array is fine


@pytest.mark.parametrize("use_numba", _PATHS)
def test_an_array_reshaped_in_place_in_a_cached_set(use_numba: bool) -> None:
    backend = fused.NumpyBackend(use_numba=use_numba)
    grads = _cached_set(backend)
    grads[2].shape = (32, 32)
    grads[4] = grads[4].reshape(32, 32)[:, ::2]  # a new, strided array in the same slot
    _same_as_reference(backend, grads, 2.0)


@needs_numba
def test_without_a_trusted_header_layout_no_plan_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plans, "_watch_works", lambda kernels: False)
    backend = fused.NumpyBackend(use_numba=True)
    grads = _cached_set(backend)
    assert not backend._cache.plans  # every call validates and plans again
    grads[9].dtype = np.int32
    with pytest.raises(GradientTypeError, match=r"grads\[9\] has dtype int32"):
        _ops.unscale(backend, grads, 2.0)


@needs_numba
def test_the_header_layout_is_trusted_here() -> None:
    """On this machine's NumPy the compiled check reads the headers right (else the
    cache is off, which the benchmarks would show as a slower 2000 x 1024 set)."""
    backend = fused.NumpyBackend(use_numba=True)
    _cached_set(backend)
    assert backend._cache.plans


_CONCURRENT = """
import sys, threading
import numba, numpy as np
import scaler_core as sc
from scaler_core import _ops

backend = sc.get_backend("numpy")
sets = [[np.full(1 << 18, 2.0, np.float32) for _ in range(8)] for _ in range(2)]  # 8 MiB
errors = []

def work(grads):
    try:
        for _ in range(30):
            _ops.unscale(backend, grads, 2.0)
            _ops.unscale(backend, grads, 0.5)
            _ops.find_non_finite(backend, grads)
    except Exception as exc:
        errors.append(exc)

threads = [threading.Thread(target=work, args=(g,)) for g in sets]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
assert all((g == 2.0).all() for s in sets for g in s)
print(backend.path, numba.threading_layer())
"""


@needs_numba
def test_two_threads_unscaling_at_once_under_the_workqueue_layer() -> None:
    """numba's workqueue layer aborts the process (rc 134) on two parallel regions at once;
    the backend runs one at a time, whichever thread calls."""
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue"}
    result = subprocess.run(
        [sys.executable, "-c", _CONCURRENT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["numba", "workqueue"]


_FORKED = """
import multiprocessing, os, sys
import numpy as np
import scaler_core as sc
from scaler_core import _ops
from scaler_core.backends import _numpy

backend = sc.get_backend("numpy")

def big():
    return [np.full(1 << 18, 2.0, np.float32) for _ in range(8)]  # 8 MiB: on threads

def child_step(_):
    grads = big()
    _ops.unscale(backend, grads, 0.5)
    return all((g == 4.0).all() for g in grads) and not _ops.find_non_finite(backend, grads)

grads = big()
_ops.unscale(backend, grads, 2.0)  # the parent's threads start
assert _numpy._THREADS_PID[0] == os.getpid()
pid = os.fork()
if pid == 0:
    os._exit(0 if child_step(None) else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, f"the forked child ended with {status}"
with multiprocessing.get_context("fork").Pool(2) as pool:
    assert all(pool.map(child_step, range(4)))
_ops.unscale(backend, grads, 0.5)  # the parent still runs on its threads
assert _numpy._THREADS_PID[0] == os.getpid()
print("ok")
"""


@needs_numba
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_child_forked_after_the_threads_started_still_unscales() -> None:
    """GNU OpenMP kills a child forked after its threads started at the child's first
    parallel region; the backend runs the one-thread kernels in such a child."""
    result = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-c", _FORKED],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


_FLUSHING = """
import numpy as np, torch
import scaler_core as sc
from scaler_core import _ops
from scaler_core.backends._numpy_reference import NumpyReferenceBackend

backend, reference = sc.get_backend("numpy"), NumpyReferenceBackend()
_ops.unscale(backend, [np.ones(1 << 22, np.float32)], 2.0)  # the threads start (16 MiB)
assert torch.set_flush_denormal(True)  # the caller flushes subnormals from now on
rng = np.random.default_rng(0)
for n in (10 << 18, 1000):  # 10 MiB (would run on the threads) and a small set
    host = (rng.standard_normal(n) * 1e-35).astype(np.float32)  # / 2**16: subnormal
    fast, ref = [host.copy()], [host.copy()]
    _ops.unscale(backend, fast, 2.0**16)
    _ops.unscale(reference, ref, 2.0**16)
    assert (ref[0] == 0).sum() > n // 4, "the reference did not flush"
    assert fast[0].tobytes() == ref[0].tobytes(), n
print("ok")
"""


@needs_numba
def test_a_caller_that_flushes_subnormals_gets_the_references_results() -> None:
    """numba's threads keep the floating-point mode they started in; a caller that turns
    on flush-to-zero later gets the calling thread's kernels, as NumPy computes."""
    pytest.importorskip("torch", reason="torch.set_flush_denormal sets the caller's FTZ mode")
    result = subprocess.run(
        [sys.executable, "-c", _FLUSHING], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


# -- torch tensors on the CPU without numba: PyTorch's kernels, the same bits ---------

_TORCH_DTYPES = ["float32", "float16", "bfloat16", "float64"]


def _torch_tree(torch: Any, seed: int, dtypes: list[str], sizes: tuple[int, ...]) -> list[Any]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(sizes):
        values = rng.standard_normal(n) * 2.0 ** rng.integers(-6, 6) * 1024
        out.append(torch.from_numpy(values.astype(np.float32)).to(getattr(torch, dtypes[i % 4])))
    return out


def _host(t: Any) -> np.ndarray:
    """A NumPy copy of a CPU tensor (bfloat16 through its bits)."""
    import torch

    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def _bits(arrays: list[np.ndarray]) -> list[bytes]:
    return [np.ascontiguousarray(a).tobytes() for a in arrays]


@pytest.mark.parametrize("scale", [1024.0, 3000.0, 0.5, 1.0])
@pytest.mark.parametrize("max_norm", [1.0, 1e9])
@pytest.mark.parametrize(
    "sizes",
    [(1, 7, 1000, 140_000, 300_001, 0, 33), (1024,) * 300, (60_000,) * 12 + (9,), (5,)],
    ids=["mixed", "many-small", "batches", "one"],
)
def test_torch_cpu_clip_without_numba_runs_pytorchs_kernels_with_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, scale: float, max_norm: float, sizes: tuple[int, ...]
) -> None:
    """Without numba, ``unscale_and_clip`` on CPU tensors runs on PyTorch's kernels (the
    NumPy pure path is not called) and stores the bits, flag and norm that numba's
    kernels and the reference give."""
    torch = pytest.importorskip("torch")
    from scaler_core.backends import _numpy, _torch_host
    from scaler_core.backends._torch import BACKEND as TORCH

    pure = fused.NumpyBackend(use_numba=False)
    monkeypatch.setattr(_numpy, "BACKEND", pure)
    monkeypatch.setattr(pure, "measure", None)  # the route must not come here
    monkeypatch.setattr(pure, "measure_planned", None)
    calls = []
    measure = _torch_host.measure
    monkeypatch.setattr(_torch_host, "measure", lambda *a: calls.append(1) or measure(*a))
    for seed in range(3):
        tensors = _torch_tree(torch, seed, _TORCH_DTYPES, sizes)
        hosts = [_host(t) for t in tensors]
        _, found, norm = _ops.unscale_and_clip(TORCH, tensors, scale, max_norm)
        want = {"reference": REFERENCE}
        if HAVE_NUMBA:
            want["numba"] = fused.NumpyBackend(use_numba=True)
        for name, backend in want.items():
            copies = [h.copy() for h in hosts]
            _, w_found, w_norm = _ops.unscale_and_clip(backend, copies, scale, max_norm)
            assert bool(found) == bool(w_found), name
            assert np.float32(norm).tobytes() == np.float32(w_norm).tobytes(), (name, norm, w_norm)
            assert _bits([_host(t) for t in tensors]) == _bits(copies), name
    assert len(calls) == 3


@pytest.mark.parametrize("scale", [1024.0, 3000.0])
def test_torch_cpu_clip_without_numba_regathers_small_tensors_beyond_the_hold(
    monkeypatch: pytest.MonkeyPatch, scale: float
) -> None:
    """Small tensors whose total is beyond what the read keeps gathered for the write
    are gathered again by the write, a batch at a time: the same bits."""
    torch = pytest.importorskip("torch")
    from scaler_core.backends import _numpy, _torch_host
    from scaler_core.backends._torch import BACKEND as TORCH

    monkeypatch.setattr(_numpy, "BACKEND", fused.NumpyBackend(use_numba=False))
    monkeypatch.setattr(_torch_host, "_HOLD", 1000)
    held: list[Any] = []
    write = _torch_host.write_clip
    monkeypatch.setattr(
        _torch_host,
        "write_clip",
        lambda p, *a: held.extend(g.held for g in p.groups.values()) or write(p, *a),
    )
    gen = torch.Generator().manual_seed(3)
    sizes = (1024,) * 120 + (60_000, 300, 7, 70_000)  # two beyond a batch of 2**15
    tensors = [
        (torch.randn(n, generator=gen) * 100).to(getattr(torch, _TORCH_DTYPES[i % 4]))
        for i, n in enumerate(sizes)
    ]
    hosts = [_host(t) for t in tensors]
    _, found, norm = _ops.unscale_and_clip(TORCH, tensors, scale, 1.0)
    _, w_found, w_norm = _ops.unscale_and_clip(REFERENCE, hosts, scale, 1.0)
    assert not found  # a step: the write ran
    assert held == [None] * 4  # every dtype's small tensors were beyond the hold
    assert bool(found) == bool(w_found)
    assert np.float32(norm).tobytes() == np.float32(w_norm).tobytes()
    assert _bits([_host(t) for t in tensors]) == _bits(hosts)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_torch_cpu_clip_without_numba_writes_nothing_on_a_skip(
    monkeypatch: pytest.MonkeyPatch, bad: float
) -> None:
    torch = pytest.importorskip("torch")
    from scaler_core.backends import _numpy
    from scaler_core.backends._torch import BACKEND as TORCH

    monkeypatch.setattr(_numpy, "BACKEND", fused.NumpyBackend(use_numba=False))
    for dtypes in (_TORCH_DTYPES, ["float32"] * 4):
        tensors = _torch_tree(torch, 5, dtypes, (1000, 300_001, 3, 64))
        tensors[2][1] = bad
        hosts = [_host(t) for t in tensors]
        _, found, norm = _ops.unscale_and_clip(TORCH, tensors, 1024.0, 1.0)
        _, w_found, w_norm = _ops.unscale_and_clip(
            REFERENCE, [h.copy() for h in hosts], 1024.0, 1.0
        )
        assert bool(found)
        assert bool(w_found)
        assert np.isnan(float(norm)) == np.isnan(float(w_norm))
        assert _bits([_host(t) for t in tensors]) == _bits(hosts)
    # an overflow made by the unscale itself (a scale below 1) is found, nothing written
    big = [torch.full((10,), 3e38)]
    _, found, _ = _ops.unscale_and_clip(TORCH, big, 0.5, 1.0)
    assert bool(found)
    assert big[0][0].item() == pytest.approx(3e38)


def test_torch_cpu_clip_without_numba_leaves_shared_and_strided_tensors_to_numpy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensors that share memory or are not contiguous take the NumPy path (exact for
    them), and still give the reference's bits."""
    torch = pytest.importorskip("torch")
    from scaler_core.backends import _numpy, _torch_host
    from scaler_core.backends._torch import BACKEND as TORCH

    monkeypatch.setattr(_numpy, "BACKEND", fused.NumpyBackend(use_numba=False))
    base = torch.arange(1.0, 41.0) * 64
    for tensors in ([base[:30], base[20:]], [base.view(8, 5).t()]):
        assert _torch_host.plan(tensors) is None
        copies = [np.array(t.numpy()) for t in tensors]
        _, _, norm = _ops.unscale_and_clip(TORCH, tensors, 64.0, 1.0)
        _, _, w_norm = _ops.unscale_and_clip(REFERENCE, copies, 64.0, 1.0)
        assert float(norm) == float(w_norm)


@pytest.mark.parametrize(
    ("magnitude", "dtype"), [(1e-35, "float32"), (3e156, "float64"), (1e30, "float32")]
)
def test_torch_cpu_clip_without_numba_at_the_edges_of_the_range(
    monkeypatch: pytest.MonkeyPatch, magnitude: float, dtype: str
) -> None:
    """Products in float32's subnormal range (rounded there: the norm is measured from
    the products), float64 values whose squares overflow before unscaling, and a norm
    beyond float32: the reference's bits, flag and norm."""
    torch = pytest.importorskip("torch")
    from scaler_core.backends import _numpy
    from scaler_core.backends._torch import BACKEND as TORCH

    monkeypatch.setattr(_numpy, "BACKEND", fused.NumpyBackend(use_numba=False))
    rng = np.random.default_rng(11)
    values = rng.standard_normal(200_000) * magnitude
    tensors = [torch.from_numpy(values.astype(dtype)), torch.from_numpy(values[:77].astype(dtype))]
    hosts = [_host(t) for t in tensors]
    _, found, norm = _ops.unscale_and_clip(TORCH, tensors, 2.0**16, 1e-30)
    _, w_found, w_norm = _ops.unscale_and_clip(REFERENCE, hosts, 2.0**16, 1e-30)
    assert bool(found) == bool(w_found)
    assert np.float32(norm).tobytes() == np.float32(w_norm).tobytes()
    assert _bits([_host(t) for t in tensors]) == _bits(hosts)


def _odd_tensors(torch: Any, seed: int, *, blocks_only: bool = False) -> list[Any]:
    """Every kind of dense CPU tensor the route meets: all four dtypes, empty ones, a
    view with a storage offset, negative views and (unless ``blocks_only``)
    transposed, non-contiguous ones."""
    tensors = _torch_tree(torch, seed, _TORCH_DTYPES, (1, 7, 1000, 140_000, 0, 33, 64, 5))
    base = torch.from_numpy(np.arange(1.0, 201.0, dtype=np.float32) * 64)
    tensors.append(base[100:])  # a storage offset; base[:100] is not in the set
    tensors.append(torch._neg_view(torch.arange(1.0, 9.0) * 64))  # its memory is -x
    if not blocks_only:
        tensors.append(torch.from_numpy(np.arange(1.0, 41.0).reshape(8, 5) * 64).t())
        tensors.append(torch._neg_view(torch.arange(1.0, 41.0).reshape(8, 5) * 64).t())
    return tensors


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "no-numba"])
@pytest.mark.parametrize("blocks_only", [True, False], ids=["contiguous", "any-layout"])
@pytest.mark.parametrize("scale", [1024.0, 3000.0, 0.5])
@pytest.mark.parametrize("max_norm", [1.0, 1e9])
def test_torch_cpu_route_reads_addresses_and_keeps_the_bits(
    monkeypatch: pytest.MonkeyPatch, numba: bool, blocks_only: bool, scale: float, max_norm: float
) -> None:
    """With numba, the torch backend hands the kernels its contiguous float32 and
    float64 tensors by address (a NumPy view of each cost several microseconds a
    tensor, more than PyTorch's own pair spends on small ones): only half types and
    tensors that are not one block go through views. Without numba, contiguous sets
    run on PyTorch's kernels, others on NumPy views. Negative views are their memory
    negated. Bits, flag and norm are the reference's, for unscale_and_clip and
    unscale_and_norm, on every route."""
    torch = pytest.importorskip("torch")
    if numba and not HAVE_NUMBA:
        pytest.skip("numba is not installed")
    from scaler_core.backends import _numpy, _torch
    from scaler_core.backends._torch import BACKEND as TORCH

    monkeypatch.setattr(_numpy, "BACKEND", fused.NumpyBackend(use_numba=numba))
    viewed: list[Any] = []
    view = _torch._numpy_view
    monkeypatch.setattr(_torch, "_numpy_view", lambda t: viewed.append(t) or view(t))
    for seed in range(2):
        for op in ("clip", "norm"):
            tensors = _odd_tensors(torch, seed, blocks_only=blocks_only)
            hosts = [_host(t.resolve_neg()) for t in tensors]
            viewed.clear()
            if op == "clip":
                _, found, norm = _ops.unscale_and_clip(TORCH, tensors, scale, max_norm)
                _, w_found, w_norm = _ops.unscale_and_clip(REFERENCE, hosts, scale, max_norm)
            else:
                _, found, norm = _ops.unscale_and_norm(TORCH, tensors, scale)
                _, w_found, w_norm = _ops.unscale_and_norm(REFERENCE, hosts, scale)
            assert bool(found) == bool(w_found)
            assert np.float32(norm).tobytes() == np.float32(w_norm).tobytes(), (op, norm, w_norm)
            assert _bits([_host(t.resolve_neg()) for t in tensors]) == _bits(hosts), op
            if not numba:
                continue
            by_view = {id(t) for t in viewed}
            for t in tensors:
                in_place = t.dtype in (torch.float32, torch.float64) and t.is_contiguous()
                assert (id(t) in by_view) == (not in_place), (t.dtype, t.shape, t.stride())


@pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")
def test_torch_cpu_route_with_numba_leaves_overlapping_tensors_to_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two tensors over the same memory: the address plan sees the overlap, and the
    call takes the reference's element-by-element order (its bits)."""
    torch = pytest.importorskip("torch")
    from scaler_core.backends import _numpy
    from scaler_core.backends._torch import BACKEND as TORCH

    monkeypatch.setattr(_numpy, "BACKEND", fused.NumpyBackend(use_numba=True))
    base = torch.arange(1.0, 41.0) * 64
    tensors = [base[:30], base[20:]]
    assert plans.plan_blocks(
        [], {np.dtype(np.float32): ([t.data_ptr() for t in tensors], [30, 20])}, tensors
    ).aliased
    copy = base.numpy().copy()
    _, _, norm = _ops.unscale_and_clip(TORCH, tensors, 64.0, 1.0)
    _, _, w_norm = _ops.unscale_and_clip(REFERENCE, [copy[:30], copy[20:]], 64.0, 1.0)
    assert float(norm) == float(w_norm)
    assert base.numpy().tobytes() == copy.tobytes()


def test_a_plan_takes_no_half_type_by_address() -> None:
    """Half types are clipped through NumPy's casts from views: a block of one by
    address would be skipped by the kernels, so the plan refuses it."""
    with pytest.raises(InvalidArgumentError, match="half types"):
        plans.plan_blocks([], {np.dtype(np.float16): ([4096], [8])}, [])


def test_a_clip_looks_for_shared_memory_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The measuring and the clip pass of one clip share the answer to "do two
    arrays overlap?" (a sort of the arrays' spans) instead of each working it out."""
    calls: list[int] = []
    overlaps = fused._overlaps
    monkeypatch.setattr(fused, "_overlaps", lambda p: calls.append(1) or overlaps(p))
    grads = [np.full(8, 64.0, np.float32) for _ in range(3)]
    _, found, _ = _ops.unscale_and_clip(fused.NumpyBackend(use_numba=False), grads, 64.0, 1.0)
    assert not found
    assert calls == [1]
    assert all(np.all(g < 1.0) for g in grads)  # clipped: norm sqrt(24) > 1
