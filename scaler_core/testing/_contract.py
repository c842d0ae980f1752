"""The Backend contract as runnable checks: :func:`check_backend`.

One place states what every backend must do, in the terms of the
:class:`~scaler_core.Backend` protocol's docstrings, and every backend of
scaler-core runs it (``tests/backends/test_contract.py``); the author of a
backend registered with :func:`scaler_core.register_backend` runs the same
checks. The expected values are computed here with NumPy, from the rules alone:
``inv_scale = f32(1 / f64(scale))``, float16/bfloat16 computed in float32 and
rounded back, the non-finite check on the unscaled values. So passing the
checks means giving the same bits as every other backend (NaN payloads aside).

Needs NumPy only (no hypothesis): the inputs are fixed and seeded.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import ml_dtypes
import numpy as np

from .._backend import Backend, get_backend
from .._config import ScalerConfig
from .._errors import (
    BackendContractError,
    GradientTypeError,
    GradientValueError,
    InvalidArgumentError,
    ScaleCollapseError,
)
from .._f32 import FLT_MIN, f32
from .._state import ScalerState, host_update, init

__all__ = ["BACKEND_CHECKS", "BackendSubject", "check_backend"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_DTYPES = (np.dtype(np.float16), _BF16, np.dtype(np.float32), np.dtype(np.float64))
_HALF = _DTYPES[:2]
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: Per dtype, scales whose gradients and unscaled values stay normal numbers (a
#: float32 subnormal would be flushed to zero by XLA), with one scale below 1, whose
#: inverse turns the largest values into inf (the check is on the unscaled values).
_SCALES = {
    np.dtype(np.float16): (1.0, 2.0**8, 3.0, 2.0**-8),
    _BF16: (1.0, 2.0**16, 3.0, 2.0**-8),
    np.dtype(np.float32): (1.0, 2.0**16, 3.0, 2.0**-8),
    np.dtype(np.float64): (1.0, 2.0**16, 3.0, 2.0**-8),
}


@dataclasses.dataclass(frozen=True)
class BackendSubject:
    """A backend under test, with the two conversions the checks need.

    Attributes:
        backend: The backend.
        asarray: A host NumPy array to an array of the backend's library (same
            dtype, shape and values; a 0-d array stays 0-d).
        to_numpy: An array of the library back to a host NumPy array.
        dtypes: The gradient dtypes checked (those the library round-trips).
    """

    backend: Backend
    asarray: Callable[[np.ndarray], Any]
    to_numpy: Callable[[Any], np.ndarray]
    dtypes: tuple[np.dtype[Any], ...]

    @property
    def name(self) -> str:
        return str(self.backend.name)


def _fail(check: str, subject: BackendSubject, what: str) -> BackendContractError:
    return BackendContractError(f"check {check!r} failed for backend {subject.name!r}: {what}")


# ---------------------------------------------------------------- references
def _inv(scale: float) -> float:
    return f32(1.0 / f32(scale))


def _unscaled(host: np.ndarray, scale: float) -> np.ndarray:
    """What every backend must compute for one leaf, by the rules alone."""
    inv = _inv(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        if host.dtype in _HALF:
            return (host.astype(np.float32) * np.float32(inv)).astype(host.dtype)
        return host * host.dtype.type(inv)


def _non_finite(*arrays: np.ndarray) -> bool:
    return any(not bool(np.isfinite(a.astype(np.float64)).all()) for a in arrays if a.size)


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bit for bit, any NaN matching any NaN (GPUs make the canonical NaN)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    uint = _UINT[want.dtype.itemsize]
    nan_got = np.isnan(got.astype(np.float64))
    nan_want = np.isnan(want.astype(np.float64))
    same = got.view(uint) == want.view(uint)
    return bool(np.all(np.where(nan_want, nan_got, same)))


def _values(dtype: np.dtype[Any], scale: float, n: int, seed: int) -> np.ndarray:
    """Gradients of ``n`` elements whose unscaled values lie in [2**-4, 2**4], signed,
    with a +0.0 and a -0.0."""
    rng = np.random.default_rng(seed)
    target = 2.0 ** rng.uniform(-4, 4, n) * rng.choice([-1.0, 1.0], n)
    host = (target * scale).astype(dtype)
    host[: min(n, 2)] = np.array([0.0, -0.0][: min(n, 2)], dtype)
    return host


def _dtype_max(dtype: np.dtype[Any]) -> float:
    return float(ml_dtypes.finfo(dtype).max) if dtype == _BF16 else float(np.finfo(dtype).max)


# ---------------------------------------------------------------- helpers
def _host(subject: BackendSubject, x: Any) -> np.ndarray:
    """A host copy (a NumPy backend's arrays change in place afterwards)."""
    return np.array(subject.to_numpy(x))


def _flag(subject: BackendSubject, check: str, flag: Any, what: str) -> bool:
    try:
        value = subject.backend.to_bool(flag)
    except Exception as exc:
        raise _fail(check, subject, f"to_bool() refused the flag {what} returned: {exc!r}") from exc
    if type(value) is not bool:
        raise _fail(check, subject, f"to_bool() returned {value!r}, not a bool")
    return value


def _raises(
    check: str,
    subject: BackendSubject,
    error: type[Exception],
    call: Callable[[], Any],
    what: str,
    *,
    names: str | None = None,
) -> None:
    """``call()`` must raise ``error`` (and its message must contain ``names``)."""
    try:
        call()
    except error as exc:
        if names is not None and names not in str(exc):
            raise _fail(
                check, subject, f"{what} raised {type(exc).__name__} without naming {names!r}: {exc}"
            ) from exc
        return
    except Exception as exc:
        raise _fail(
            check, subject, f"{what} raised {type(exc).__name__}({exc}), not {error.__name__}"
        ) from exc
    raise _fail(check, subject, f"{what} did not raise {error.__name__}")


# ---------------------------------------------------------------- the checks
def _check_protocol(subject: BackendSubject) -> None:
    """The object has every method of the protocol and a non-empty ``name``."""
    if not isinstance(subject.backend, Backend):
        raise _fail("protocol", subject, "it lacks a method of the Backend protocol")
    if not isinstance(subject.backend.name, str) or not subject.backend.name:
        raise _fail("protocol", subject, f"name={subject.backend.name!r} is not a non-empty str")


def _check_unscale_values(subject: BackendSubject) -> None:
    """Every dtype and scale: the rules' bits, the flag of the unscaled values, in place
    or functional but never half of each, with a host or a device (0-d array) scale."""
    check = "unscale_values"
    for i, dtype in enumerate(subject.dtypes):
        for j, scale in enumerate(_SCALES[dtype]):
            host = _values(dtype, scale, 37, seed=100 * i + j)
            if scale < 1.0:  # the unscale itself overflows these
                host[5] = host.dtype.type(_dtype_max(dtype) / 2)
            for scale_arg in (scale, subject.asarray(np.array(scale, np.float32))):
                _one_unscale(check, subject, [host], scale, scale_arg)


def _one_unscale(
    check: str,
    subject: BackendSubject,
    hosts: list[np.ndarray],
    scale: float,
    scale_arg: Any,
    *,
    arrays: list[Any] | None = None,
) -> None:
    grads = [subject.asarray(h) for h in hosts] if arrays is None else arrays
    before = [_host(subject, g) for g in grads]
    want = [_unscaled(b, scale) for b in before]
    tree = {"grads": grads}
    case = f"{[str(b.dtype) for b in before]} at scale={scale!r} ({type(scale_arg).__name__})"
    out, found = subject.backend.unscale(tree, scale_arg)
    got = [_host(subject, g) for g in out["grads"]]
    for g, w in zip(got, want, strict=True):
        if not _same_bits(g, w):
            raise _fail(check, subject, f"unscale of {case} gave {g!r}, the rules give {w!r}")
    after = [_host(subject, g) for g in grads]
    in_place = all(_same_bits(a, w) for a, w in zip(after, want, strict=True))
    untouched = all(_same_bits(a, b) for a, b in zip(after, before, strict=True))
    if not (in_place or untouched):
        raise _fail(check, subject, f"unscale of {case} changed its inputs, but not to the result")
    expected = _non_finite(*want)
    if _flag(subject, check, found, "unscale()") is not expected:
        raise _fail(check, subject, f"unscale of {case} flagged {not expected}, not {expected}")


def _check_unscale_trees(subject: BackendSubject) -> None:
    """Nested dicts, lists and tuples with None leaves; 0-d, empty and strided arrays;
    NaN, +inf and -inf anywhere; one flag for the whole tree; an empty tree is clean."""
    check = "unscale_trees"
    dtype = subject.dtypes[-1]
    scale = 2.0**16 if dtype != np.dtype(np.float16) else 2.0**8
    for k, special in enumerate((None, np.nan, np.inf, -np.inf)):
        plain = _values(dtype, scale, 12, seed=7 + k)
        zero_d = np.array(_values(dtype, scale, 1, seed=11)[0])
        empty = np.zeros((0, 3), dtype)
        wide = _values(dtype, scale, 24, seed=13).reshape(4, 6)
        if special is not None:
            wide[2, 4] = dtype.type(special)  # a column the strided view keeps
        arrays = [subject.asarray(plain), subject.asarray(zero_d), subject.asarray(empty)]
        strided = subject.asarray(wide)[:, ::2]
        tree = {"a": [arrays[0], None, (arrays[1],)], "b": {"c": arrays[2], "d": strided}}
        before = [_host(subject, x) for x in (*arrays, strided)]
        out, found = subject.backend.unscale(tree, scale)
        got = [
            _host(subject, x)
            for x in (out["a"][0], out["a"][2][0], out["b"]["c"], out["b"]["d"])
        ]
        want = [_unscaled(b, scale) for b in before]
        if out["a"][1] is not None or not isinstance(out["a"][2], tuple):
            raise _fail(check, subject, "unscale did not keep the tree's structure")
        for g, w in zip(got, want, strict=True):
            if not _same_bits(g, w):
                raise _fail(check, subject, f"a leaf of a nested tree gave {g!r}, not {w!r}")
        if _flag(subject, check, found, "unscale()") is not (special is not None):
            raise _fail(check, subject, f"a tree holding {special!r} flagged wrongly")
    for empty_tree in ({}, [], [None], {"a": [None, {}]}):
        _, found = subject.backend.unscale(empty_tree, 2.0)
        if _flag(subject, check, found, "unscale()"):
            raise _fail(check, subject, f"the empty tree {empty_tree!r} was flagged")


def _check_find_non_finite(subject: BackendSubject) -> None:
    """Detection alone: the right flag for every dtype and special value, nothing modified."""
    check = "find_non_finite"
    for i, dtype in enumerate(subject.dtypes):
        for special in (None, np.nan, np.inf, -np.inf):
            hosts = [_values(dtype, 1.0, 37, seed=200 + i), _values(dtype, 1.0, 5, seed=300)]
            if special is not None:
                hosts[0][17] = dtype.type(special)
            grads = [subject.asarray(h) for h in hosts]
            found = subject.backend.find_non_finite({"g": grads, "none": None})
            if _flag(subject, check, found, "find_non_finite()") is not (special is not None):
                raise _fail(check, subject, f"{dtype} holding {special!r} flagged wrongly")
            for g, h in zip(grads, hosts, strict=True):
                if not _same_bits(_host(subject, g), h):
                    raise _fail(check, subject, "find_non_finite modified a gradient")
    if _flag(subject, check, subject.backend.find_non_finite([]), "find_non_finite()"):
        raise _fail(check, subject, "the empty tree was flagged")


def _bad_leaves(subject: BackendSubject) -> dict[str, Any]:
    return {
        "int32 array": subject.asarray(np.ones(3, np.int32)),
        "bool array": subject.asarray(np.ones(3, np.bool_)),
        "complex64 array": subject.asarray(np.ones(3, np.complex64)),
        "Python float": 3.0,
        "str": "gradient",
    }


def _check_rejects_bad_leaves(subject: BackendSubject) -> None:
    """A bad leaf raises GradientTypeError naming its path, before any leaf is touched."""
    check = "rejects_bad_leaves"
    good_host = _values(subject.dtypes[-1], 4.0, 8, seed=400)
    for what, bad in _bad_leaves(subject).items():
        good = subject.asarray(good_host)
        for name, call in (
            ("unscale", lambda g=good, b=bad: subject.backend.unscale([g, b], 4.0)),
            ("find_non_finite", lambda g=good, b=bad: subject.backend.find_non_finite([g, b])),
        ):
            _raises(
                check, subject, GradientTypeError, call, f"{name} of a {what}", names="grads[1]"
            )
        if not _same_bits(_host(subject, good), good_host):
            raise _fail(check, subject, f"unscale modified a good leaf before refusing a {what}")


def _check_rejects_bad_scales(subject: BackendSubject) -> None:
    """0, negative, inf, NaN, subnormal, too large, bool and non-numbers: GradientValueError."""
    check = "rejects_bad_scales"
    host = _values(subject.dtypes[-1], 1.0, 8, seed=500)
    for scale in (0.0, -1.0, float("inf"), float("nan"), 1e-40, 1e39, True, "2", None):
        grads = [subject.asarray(host)]
        _raises(
            check,
            subject,
            GradientValueError,
            lambda g=grads, s=scale: subject.backend.unscale(g, s),
            f"unscale at scale={scale!r}",
        )
        if not _same_bits(_host(subject, grads[0]), host):
            raise _fail(check, subject, f"unscale modified a gradient before refusing {scale!r}")


def _check_scale_loss(subject: BackendSubject) -> None:
    """``loss * f32(scale)``, float32 for float16 and float32 losses."""
    check = "scale_loss"
    for dtype in (np.float16, np.float32):
        loss = subject.asarray(np.array(0.5, dtype))
        out = _host(subject, subject.backend.scale_loss(loss, 1024.0))
        if out.dtype != np.float32 or float(out) != 512.0:
            raise _fail(check, subject, f"scale_loss(0.5 as {dtype.__name__}, 1024) gave {out!r}")


def _check_select(subject: BackendSubject) -> None:
    """The chosen tree's values leaf by leaf; mismatched trees raise InvalidArgumentError."""
    check = "select"
    f32_, f16 = np.float32, np.float16
    old_h = {"w": np.array([1.0, -0.0, 3.0], f32_), "b": [np.array(2.0, f16)], "n": None}
    new_h = {"w": np.array([4.0, 5.0, 6.0], f32_), "b": [np.array(7.0, f16)], "n": None}

    def tree(h: Mapping[str, Any]) -> dict[str, Any]:
        return {"w": subject.asarray(h["w"]), "b": [subject.asarray(h["b"][0])], "n": None}

    inf = subject.asarray(np.array([np.inf], f32_))
    dirty = subject.backend.find_non_finite([inf])
    clean = subject.backend.find_non_finite([subject.asarray(np.ones(1, f32_))])
    for flag, skip in ((dirty, True), (clean, False), (True, True), (False, False)):
        out = subject.backend.select(flag, tree(old_h), tree(new_h))
        want = old_h if skip else new_h
        if out["n"] is not None or not _same_bits(_host(subject, out["w"]), want["w"]):
            raise _fail(check, subject, f"select with a {'true' if skip else 'false'} flag")
        if not _same_bits(_host(subject, out["b"][0]), want["b"][0]):
            raise _fail(check, subject, "select changed a float16 leaf")
    old = tree(old_h)
    mismatched = {
        "a missing key": ({"w": old["w"], "b": old["b"]}, "structure"),
        "a longer list": ({**old, "b": [*old["b"], old["b"][0]]}, "structure"),
        "a leaf for None": ({**old, "n": old["w"]}, "structure"),
        "another dtype": ({**old, "w": subject.asarray(new_h["w"].astype(np.float64))}, "dtype"),
        "another shape": ({**old, "w": subject.asarray(np.ones(4, f32_))}, "shape"),
    }
    for what, (other, _) in mismatched.items():
        if what == "another dtype" and np.dtype(np.float64) not in subject.dtypes:
            other = {**old, "w": subject.asarray(new_h["w"].astype(np.float16))}
        _raises(
            check,
            subject,
            InvalidArgumentError,
            lambda o=other: subject.backend.select(dirty, old, o),
            f"select of trees with {what}",
        )
    _raises(
        check,
        subject,
        GradientTypeError,
        lambda: subject.backend.select(1, old, tree(new_h)),
        "select with flag 1",
    )


_BAD_FLAGS = (1, 0.0, None, "yes", np.array([True]))


def _check_flags(subject: BackendSubject) -> None:
    """``any`` ORs flags (none: false), ``to_bool`` reads them; non-flags raise GradientTypeError."""
    check = "flags"
    backend = subject.backend
    dirty = backend.find_non_finite([subject.asarray(np.array([np.nan], np.float32))])
    clean = backend.find_non_finite([subject.asarray(np.ones(1, np.float32))])
    cases = {
        "any()": (backend.any(), False),
        "any(clean, dirty)": (backend.any(clean, dirty), True),
        "any(clean, clean)": (backend.any(clean, clean), False),
        "any(True, clean)": (backend.any(True, clean), True),
        "np.bool_(False)": (np.bool_(False), False),
        "True": (True, True),
    }
    for what, (flag, want) in cases.items():
        if _flag(subject, check, flag, what) is not want:
            raise _fail(check, subject, f"{what} read as {not want}")
    for bad in _BAD_FLAGS:
        _raises(check, subject, GradientTypeError, lambda b=bad: backend.to_bool(b), f"to_bool({bad!r})")
        _raises(check, subject, GradientTypeError, lambda b=bad: backend.any(clean, b), f"any({bad!r})")


def _check_update(subject: BackendSubject) -> None:
    """One transition equal to the host rule; a refused step raises or is recorded."""
    check = "update"
    backend = subject.backend
    dirty = backend.find_non_finite([subject.asarray(np.array([np.inf], np.float32))])
    clean = backend.find_non_finite([subject.asarray(np.ones(1, np.float32))])
    state = init(ScalerConfig(growth_interval=1, hysteresis=2, min_scale=None))
    for flag, found in ((dirty, True), (clean, False), (True, True), (False, False)):
        got = backend.update(state, flag)
        if not isinstance(got, ScalerState) or got.to_host() != host_update(state, found):
            raise _fail(check, subject, f"update with found={found} gave {got!r}")
    collapsing = init(ScalerConfig(init_scale=FLT_MIN))
    try:
        failed = backend.update(collapsing, dirty)
    except ScaleCollapseError:
        pass
    else:
        _raises(
            check,
            subject,
            ScaleCollapseError,
            failed.check,
            "a collapse neither raised nor recorded: check() on the result",
        )
    _raises(
        check,
        subject,
        InvalidArgumentError,
        lambda: backend.update("not a state", clean),  # type: ignore[arg-type]
        "update of a str",
    )
    _raises(
        check, subject, GradientTypeError, lambda: backend.update(state, 1), "update with flag 1"
    )


#: Every check, by name, in the order :func:`check_backend` runs them.
BACKEND_CHECKS: Mapping[str, Callable[[BackendSubject], None]] = MappingProxyType(
    {
        "protocol": _check_protocol,
        "unscale_values": _check_unscale_values,
        "unscale_trees": _check_unscale_trees,
        "find_non_finite": _check_find_non_finite,
        "rejects_bad_leaves": _check_rejects_bad_leaves,
        "rejects_bad_scales": _check_rejects_bad_scales,
        "scale_loss": _check_scale_loss,
        "select": _check_select,
        "flags": _check_flags,
        "update": _check_update,
    }
)


# ---------------------------------------------------------------- conversions
def _cupy_conversions() -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    cupy = importlib.import_module("cupy")

    def asarray(a: np.ndarray) -> Any:  # through same-size uints: bfloat16 too
        a = np.array(a, order="C")
        return cupy.asarray(a.view(_UINT[a.dtype.itemsize])).view(a.dtype)

    def to_numpy(x: Any) -> np.ndarray:
        return cupy.asnumpy(x.view(_UINT[x.dtype.itemsize])).view(x.dtype)  # type: ignore[no-any-return]

    return asarray, to_numpy


def _default_conversions(name: str) -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    if name == "numpy":
        return (lambda a: np.array(a)), np.asarray
    if name == "jax":
        jnp = importlib.import_module("jax.numpy")
        return jnp.asarray, np.asarray
    if name == "cupy":
        return _cupy_conversions()
    raise InvalidArgumentError(
        f"backend {name!r} is not one scaler-core knows how to make arrays for; pass "
        f"asarray= (a NumPy array to one of its arrays) and to_numpy= (back)"
    )


def _round_trips(asarray: Callable[[np.ndarray], Any], to_numpy: Callable[[Any], np.ndarray]) -> tuple[np.dtype[Any], ...]:
    out = []
    for dtype in _DTYPES:
        try:
            back = np.asarray(to_numpy(asarray(np.ones(2, dtype))))
        except Exception:  # the library has no such dtype
            continue
        if back.dtype == dtype:
            out.append(dtype)
    return tuple(out)


def check_backend(
    backend: Backend | str,
    *,
    asarray: Callable[[np.ndarray], Any] | None = None,
    to_numpy: Callable[[Any], np.ndarray] | None = None,
    only: Iterable[str] | None = None,
) -> list[str]:
    """Run the Backend contract's checks on ``backend``; raise at the first broken one.

    The checks (:data:`BACKEND_CHECKS`) cover the arithmetic of ``unscale``
    for every dtype the library has (bits equal to the rules, the flag taken on
    the unscaled values, a host or a device scale), nested trees with ``None``,
    0-d, empty and strided leaves, detection alone, refusals before anything is
    touched (bad leaves, bad scales), ``scale_loss``, ``select`` (and its
    refusal of mismatched trees), ``any``/``to_bool`` and ``update``.

    Args:
        backend: A backend object, or the name it is registered under.
        asarray: Turns a host NumPy array into an array of the backend's library;
            known for ``numpy``, ``jax`` and ``cupy`` backends.
        to_numpy: The way back.
        only: Names of the checks to run; all when omitted.

    Returns:
        The names of the checks that ran (all passed).

    Raises:
        BackendContractError: A check failed; the message names it, the case
            and what the rules expect.
        InvalidArgumentError: ``only`` names an unknown check, or ``asarray`` /
            ``to_numpy`` are needed and missing.

    >>> import scaler_core as sc
    >>> check_backend(sc.get_backend("numpy"), only=["unscale_values", "select"])
    ['unscale_values', 'select']
    """
    backend = get_backend(backend)
    names = list(BACKEND_CHECKS) if only is None else list(only)
    unknown = sorted(set(names) - set(BACKEND_CHECKS))
    if unknown:
        raise InvalidArgumentError(
            f"only={names!r} names {unknown!r}, but the checks are {list(BACKEND_CHECKS)!r}"
        )
    if asarray is None or to_numpy is None:
        default_in, default_out = _default_conversions(str(getattr(backend, "name", "")))
        asarray = default_in if asarray is None else asarray
        to_numpy = default_out if to_numpy is None else to_numpy
    subject = BackendSubject(backend, asarray, to_numpy, _round_trips(asarray, to_numpy))
    if not subject.dtypes:
        raise BackendContractError(
            f"check 'dtypes' failed for backend {subject.name!r}: asarray/to_numpy round-trip "
            f"none of float16, bfloat16, float32, float64"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        for name in names:
            BACKEND_CHECKS[name](subject)
    return names
