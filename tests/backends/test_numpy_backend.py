"""What only the NumPy backend has: in place through views, read-only arrays, NumPy's own
dtypes, dispatch by array type. The rules every backend keeps are checked once, for every
backend, in ``test_contract.py``."""

from __future__ import annotations

import importlib.util
import warnings
from collections import namedtuple
from functools import partial
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import scaler_core as sc
from scaler_core import _ops

BF16 = ml_dtypes.bfloat16
FLOATS = [np.float16, BF16, np.float32, np.float64]


def test_in_place_through_views_and_named_tuples() -> None:
    Pair = namedtuple("Pair", "w b")
    base = np.arange(24, dtype=np.float32).reshape(4, 6) * 4
    grads = {
        "layers": [Pair(np.full((2, 3), 8.0, np.float32), None), (np.zeros((), np.float64),)],
        "frozen": None,
        "empty": np.zeros((0, 5), np.float16),
        "strided": base[:, ::2],  # non-contiguous view
        "scalar": np.array(4.0, np.float32),
    }
    out, found = sc.unscale(grads, 4.0)
    assert out is grads
    assert isinstance(found, np.bool_)
    assert not found
    assert grads["layers"][0].w.tolist() == [[2.0] * 3] * 2
    assert grads["scalar"] == 1.0
    assert base[:, ::2].tolist() == (np.arange(24).reshape(4, 6)[:, ::2]).tolist()
    assert base[:, 1::2].tolist() == (np.arange(24).reshape(4, 6)[:, 1::2] * 4).tolist()


def test_same_array_twice_is_unscaled_once() -> None:
    g = np.full(3, 4.0, np.float32)
    sc.unscale({"a": g, "tied": g}, 4.0)
    assert g.tolist() == [1.0, 1.0, 1.0]


def test_detection_alone_modifies_nothing() -> None:
    g = np.array([1.0, np.inf], np.float32)
    g.flags.writeable = False  # detection works on read-only arrays
    assert bool(sc.find_non_finite({"g": g}))
    assert not bool(sc.find_non_finite({"g": np.ones(3, BF16)}))


# NumPy's own dtypes and containers; int, bool, complex and str leaves are in the contract.
BAD_LEAVES = [
    (np.array([1.0, "x"], dtype=object), sc.GradientTypeError, "dtype object"),
    (
        np.ones(3, np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else np.ones(3, np.uint8),
        sc.GradientTypeError,
        "dtype",
    ),
    ([1.0, 2.0], sc.GradientTypeError, "float"),
    ("not an array", sc.GradientTypeError, "str"),
]


@pytest.mark.parametrize(("leaf", "error", "words"), BAD_LEAVES, ids=lambda v: str(v)[:20])
def test_bad_leaf_is_named_and_nothing_is_modified(leaf: Any, error: type, words: str) -> None:
    good = np.full(4, 8.0, np.float32)
    later = np.full(4, 8.0, np.float32)
    grads = {"a": good, "model": {"bad": leaf}, "z": later}
    with pytest.raises(error, match=words) as info:
        sc.unscale(grads, 8.0)
    assert "grads['model']['bad']" in str(info.value)
    assert good.tolist() == [8.0] * 4, "a rejected call modified a gradient"
    assert later.tolist() == [8.0] * 4


def test_read_only_gradient_is_rejected_before_any_change() -> None:
    first = np.full(4, 8.0, np.float32)
    ro = np.full(4, 8.0, np.float32)
    ro.flags.writeable = False
    with pytest.raises(sc.GradientValueError, match=r"grads\[1\] is read-only"):
        sc.unscale([first, ro], 8.0)
    assert first.tolist() == [8.0] * 4
    assert isinstance(sc.GradientValueError("x"), ValueError)


def test_mixed_libraries_are_rejected() -> None:
    class Foreign:
        pass

    with pytest.raises(sc.GradientTypeError, match="no backend handles"):
        sc.unscale([np.ones(2, np.float32), Foreign()], 2.0)
    torch = pytest.importorskip("torch")
    with pytest.raises(sc.GradientTypeError, match="one call takes arrays of one library"):
        sc.unscale([np.ones(2, np.float32), torch.ones(2)], 2.0)
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(sc.GradientTypeError, match="one call takes arrays of one library"):
        sc.find_non_finite([np.ones(2, np.float32), jnp.ones(2)])


def test_cyclic_container_is_rejected() -> None:
    tree: list[Any] = [np.ones(1, np.float32)]
    tree.append(tree)
    with pytest.raises(sc.GradientValueError, match="cycle"):
        sc.unscale(tree, 2.0)


def test_backend_lookup_errors() -> None:
    with pytest.raises(sc.BackendUnavailableError, match="not registered"):
        sc.get_backend("tensorflow")
    with pytest.raises(ImportError):
        sc.get_backend("nope")
    assert "numpy" in sc.available_backends()
    assert sc.backend_for([np.ones(1)]).name == "numpy"
    assert isinstance(sc.get_backend("numpy"), sc.Backend)


class _NoUfuncs(np.ndarray):
    """An ndarray subclass that opts out of NumPy's arithmetic."""

    def __array_ufunc__(self, *args: Any, **kwargs: Any) -> Any:
        return NotImplemented


def _subclass_leaf(kind: str) -> Any:
    if kind == "matrix":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PendingDeprecationWarning)
            return np.matrix(np.ones((2, 2), np.float32))
    if kind == "masked":
        masked = np.ma.masked_array(np.ones(4, np.float32), mask=[False, True, False, False])
        masked.data[1] = np.nan  # a NaN under the mask
        return masked
    return np.ones(4, np.float32).view(_NoUfuncs)


def _every_numpy_path() -> list[Any]:
    from scaler_core.backends._numpy import NumpyBackend
    from scaler_core.backends._numpy_reference import NumpyReferenceBackend

    paths = [NumpyReferenceBackend(), NumpyBackend(use_numba=False)]
    if importlib.util.find_spec("numba") is not None:
        paths.append(NumpyBackend(use_numba=True))
    return paths


@pytest.mark.parametrize("kind", ["matrix", "masked", "no-ufuncs"])
@pytest.mark.parametrize("count", [3, 40], ids=["few", "cached"])
def test_ndarray_subclasses_are_refused_the_same_on_every_path(kind: str, count: int) -> None:
    """A matrix, a masked array or a subclass without ufuncs is refused by name, before any
    leaf is touched, on the reference, the pure-NumPy and the numba paths alike."""
    for backend in _every_numpy_path():
        grads: list[Any] = [np.full(8, 4.0, np.float32) for _ in range(count)]
        grads.insert(count // 2, _subclass_leaf(kind))
        before = [np.array(g) for g in grads]
        calls = (
            partial(_ops.unscale, backend, grads, 2.0),
            partial(_ops.find_non_finite, backend, grads),
        )
        for call in calls:
            with pytest.raises(
                sc.GradientTypeError, match=rf"grads\[{count // 2}\] is a .*subclass"
            ):
                call()
        for g, b in zip(grads, before, strict=True):
            assert np.array_equal(np.asarray(g), b, equal_nan=True), "a refused call modified"


def test_a_memmap_is_a_plain_buffer_and_is_unscaled(tmp_path: Any) -> None:
    mapped = np.memmap(tmp_path / "g.bin", dtype=np.float32, mode="w+", shape=(6,))
    mapped[:] = 4.0
    _, found = sc.unscale([mapped], 2.0)
    assert not found
    assert mapped.tolist() == [2.0] * 6


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_a_signalling_nan_is_found_without_a_warning_on_every_path(scale: float) -> None:
    """NumPy warns 'invalid value' on a signalling NaN; the flag is the answer (and the
    test suite turns warnings into errors, so a warning would fail here)."""
    for backend in _every_numpy_path():
        for count in (1, 40):  # one array, and a cached set
            grads = [np.ones(4, ml_dtypes.bfloat16) for _ in range(count)]
            grads[-1].view(np.uint16)[2] = 0x7F90  # a signalling NaN (bfloat16 warns)
            assert bool(_ops.find_non_finite(backend, grads))
            assert bool(_ops.find_non_finite(backend, grads))  # again: the cached plan
            _, found = _ops.unscale(backend, grads, scale)
            assert bool(found)


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "pure"])
def test_float_gradients_never_import_ml_dtypes(numba: bool, run_python: Any) -> None:
    """ml_dtypes (NumPy's bfloat16) takes over a second to import: every NumPy
    operation on float16/32/64 gradients runs without it, bfloat16 ones still work
    once it is imported (an array of its bfloat16 exists only then), and a bad dtype
    is still refused by name."""
    if numba and importlib.util.find_spec("numba") is None:
        pytest.skip("numba is not installed")
    code = f"""
import sys
import numpy as np
import scaler_core as sc
from scaler_core.backends import _numpy
_numpy.BACKEND = _numpy.NumpyBackend(use_numba={numba})
many = [np.full(8, 4.0, np.float32) for _ in range(40)]  # a cached plan's table
for grads in ([np.full(3, 4.0, d) for d in (np.float16, np.float32, np.float64)], many):
    sc.unscale(grads, 2.0)
    sc.unscale_and_norm(grads, 2.0)
    sc.unscale_and_clip(grads, 2.0, 1.0)
    sc.find_non_finite(grads)
    sc.non_finite_leaves(grads)
try:
    sc.unscale([np.ones(3, np.int32)], 2.0)
except sc.GradientTypeError as e:
    assert "bfloat16" in str(e), e
assert "ml_dtypes" not in sys.modules, "a float gradient imported ml_dtypes"
import ml_dtypes
g = [np.full(3, 4.0, ml_dtypes.bfloat16)]
_, found = sc.unscale(g, 2.0)
assert not found and (g[0] == 2.0).all()
(report,) = sc.non_finite_leaves([np.array([np.inf, np.nan], ml_dtypes.bfloat16)])
assert (report.nan, report.inf) == (1, 1)
print("ok")
"""
    assert run_python(code).split() == ["ok"]
