"""The NumPy backend: SPEC section 5 (dtypes, containers, errors, in place)."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import scaler_core as sc

BF16 = ml_dtypes.bfloat16
FLOATS = [np.float16, BF16, np.float32, np.float64]


def inv_of(scale: float) -> float:
    return float(np.float32(1.0 / np.float64(np.float32(scale))))


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_unscale_in_place_with_pytorch_arithmetic(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1000) * 1000).astype(dtype)
    expected = x.astype(np.float64 if dtype == np.float64 else np.float32)
    expected = (expected * expected.dtype.type(inv_of(3.0))).astype(dtype)
    g = x.copy()
    out, found = sc.unscale(g, 3.0)
    assert out is g
    assert g.dtype == np.dtype(dtype)
    assert g.tobytes() == expected.tobytes()
    assert isinstance(found, np.bool_)
    assert not found


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 17, -1])
def test_any_non_finite_is_found(dtype: Any, bad: float, where: int) -> None:
    g = np.ones(64, dtype=dtype)
    g[where] = bad
    grads = {"ok": np.ones(3, np.float32), "bad": g}
    assert bool(sc.unscale(grads, 2.0)[1])
    g2 = np.ones(64, dtype=dtype)
    g2[where] = bad
    assert bool(sc.find_non_finite([g2]))


def test_half_overflow_created_by_unscale_is_found() -> None:
    g = np.array([60000.0], np.float16)
    _, found = sc.unscale([g], 0.5)  # 60000 * 2 > float16 max
    assert bool(found)
    assert np.isinf(g[0])


def test_nested_containers_none_leaves_and_odd_shapes() -> None:
    Pair = namedtuple("Pair", "w b")
    base = np.arange(24, dtype=np.float32).reshape(4, 6) * 4
    grads = {
        "layers": [Pair(np.full((2, 3), 8.0, np.float32), None), (np.zeros((), np.float64),)],
        "frozen": None,
        "empty": np.zeros((0, 5), np.float16),
        "strided": base[:, ::2],  # non-contiguous view
        "scalar": np.array(4.0, np.float32),
    }
    _, found = sc.unscale(grads, 4.0)
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


BAD_LEAVES = [
    (np.ones(3, np.int32), sc.GradientTypeError, "dtype int32"),
    (np.ones(3, bool), sc.GradientTypeError, "dtype bool"),
    (np.ones(3, np.complex64), sc.GradientTypeError, "dtype complex64"),
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
    torch = pytest.importorskip("torch")
    with pytest.raises(sc.GradientTypeError, match="no backend handles"):
        sc.unscale([np.ones(2, np.float32), torch.ones(2)], 2.0)
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(sc.GradientTypeError, match="one call takes arrays of one library"):
        sc.find_non_finite([np.ones(2, np.float32), jnp.ones(2)])


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), 1e-40, True, "2"])
def test_bad_scale_is_rejected_before_any_change(scale: Any) -> None:
    g = np.full(2, 8.0, np.float32)
    with pytest.raises(sc.GradientValueError, match="scale="):
        sc.unscale([g], scale)
    assert g.tolist() == [8.0, 8.0]


def test_scale_loss_select_any_to_bool() -> None:
    b = sc.get_backend("numpy")
    assert b.scale_loss(np.float32(0.5), 1024.0) == 512.0
    assert b.scale_loss(np.float16(0.5), 2.0**16).dtype == np.float32
    params, new = {"w": np.ones(2)}, {"w": np.zeros(2)}
    assert b.select(np.bool_(True), params, new)["w"] is params["w"]
    assert b.select(np.bool_(False), params, new)["w"] is new["w"]
    assert bool(b.any(np.bool_(False), np.bool_(True)))
    assert not bool(b.any(np.bool_(False), False))
    with pytest.raises(sc.GradientTypeError):
        b.to_bool(1)


def test_empty_tree_gives_false_flag() -> None:
    assert not bool(sc.unscale({}, 2.0)[1])
    assert not bool(sc.find_non_finite([None, {}]))


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
