"""Gradient trees with planted NaNs and infs, and the report they must give.

``non_finite_leaves`` must name exactly the leaves holding NaN or inf, with the
counts ``np.isnan``/``np.isinf`` give on a float64 host copy, in leaf order, and
refuse a bad leaf as ``unscale`` does; the NumPy tests (``tests/core/test_report.py``)
and those of the other backends (``tests/backends/test_report_backends.py``) hold it
to what is written here, independently of the package.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from common_floats import BF16, LAYOUT, UINT
from hypothesis import strategies as st

import scaler_core as sc


def planted(
    dtype: np.dtype[Any], shape: tuple[int, ...], seed: int, n_special: int, *, tiny: bool = True
) -> np.ndarray:
    """Finite values, a fifth of them at the dtype's edges (its largest either sign and
    zero; with ``tiny``, its smallest normal and -0.0 too), with up to ``n_special``
    elements set to NaN (any payload, either sign), +inf or -inf at random places.
    C order."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    finite = np.finfo(np.float32 if dtype == BF16 else dtype)
    small = [finite.tiny, -0.0] if tiny else []
    edges = np.array([finite.max, -finite.max, *small, 0.0], np.float64)
    values = rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)
    if size:
        pick = rng.random(size) < 0.2
        values[pick] = rng.choice(edges, int(pick.sum()))
    out = values.astype(dtype)  # edges are exact in their own dtype
    bits = out.view(UINT[dtype.itemsize])
    mantissa, exponent = LAYOUT[dtype]
    ones = ((1 << exponent) - 1) << mantissa
    sign = 1 << (mantissa + exponent)
    for _ in range(n_special if size else 0):
        i = int(rng.integers(size))
        kind = rng.integers(3)
        if kind == 0:  # NaN: a nonzero mantissa, random payload and sign
            payload = int(rng.integers(1, 1 << mantissa))
            value = ones | payload | (sign if rng.integers(2) else 0)
        else:  # +inf or -inf
            value = ones | (sign if kind == 2 else 0)
        bits[i] = value
    return out.reshape(shape)


def trees(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Nested dicts, lists and tuples of ``leaf`` and ``None``, up to 8 leaves."""
    keys = st.text("abwz_0", min_size=1, max_size=3)
    return st.recursive(
        st.one_of(leaf, st.none()),
        lambda children: st.one_of(
            st.dictionaries(keys, children, max_size=4),
            st.lists(children, max_size=4),
            st.lists(children, min_size=1, max_size=3).map(tuple),  # () is one shared object
        ),
        max_leaves=8,
    )


def walk(tree: Any, path: str = "grads", *, sort_keys: bool = False) -> list[tuple[str, Any]]:
    """``(path, leaf)`` in depth-first order (with ``sort_keys``, dict keys sorted, as JAX
    flattens them)."""
    if tree is None:
        return []
    if isinstance(tree, dict):
        keys = sorted(tree) if sort_keys else list(tree)
        return [p for k in keys for p in walk(tree[k], f"{path}[{k!r}]", sort_keys=sort_keys)]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        items = zip(tree._fields, tree, strict=True)
        return [p for k, v in items for p in walk(v, f"{path}.{k}", sort_keys=sort_keys)]
    if isinstance(tree, (list, tuple)):
        items = enumerate(tree)
        return [p for i, v in items for p in walk(v, f"{path}[{i}]", sort_keys=sort_keys)]
    return [(path, tree)]


def expected(pairs: list[tuple[str, np.ndarray]]) -> list[tuple[str, int, int]]:
    """``(path, nan, inf)`` of each leaf of ``pairs`` (``walk``'s) holding either."""
    out = []
    for path, host in pairs:
        with np.errstate(invalid="ignore"):  # casting a signalling NaN may warn
            wide = np.asarray(host, dtype=np.float64)
        nan, inf = int(np.isnan(wide).sum()), int(np.isinf(wide).sum())
        if nan or inf:
            out.append((path, nan, inf))
    return out


def got(reports: tuple[sc.LeafReport, ...]) -> list[tuple[str, int, int]]:
    """``non_finite_leaves``'s reports as ``expected`` writes them, once their types are
    checked."""
    assert isinstance(reports, tuple)
    assert all(type(r) is sc.LeafReport for r in reports)
    return [(r.path, r.nan, r.inf) for r in reports]


def same_errors(tree: Any, backend: Any) -> None:
    """``non_finite_leaves`` raises exactly what ``unscale`` raises for ``tree``, naming
    the leaf."""
    with pytest.raises(sc.InvalidGradientError) as theirs:
        sc.unscale(tree, 1.0, backend=backend)
    with pytest.raises(sc.InvalidGradientError) as ours:
        sc.non_finite_leaves(tree, backend=backend)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value) == str(theirs.value)
    assert "grads[" in str(ours.value)
