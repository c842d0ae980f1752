"""Which leaf overflowed: ``non_finite_leaves`` and ``LeafReport`` on the NumPy backends.

The reported paths must be exactly the leaves holding NaN or inf, with the counts
``np.isnan``/``np.isinf`` give (on a float64 copy), in leaf order, on trees of every
accepted dtype and layout, with nothing modified; bad leaves must raise what
``unscale`` raises. torch and JAX are in ``tests/backends/test_report_backends.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections import namedtuple
from typing import Any
from unittest import mock

import numpy as np
import pytest
from common_floats import BF16, DTYPES, LAYOUT, UINT
from common_report import expected, got, planted, same_errors, trees, walk
from hypothesis import given
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core._backend import BACKEND_MEMBERS
from scaler_core.backends import _common
from scaler_core.backends._numpy import NumpyBackend
from scaler_core.backends._numpy_reference import NumpyReferenceBackend

HAS_NUMBA = importlib.util.find_spec("numba") is not None

BACKENDS = [
    pytest.param(None, id="dispatch"),
    pytest.param(NumpyBackend(use_numba=False), id="numpy-pure"),
    pytest.param(
        NumpyBackend(use_numba=True) if HAS_NUMBA else None,
        id="numpy-numba",
        marks=pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed"),
    ),
    pytest.param(NumpyReferenceBackend(), id="reference"),
]


# ------------------------------------------------------------------ trees
@st.composite
def leaves(draw: st.DrawFn, *, layouts: bool = True) -> np.ndarray:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from([(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (40,), (0, 3)]))
    special = draw(st.integers(0, 4))
    host = planted(dtype, shape, draw(st.integers(0, 2**32 - 1)), special)
    layout = draw(st.sampled_from(["c", "f", "strided", "reversed"] if layouts else ["c"]))
    if layout == "f":
        return np.asfortranarray(host)
    if layout == "strided" and host.ndim:  # every other element of a bigger buffer
        big = np.zeros((*host.shape[:-1], host.shape[-1] * 2), host.dtype)
        big[..., ::2] = host
        return big[..., ::2]
    if layout == "reversed" and host.ndim:
        return np.ascontiguousarray(host[::-1])[::-1]  # negative strides
    return host


# ------------------------------------------------------------ the property
@pytest.mark.parametrize("backend", BACKENDS)
@given(tree=trees(leaves()), piece=st.sampled_from([1, 3, 8, 1 << 18]))
def test_reports_exactly_the_non_finite_leaves_with_their_counts(
    backend: Any, tree: Any, piece: int
) -> None:
    pairs = walk(tree)
    before = [a.tobytes() for _, a in pairs]
    with mock.patch.object(_common, "_PIECE", piece):  # small pieces: every way of cutting
        reports = sc.non_finite_leaves(tree, backend=backend)
    assert got(reports) == expected(pairs)
    assert [a.tobytes() for _, a in pairs] == before, "non_finite_leaves modified a leaf"
    assert bool(reports) == bool(sc.find_non_finite(tree, backend=backend))


@given(dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1))
def test_every_bit_pattern_of_nan_and_inf_is_counted(dtype: np.dtype[Any], seed: int) -> None:
    """Every NaN payload and sign, both infinities, and the finite neighbours of inf."""
    mantissa, exponent = LAYOUT[dtype]
    ones = ((1 << exponent) - 1) << mantissa
    sign = 1 << (mantissa + exponent)
    rng = np.random.default_rng(seed)
    payloads = [1, (1 << mantissa) - 1, 1 << (mantissa - 1), *rng.integers(1, 1 << mantissa, 5)]
    nans = [ones | int(p) | s for p in payloads for s in (0, sign)]
    infs = [ones, ones | sign]
    largest = ones - 1  # the largest finite magnitude
    finite = [largest, largest | sign, 0, sign, 1, 1 | sign]
    bits = np.array(nans + infs + finite, dtype=UINT[dtype.itemsize])
    rng.shuffle(bits)
    (report,) = sc.non_finite_leaves({"w": bits.view(dtype)})
    assert (report.path, report.nan, report.inf) == ("grads['w']", len(nans), len(infs))


def test_large_arrays_are_counted_in_pieces_of_every_layout() -> None:
    """Real piece sizes: a flat array over several pieces, a strided one cut by rows,
    and one whose rows are longer than a piece (cut again)."""
    n = (1 << 18) * 2 + 5
    flat = np.zeros(n, np.float16)
    flat[[0, (1 << 18) - 1, 1 << 18, n - 1]] = [np.inf, np.nan, -np.inf, np.nan]
    by_rows = np.zeros((3000, 200), np.float32)[:, ::2]
    by_rows[[0, 1500, 2999], [0, 50, 99]] = np.nan
    long_rows = np.zeros((2, 2 * n), BF16)[:, ::2]
    long_rows[1, n - 1] = np.inf
    long_rows[0, 0] = -np.inf
    grads = {"flat": flat, "by_rows": by_rows, "long_rows": long_rows}
    assert got(sc.non_finite_leaves(grads)) == [
        ("grads['flat']", 2, 2),
        ("grads['by_rows']", 3, 0),
        ("grads['long_rows']", 0, 2),
    ]


# ------------------------------------------------------------ the examples
def test_clean_trees_give_an_empty_tuple() -> None:
    assert sc.non_finite_leaves({}) == ()
    assert sc.non_finite_leaves([None, (None,)]) == ()
    clean = {d.name: np.full((2, 3), np.finfo(np.float32).max, np.float32) for d in DTYPES}
    clean["f16"] = np.full(4, 65504.0, np.float16)  # the largest finite float16
    assert sc.non_finite_leaves(clean) == ()


def test_nested_containers_none_leaves_and_named_tuples() -> None:
    Pair = namedtuple("Pair", "w b")
    inf = np.array([np.inf, 1.0, -np.inf], np.float32)
    nan = np.array([[np.nan, 0.0], [np.nan, np.nan]], BF16)
    grads = {
        "layer3": {"w": np.zeros(2, np.float16), "b": None},
        "blocks": [None, (Pair(np.ones(1), inf),), [nan]],
        "frozen": None,
    }
    assert got(sc.non_finite_leaves(grads)) == [
        ("grads['blocks'][1][0].b", 0, 2),
        ("grads['blocks'][2][0]", 3, 0),
    ]


def test_the_order_is_the_tree_order_not_the_order_of_discovery() -> None:
    grads = [np.array([np.nan]), {"z": np.array([np.inf]), "a": np.array([np.nan, np.inf])}]
    assert [r.path for r in sc.non_finite_leaves(grads)] == [
        "grads[0]",
        "grads[1]['z']",
        "grads[1]['a']",
    ]


def test_an_array_at_two_paths_is_reported_once_at_the_first() -> None:
    tied = np.array([np.inf, np.nan], np.float32)
    grads = {"encoder": tied, "decoder": tied, "other": np.array([np.nan], np.float32)}
    assert got(sc.non_finite_leaves(grads)) == [
        ("grads['encoder']", 1, 1),
        ("grads['other']", 1, 0),
    ]


def test_read_only_arrays_and_memory_maps_are_fine(tmp_path: Any) -> None:
    g = np.array([np.nan, 1.0], np.float16)
    g.flags.writeable = False
    mm = np.memmap(tmp_path / "g.bin", dtype=np.float32, mode="w+", shape=(3,))
    mm[:] = [np.inf, np.inf, 0.0]
    assert got(sc.non_finite_leaves({"g": g, "mm": mm})) == [
        ("grads['g']", 1, 0),
        ("grads['mm']", 0, 2),
    ]


def test_no_floating_point_warning_even_for_signalling_nans() -> None:
    signalling = np.array([0x7F800001, 0xFF800001], np.uint32).view(np.float32)
    with np.errstate(all="raise"):  # pytest also turns every warning into an error
        (report,) = sc.non_finite_leaves([signalling])
    assert report.nan == 2


# ------------------------------------------------------------ bad leaves
BAD_TREES = [
    {"w": np.ones(2, np.float32), "bad": np.arange(3)},
    {"bad": np.ones(2, bool)},
    {"bad": np.ones(2, np.complex64)},
    {"bad": np.array([1.0, "x"], dtype=object)},
    {"bad": [1.0, 2.0]},
    {"bad": 3.0},
    {"bad": "text"},
    {"bad": np.ma.masked_array([1.0, np.inf], mask=[False, True])},
    {"model": {"bad": np.ones(2, np.int32)}, "later": np.array([np.inf])},
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree", BAD_TREES, ids=lambda t: repr(t)[:40])
def test_bad_leaves_raise_what_unscale_raises(backend: Any, tree: Any) -> None:
    same_errors(tree, backend)


def test_a_cycle_raises_what_unscale_raises() -> None:
    cycle: list[Any] = [np.zeros(1)]
    cycle.append(cycle)
    with pytest.raises(sc.GradientValueError) as theirs:
        sc.unscale(cycle, 1.0)
    with pytest.raises(sc.GradientValueError) as ours:
        sc.non_finite_leaves(cycle)
    assert str(ours.value) == str(theirs.value)


def test_mixed_libraries_and_unknown_backends_are_refused() -> None:
    class Foreign:
        __module__ = "nosuchlib.arrays"

    with pytest.raises(sc.GradientTypeError, match="no backend handles"):
        sc.non_finite_leaves({"w": Foreign()})
    with pytest.raises(sc.BackendUnavailableError, match="not registered"):
        sc.non_finite_leaves({"w": np.zeros(1)}, backend="nosuchbackend")


# ------------------------------------------------------ third-party backends
class _Plain:
    """A third-party backend: every Backend method (delegated to NumPy's, defined on
    the class below, as a backend must: ``__getattr__`` does not count), but no
    non_finite_counts."""

    name = "plain"


def _delegate(attr: str) -> Any:
    def method(self: _Plain, *args: Any, **kwargs: Any) -> Any:
        return getattr(NumpyReferenceBackend(), attr)(*args, **kwargs)

    method.__name__ = attr
    return method


for _attr in (m for m in BACKEND_MEMBERS if m != "name"):
    setattr(_Plain, _attr, _delegate(_attr))


def test_a_backend_without_the_method_is_told_what_to_add() -> None:
    backend = _Plain()
    assert sc.get_backend(backend) is backend  # type: ignore[arg-type]
    with pytest.raises(sc.InvalidArgumentError) as info:
        sc.non_finite_leaves({"w": np.array([np.inf])}, backend=backend)
    message = str(info.value)
    assert "'plain'" in message
    assert "non_finite_counts(grads)" in message
    assert "(path, nan, inf)" in message


class _Counting(_Plain):
    """A third-party backend with only the counting kernel: the core builds the report."""

    name = "counting"

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows

    def non_finite_counts(self, grads: Any) -> list[Any]:
        return self.rows


def test_the_core_builds_the_report_from_a_backends_counts() -> None:
    rows = [("grads['a']", 0, 0), ("grads['b']", np.int64(2), 0), ("grads['c']", 0, 1)]
    reports = sc.non_finite_leaves({"w": np.zeros(1)}, backend=_Counting(rows))
    assert got(reports) == [("grads['b']", 2, 0), ("grads['c']", 0, 1)]
    assert all(type(r.nan) is int and type(r.inf) is int for r in reports)


@pytest.mark.parametrize(
    "row",
    [
        ("grads['w']", 1.0, 0),
        ("grads['w']", -1, 0),
        ("grads['w']", True, 0),
        ("grads['w']", 1),
        (0, 1, 0),
        ["grads['w']", 1, 0],
        sc.LeafReport("grads['w']", 1, 0),
    ],
)
def test_a_backend_returning_something_else_breaks_the_contract(row: Any) -> None:
    with pytest.raises(sc.BackendContractError, match=r"\(path: str, nan: int >= 0"):
        sc.non_finite_leaves({"w": np.array([np.nan])}, backend=_Counting([row]))


def test_the_fast_numpy_backend_shares_the_reference_implementation() -> None:
    assert NumpyBackend.non_finite_counts is NumpyReferenceBackend.non_finite_counts
    assert sc.get_backend("numpy").non_finite_counts({"w": np.zeros(1)}) == [("grads['w']", 0, 0)]


# ------------------------------------------------------------ LeafReport
def test_the_string_reads_like_the_issue_asked() -> None:
    report = sc.LeafReport("grads['layer3']['w']", nan=0, inf=12)
    assert str(report) == "grads['layer3']['w']: 12 inf, 0 nan"
    assert f"{sc.LeafReport('grads[0]', 3, 1)}" == "grads[0]: 1 inf, 3 nan"


@given(
    path=st.text(max_size=20),
    nan=st.integers(0, 2**40),
    inf=st.integers(0, 2**40),
)
def test_the_repr_is_valid_python(path: str, nan: int, inf: int) -> None:
    report = sc.LeafReport(path, nan, inf)
    again = eval(repr(report), {"LeafReport": sc.LeafReport})
    assert again == report
    assert repr(report).startswith("LeafReport(path=")


def test_a_report_is_frozen_and_validated() -> None:
    report = sc.LeafReport("grads['w']", 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.nan = 3  # type: ignore[misc]
    assert hash(report) == hash(sc.LeafReport("grads['w']", 1, 2))
    for bad in [{"nan": -1}, {"inf": True}, {"nan": 1.0}, {"inf": "2"}, {"path": 3}]:
        args = {"path": "grads['w']", "nan": 0, "inf": 0} | bad
        with pytest.raises(sc.InvalidArgumentError, match=f"{next(iter(bad))}="):
            sc.LeafReport(**args)
