"""The checks of the gradients' arithmetic: ``unscale`` bit for bit on every dtype and
scale, on nested trees and on subnormals; detection alone; the per-leaf report;
``scale_loss``; and the refusals of bad leaves and bad scales before anything is touched.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from .._errors import GradientTypeError, GradientValueError
from .._report import LeafReport, non_finite_leaves
from ._harness import Check
from ._rules import BF16, gradients, non_finite, same_bits, unscaled, unscaled_flushed

__all__ = [
    "check_find_non_finite",
    "check_leaf_report",
    "check_rejects_bad_leaves",
    "check_rejects_bad_scales",
    "check_scale_loss",
    "check_subnormals",
    "check_unscale_trees",
    "check_unscale_values",
]

#: Per dtype, scales whose gradients and unscaled values stay normal numbers (a
#: float32 subnormal would be flushed to zero by XLA), with one scale below 1, whose
#: inverse turns the largest values into inf (the check is on the unscaled values).
_SCALES = {
    np.dtype(np.float16): (1.0, 2.0**8, 3.0, 2.0**-8),
    BF16: (1.0, 2.0**16, 3.0, 2.0**-8),
    np.dtype(np.float32): (1.0, 2.0**16, 3.0, 2.0**-8),
    np.dtype(np.float64): (1.0, 2.0**16, 3.0, 2.0**-8),
}
_LOSS, _LOSS_SCALE = 0.5, 1024.0
_BAD_SCALES = (0.0, -1.0, float("inf"), float("nan"), 1e-40, 1e39, True, "2", None)


def _dtype_max(dtype: np.dtype[Any]) -> float:
    info = ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call, unused-ignore]
    return float(info.max)


def check_unscale_values(c: Check) -> None:
    """Every dtype and scale: the rules' bits, the flag of the unscaled values, in place
    or functional but never half of each, with a host or a device (0-d array) scale."""
    for i, dtype in enumerate(c.subject.dtypes):
        for j, scale in enumerate(_SCALES[dtype]):
            host = gradients(dtype, scale, 37, seed=100 * i + j)
            if scale < 1.0:  # the unscale itself overflows these
                host[5] = host.dtype.type(_dtype_max(dtype) / 2)
            for scale_arg in (scale, c.array(np.array(scale, np.float32))):
                _one_unscale(c, host, scale, scale_arg)


def _one_unscale(c: Check, host: np.ndarray, scale: float, scale_arg: Any) -> None:
    grads = [c.array(host)]
    before = [c.host(g) for g in grads]
    want = [unscaled(b, scale) for b in before]
    case = f"{host.dtype} at scale={scale!r} ({type(scale_arg).__name__})"
    out, found = c.unscale({"grads": grads}, scale_arg)
    got = [c.host(g) for g in out["grads"]]
    for g, w in zip(got, want, strict=True):
        if not same_bits(g, w):
            raise c.fail(f"unscale of {case} gave {g!r}, the rules give {w!r}")
    after = [c.host(g) for g in grads]
    in_place = all(same_bits(a, w) for a, w in zip(after, want, strict=True))
    untouched = all(same_bits(a, b) for a, b in zip(after, before, strict=True))
    if not (in_place or untouched):
        raise c.fail(f"unscale of {case} changed its inputs, but not to the result")
    expected = non_finite(*want)
    if c.flag(found, "unscale()") is not expected:
        raise c.fail(f"unscale of {case} flagged {not expected}, not {expected}")


class _Pair(NamedTuple):
    c: Any
    d: Any


def check_unscale_trees(c: Check) -> None:
    """Nested dicts, lists, tuples and NamedTuples with None leaves; 0-d, empty and
    strided arrays; NaN, +inf or -inf; one flag for the whole tree; empty trees are clean."""
    dtype = c.subject.dtypes[-1]
    scale = 2.0**16 if dtype != np.dtype(np.float16) else 2.0**8
    for k, special in enumerate((None, np.nan, np.inf, -np.inf)):
        wide = gradients(dtype, scale, 24, seed=13).reshape(4, 6)
        if special is not None:
            wide[2, 4] = dtype.type(special)  # a column the strided view keeps
        leaves = [
            c.array(gradients(dtype, scale, 12, seed=7 + k)),
            c.array(np.array(gradients(dtype, scale, 3, seed=11)[2])),  # 0-d
            c.array(np.zeros((0, 3), dtype)),
            c.array(wide)[:, ::2],
        ]
        tree = {"a": [leaves[0], None, (leaves[1],)], "b": _Pair(leaves[2], leaves[3])}
        want = [unscaled(c.host(x), scale) for x in leaves]
        out, found = c.unscale(tree, scale)
        if out["a"][1] is not None or type(out["a"][2]) is not tuple or type(out["b"]) is not _Pair:
            raise c.fail("unscale did not keep the tree's structure")
        got = [c.host(x) for x in (out["a"][0], out["a"][2][0], out["b"].c, out["b"].d)]
        for g, w in zip(got, want, strict=True):
            if not same_bits(g, w):
                raise c.fail(f"a leaf of a nested tree gave {g!r}, not {w!r}")
        if c.flag(found, "unscale()") is not (special is not None):
            raise c.fail(f"a tree holding {special!r} flagged wrongly")
    empty_trees: tuple[Any, ...] = ({}, [], [None], {"a": [None, {}]})
    for empty_tree in empty_trees:
        _, found = c.unscale(empty_tree, 2.0)
        if c.flag(found, "unscale()"):
            raise c.fail(f"the empty tree {empty_tree!r} was flagged")


def _subnormal_values(dtype: np.dtype[Any]) -> np.ndarray:
    """Subnormals of ``dtype`` (and of float32, which half types compute in), values
    whose unscaled results are subnormal, and normal values around them."""
    info = ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call, unused-ignore]
    tiny = float(info.tiny)
    f32_tiny = float(np.finfo(np.float32).tiny)
    values = [tiny / 2, -tiny / 4, tiny / 1024, tiny, -tiny, 3 * tiny, 2.0**-20, -1.5]
    values += [f32_tiny / 8, -f32_tiny / 2, f32_tiny * 2**10, f32_tiny * 2**20]
    return np.asarray(values, dtype=np.float64).astype(dtype)


def check_subnormals(c: Check) -> None:
    """Subnormal inputs and results, exactly as the rules give them; a backend that
    declares ``flushes_subnormals`` (XLA) exactly as flushing gives them."""
    expect = unscaled_flushed if c.subject.flushes_subnormals else unscaled
    for dtype in c.subject.dtypes:
        # Shrinks into the subnormals; lifts out of them; shrinks past them (a half type's
        # float32 product then rounds to +-0, which a cast that is not IEEE misses).
        for scale in (2.0**16, 2.0**-8, 2.0**70):
            host = _subnormal_values(dtype)
            want = expect(host, scale)
            out, found = c.unscale([c.array(host)], scale)
            got = c.host(out[0])
            if not same_bits(got, want):
                raise c.fail(
                    f"unscale of {dtype} subnormals at scale={scale!r} gave {got!r}, "
                    f"the rules give {want!r}"
                    + (" (with subnormals flushed)" if c.subject.flushes_subnormals else "")
                )
            if c.flag(found, "unscale()"):
                raise c.fail(f"subnormal {dtype} values were flagged as non-finite")


def check_find_non_finite(c: Check) -> None:
    """Detection alone: the right flag for every dtype and special value, nothing modified."""
    for i, dtype in enumerate(c.subject.dtypes):
        for special in (None, np.nan, np.inf, -np.inf):
            hosts = [gradients(dtype, 1.0, 37, seed=200 + i), gradients(dtype, 1.0, 5, seed=300)]
            if special is not None:
                hosts[0][17] = dtype.type(special)
            grads = [c.array(h) for h in hosts]
            found = c.find_non_finite({"g": grads, "none": None})
            if c.flag(found, "find_non_finite()") is not (special is not None):
                raise c.fail(f"{dtype} holding {special!r} flagged wrongly")
            if not all(same_bits(c.host(g), h) for g, h in zip(grads, hosts, strict=True)):
                raise c.fail("find_non_finite modified a gradient")
    if c.flag(c.find_non_finite([]), "find_non_finite()"):
        raise c.fail("the empty tree was flagged")


def check_leaf_report(c: Check) -> None:
    """Where the backend counts non-finite elements per leaf (the optional
    ``non_finite_counts``): each leaf once, at its first path, with its NaN and inf
    counts, for every dtype, nothing modified."""
    if not callable(getattr(c.backend, "non_finite_counts", None)):
        return  # optional: non_finite_leaves then tells the user what to add
    for i, dtype in enumerate(c.subject.dtypes):
        hosts = [gradients(dtype, 1.0, 37, seed=500 + i), gradients(dtype, 1.0, 5, seed=600)]
        hosts[0][[3, 9]] = dtype.type(np.nan)
        hosts[0][17] = dtype.type(np.inf)
        hosts[0][20] = dtype.type(-np.inf)
        grads = [c.array(h) for h in hosts]
        tree = {"g": grads, "none": None, "tied": grads[0]}
        c.now("non_finite_leaves (non_finite_counts(grads))")
        try:
            got = non_finite_leaves(tree, backend=c.backend)
        except Exception as exc:
            raise c.fail(f"non_finite_leaves on {dtype} leaves raised {exc!r}") from exc
        want = (LeafReport("grads['g'][0]", 2, 2),)
        if got != want:
            raise c.fail(f"{dtype}: reported {got!r}, but the leaves hold {want!r}")
        if not all(same_bits(c.host(g), h) for g, h in zip(grads, hosts, strict=True)):
            raise c.fail("non_finite_counts modified a gradient")
    if non_finite_leaves({"none": None}, backend=c.backend) != ():
        raise c.fail("a tree without leaves was reported")


def check_rejects_bad_leaves(c: Check) -> None:
    """A bad leaf raises GradientTypeError naming its path, before any leaf is touched."""
    good_host = gradients(c.subject.dtypes[-1], 4.0, 8, seed=400)
    bad_leaves = {
        "int32 array": c.array(np.ones(3, np.int32)),
        "bool array": c.array(np.ones(3, np.bool_)),
        "complex64 array": c.array(np.ones(3, np.complex64)),
        "Python float": 3.0,
        "str": "gradient",
    }
    for what, bad in bad_leaves.items():
        good = c.array(good_host)
        c.raises(
            GradientTypeError,
            functools.partial(c.unscale, [good, bad], 4.0),
            f"unscale of a {what}",
            names="grads[1]",
        )
        c.raises(
            GradientTypeError,
            functools.partial(c.find_non_finite, [good, bad]),
            f"find_non_finite of a {what}",
            names="grads[1]",
        )
        if not same_bits(c.host(good), good_host):
            raise c.fail(f"unscale modified a good leaf before refusing a {what}")


def check_rejects_bad_scales(c: Check) -> None:
    """0, negative, inf, NaN, subnormal, too large, bool and non-numbers: GradientValueError
    from unscale (before any gradient is touched) and from scale_loss."""
    host = gradients(c.subject.dtypes[-1], 1.0, 8, seed=500)
    loss = c.array(np.array(_LOSS, np.float32))
    for scale in _BAD_SCALES:
        grads = [c.array(host)]
        c.raises(
            GradientValueError,
            functools.partial(c.unscale, grads, scale),
            f"unscale at scale={scale!r}",
        )
        if not same_bits(c.host(grads[0]), host):
            raise c.fail(f"unscale modified a gradient before refusing scale={scale!r}")
        c.raises(
            GradientValueError,
            functools.partial(c.backend.scale_loss, loss, scale),
            f"scale_loss at scale={scale!r}",
        )


def check_scale_loss(c: Check) -> None:
    """``loss * f32(scale)``, float32 for float16 and float32 losses."""
    for dtype in (np.float16, np.float32):
        if np.dtype(dtype) not in c.subject.dtypes:  # the Array API has no float16
            continue
        loss = c.array(np.array(_LOSS, dtype))
        c.now(f"scale_loss(<a {np.dtype(dtype)} loss>, {_LOSS_SCALE})")
        out = c.host(c.backend.scale_loss(loss, _LOSS_SCALE))
        if out.dtype != np.float32 or float(out) != _LOSS * _LOSS_SCALE:
            raise c.fail(f"scale_loss({_LOSS} as {dtype.__name__}, {_LOSS_SCALE}) gave {out!r}")
