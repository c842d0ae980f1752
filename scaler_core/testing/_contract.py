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
import functools
import importlib
import math
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from .. import _ops
from .._backend import Backend, get_backend, missing_members
from .._coerce import describe, host_flag
from .._config import ScalerConfig
from .._errors import (
    BackendContractError,
    GradientTypeError,
    GradientValueError,
    InvalidArgumentError,
    ScaleCollapseError,
)
from .._f32 import FLT_MIN, f32
from .._report import LeafReport, non_finite_leaves
from .._state import DATA_FIELDS, FLOAT_FIELDS, ScalerState, host_update, init

__all__ = ["BACKEND_CHECKS", "NAMESPACE_DUTIES", "check_backend"]

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
        flushes_subnormals: The library computes with subnormals flushed to zero
            (XLA does, on CPU and GPU): subnormal inputs of the multiply count as
            zero and subnormal products become zero, signs kept. The
            ``subnormals`` check then expects exactly that, and nothing else.
    """

    backend: Backend
    asarray: Callable[[np.ndarray], Any]
    to_numpy: Callable[[Any], np.ndarray]
    dtypes: tuple[np.dtype[Any], ...]
    flushes_subnormals: bool = False

    @property
    def name(self) -> str:
        return str(self.backend.name)


# ---------------------------------------------------------------- references
def _inv(scale: float) -> float:
    return f32(1.0 / f32(scale))


def _unscaled(host: np.ndarray, scale: float) -> np.ndarray:
    """What every backend must compute for one leaf, by the rules alone."""
    inv = _inv(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        if host.dtype in _HALF:
            return np.asarray(host.astype(np.float32) * np.float32(inv), dtype=host.dtype)
        return np.asarray(host * host.dtype.type(inv), dtype=host.dtype)


def _unscaled_flushed(host: np.ndarray, scale: float) -> np.ndarray:
    """:func:`_unscaled` where the multiply flushes subnormals (FTZ and DAZ)."""
    compute = np.dtype(np.float64 if host.dtype == np.dtype(np.float64) else np.float32)
    tiny = compute.type(np.finfo(compute).tiny)
    with np.errstate(over="ignore", invalid="ignore"):
        x = host.astype(compute)
        x = np.where(np.abs(x) < tiny, np.copysign(compute.type(0), x), x)
        y = np.asarray(x * compute.type(_inv(scale)), dtype=compute)
        y = np.where(np.abs(y) < tiny, np.copysign(compute.type(0), y), y)
        return np.asarray(y, dtype=compute).astype(host.dtype)


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
    host = np.asarray(target * scale, dtype=dtype)
    host[: min(n, 2)] = np.array([0.0, -0.0][: min(n, 2)], dtype)
    return host


def _dtype_max(dtype: np.dtype[Any]) -> float:
    info = ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call, unused-ignore]
    return float(info.max)


# ---------------------------------------------------------------- helpers
class _Check:
    """One check of one backend: how it reads arrays and flags, and how it fails."""

    def __init__(self, name: str, subject: BackendSubject) -> None:
        self.name, self.subject, self.backend = name, subject, subject.backend
        #: The call in progress, named by the members it runs: what an unexpected
        #: exception is reported as coming from.
        self.doing = "the check"

    @property
    def prefix(self) -> str:
        return f"check {self.name!r} failed for backend {self.subject.name!r}: "

    def fail(self, what: str) -> BackendContractError:
        return BackendContractError(self.prefix + what)

    def unexpected(self, exc: BaseException) -> BackendContractError:
        """An exception the contract does not document, as a contract failure naming the
        members that were running (chain it with ``from exc``)."""
        return self.fail(
            f"{self.doing} raised {type(exc).__name__}: {exc}, but a backend's members must "
            f"return what the Backend protocol says, or raise the errors it documents"
        )

    def now(self, doing: str) -> None:
        self.doing = doing

    # The operations as users call them: composed, once, from the backend's passes.
    def unscale(self, grads: Any, scale: Any) -> tuple[Any, Any]:
        self.now("unscale (leaves(grads, writable=True), then unscale(leaves, scale))")
        return _ops.unscale(self.backend, grads, scale)

    def unscale_and_norm(self, grads: Any, scale: Any) -> tuple[Any, Any, Any]:
        self.now("unscale_and_norm (leaves(grads, writable=True), then measure(write=True))")
        return _ops.unscale_and_norm(self.backend, grads, scale)

    def unscale_and_clip(
        self, grads: Any, scale: Any, max_norm: Any, reduce: Callable[[Any], Any] | None = None
    ) -> tuple[Any, Any, Any]:
        self.now("unscale_and_clip (leaves(), measure(write=False), then rescale())")
        return _ops.unscale_and_clip(self.backend, grads, scale, max_norm, reduce)

    def find_non_finite(self, grads: Any) -> Any:
        self.now("find_non_finite (leaves(grads, writable=False), then unscale(leaves, None))")
        return _ops.find_non_finite(self.backend, grads)

    def host(self, x: Any) -> np.ndarray:
        """A host copy (a NumPy backend's arrays change in place afterwards)."""
        self.now(f"to_numpy() of a {type(x).__qualname__}")
        return np.array(self.subject.to_numpy(x))

    def array(self, host: np.ndarray) -> Any:
        self.now(f"asarray() of a {host.dtype} array of shape {host.shape}")
        return self.subject.asarray(host)

    def flag(self, flag: Any, what: str) -> bool:
        try:
            value = self.backend.to_bool(flag)
        except Exception as exc:
            raise self.fail(f"to_bool() refused the flag {what} returned: {exc!r}") from exc
        if type(value) is not bool:
            raise self.fail(f"to_bool() returned {value!r}, not a bool")
        return value

    def raises(
        self, error: type[Exception], call: Callable[[], Any], what: str, names: str = ""
    ) -> None:
        """``call()`` must raise ``error``, with ``names`` in its message."""
        try:
            call()
        except error as exc:
            if names not in str(exc):
                raise self.fail(
                    f"{what} raised {type(exc).__name__} without naming {names!r}"
                ) from exc
            return
        except Exception as exc:
            raise self.fail(
                f"{what} raised {type(exc).__name__}({exc}), not {error.__name__}"
            ) from exc
        raise self.fail(f"{what} did not raise {error.__name__}")


# ---------------------------------------------------------------- the checks
_LOSS, _LOSS_SCALE = 0.5, 1024.0
_BAD_SCALES = (0.0, -1.0, float("inf"), float("nan"), 1e-40, 1e39, True, "2", None)
_BAD_FLAGS = (1, 0.0, None, "yes", np.array([True]))


def _check_protocol(c: _Check) -> None:
    """The object has every method of the protocol and a non-empty ``name``."""
    missing = missing_members(c.backend)
    if missing:
        raise c.fail(
            f"it lacks {missing} of the Backend protocol (members served by __getattr__ "
            f"do not count: define them on its class)"
        )
    if not isinstance(c.backend.name, str) or not c.backend.name:
        raise c.fail(f"name={c.backend.name!r} is not a non-empty str")


#: What the core asks of a backend's :meth:`~scaler_core.Backend.namespace`, member by
#: member: the call as the core makes it, and what it must give. Every member the core
#: reads is here (a test holds this against ``scaler_core._ops`` and ``_state``), and the
#: ``namespace`` check holds each one to its line, naming it when it breaks.
NAMESPACE_DUTIES: Mapping[str, str] = MappingProxyType(
    {
        "on_host": "on_host must be True (flags are host values and the core decides on "
        "the host) or False (a device library: nothing is read back)",
        "float64_missing": "float64_missing must be None where float64 is exact, else a str "
        "saying how to enable it",
        "flag": "flag(value) must return a flag holding the bool value: where on_host, a "
        "bool or numpy.bool_; else a 0-d array of its library whose dtype isdtype calls "
        "'bool', made on its device",
        "read": "read(flag) must return the flag's value as a Python bool (the one host "
        "synchronisation)",
        "is_array": "is_array(value) must return whether value is an array of its library "
        "(True for its flags and arrays, False for a Python float)",
        "logical_or": "logical_or(a, b) must return the flag a or b",
        "where": "where(cond, a, b) must return a where the flag cond is true, else b, bit "
        "for bit (a and b arrays, float32(x) values or Python numbers)",
        "map_pairs": "map_pairs(fn, on_skip, on_step) must call fn(path, a, b) for each pair "
        "of leaves (path a str naming the leaf, a from on_skip, b from on_step), return a "
        "tree of on_step's structure holding fn's results, and raise InvalidArgumentError "
        "where the trees differ",
        "asarray": "asarray(value, dtype=None) must return an array of its library with "
        ".shape and .dtype: of a Python number or bool a 0-d array holding it rounded to "
        "dtype (float32, float64, int32, Python bool or None), of one of its arrays an "
        "array of the same shape and dtype",
        "float32": "float32 must be a dtype asarray(value, dtype=float32) takes, and "
        "callable: float32(x) is x rounded to float32, a 0-d value arrays compute with",
        "float64": "float64 must be a dtype asarray(value, dtype=float64) takes, and "
        "callable: float64(x) is x as a float64 value arrays compute with (exact where "
        "float64_missing is None)",
        "int32": "int32 must be a dtype asarray(value, dtype=int32) takes",
        "isdtype": "isdtype(dtype, kind) must answer, as the Array API's isdtype does, "
        "whether a dtype of its library is of kind 'bool' (a flag's) or 'real floating' "
        "(float16, bfloat16, float32, float64: a norm's), with a Python bool",
        "isfinite": "isfinite(x) must be False for NaN, inf and -inf and True for every "
        "finite value (the transition grows the scale only where the product is finite)",
        "maximum": "maximum(a, b) must return the larger of two float32 values",
        "minimum": "minimum(a, b) must return the smaller of two float32 values",
    }
)


class _Namespace:
    """A backend's namespace under the ``namespace`` check: each call named, and refused
    with the member's duty when it raises or gives the wrong thing."""

    def __init__(self, c: _Check, xp: Any) -> None:
        self.c, self.xp = c, xp

    def broken(self, call: str, did: str) -> BackendContractError:
        member = call.partition("(")[0]
        return self.c.fail(f"namespace().{call} {did}, but {NAMESPACE_DUTIES[member]}")

    def __call__(self, call: str, *args: Any, **kwargs: Any) -> Any:
        """``namespace().<member>(*args, **kwargs)``; ``call`` shows it in messages."""
        self.c.now(f"namespace().{call}")
        try:
            return getattr(self.xp, call.partition("(")[0])(*args, **kwargs)
        except BackendContractError:
            raise
        except Exception as exc:
            raise self.broken(call, f"raised {type(exc).__name__}: {exc}") from exc

    def array(self, call: str, value: Any, shape: tuple[int, ...] = ()) -> Any:
        """``value``, which ``call`` returned, after checking it is an array of ``shape``."""
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise self.broken(call, f"returned {value!r}, which has no .shape and .dtype")
        if tuple(value.shape) != shape:
            raise self.broken(call, f"returned an array of shape {tuple(value.shape)}, not {shape}")
        return value

    def number(self, call: str, value: Any, want: float) -> None:
        """``value`` (a 0-d array ``call`` returned) must read back as ``want``."""
        try:
            got = float(value)
        except Exception as exc:
            raise self.broken(
                call, f"returned {describe(value)}, which float() cannot read"
            ) from exc
        if not (got == want or (math.isnan(got) and math.isnan(want))):
            raise self.broken(call, f"gave {got!r}, not {want!r}")

    def truth(self, call: str, value: Any, want: bool) -> None:
        """``value`` (a flag ``call`` returned) must read back as ``want``."""
        got = self(f"read({call})", value)
        if got is not want:
            raise self.broken(call, f"gave a flag that reads as {got!r}, not {want!r}")


def _check_namespace(c: _Check) -> None:
    """``namespace()`` serves every member the core reads, called as the core calls it:
    ``on_host``, ``float64_missing``, ``flag``, ``read``, ``is_array``, ``logical_or``,
    ``where``, ``map_pairs`` (``fn(path, a, b)``), ``asarray`` (arrays with ``.shape`` and
    ``.dtype``), the dtypes ``float32``, ``float64`` (both callable) and ``int32``,
    ``isfinite`` (false for NaN and +-inf), ``maximum`` and ``minimum``."""
    c.now("namespace()")
    xp = c.backend.namespace()
    missing = [m for m in NAMESPACE_DUTIES if not hasattr(xp, m)]
    if missing:
        raise c.fail(
            f"namespace() returned a {type(xp).__qualname__} without {missing}, but the core "
            f"reads every one of {list(NAMESPACE_DUTIES)}"
        )
    ns = _Namespace(c, xp)
    if xp.on_host not in (True, False):
        raise ns.broken("on_host", f"is {xp.on_host!r}")
    if xp.float64_missing is not None and not isinstance(xp.float64_missing, str):
        raise ns.broken("float64_missing", f"is {xp.float64_missing!r}")
    flags = _namespace_flags(ns)
    _namespace_values(ns, flags)
    _namespace_leaves(ns, flags)


def _namespace_flags(ns: _Namespace) -> dict[bool, Any]:
    """``flag``, ``read`` and ``logical_or``: the flags ``flag(True)`` and ``flag(False)``."""
    flags = {}
    for value in (True, False):
        call = f"flag({value})"
        flag = ns(call, value)
        if ns.xp.on_host:
            try:
                ok = host_flag(flag) is not None
            except GradientTypeError:
                ok = False
        else:
            ok = (
                ns(f"is_array({call})", flag) is True
                and tuple(getattr(flag, "shape", (1,))) == ()
                and ns(f"isdtype({call}.dtype, 'bool')", getattr(flag, "dtype", None), "bool")
                is True
            )
        if not ok:
            raise ns.broken(call, f"returned {describe(flag)}")
        got = ns(f"read({call})", flag)
        if type(got) is not bool or got is not value:
            raise ns.broken("read", f"of flag({value}) returned {got!r}")
        flags[value] = flag
    for a in (True, False):
        for b in (True, False):
            call = f"logical_or(flag({a}), flag({b}))"
            ns.truth(call, ns(call, flags[a], flags[b]), a or b)
    return flags


def _namespace_values(ns: _Namespace, flags: dict[bool, Any]) -> None:
    """The 0-d values the transition and the clip coefficient compute with: ``asarray``,
    the dtypes, ``isfinite``, ``maximum``, ``minimum`` and ``where``."""
    xp, f32_, i32 = ns.xp, ns.xp.float32, ns.xp.int32
    for value, dtype, name in ((0.1, f32_, "float32"), (7, i32, "int32"), (-2.5, f32_, "float32")):
        call = f"asarray({value!r}, dtype={name})"
        ns.number(call, ns.array(call, ns(call, value, dtype=dtype)), f32(value))
    if xp.float64_missing is None:
        call = "asarray(0.1, dtype=float64)"
        ns.number(call, ns.array(call, ns(call, 0.1, dtype=xp.float64)), 0.1)
        ns.number("float64(0.1)", ns("float64(0.1)", 0.1), 0.1)
    for value in (True, False):
        call = f"asarray({value}, dtype=bool)"
        ns.truth(call, ns.array(call, ns(call, value, dtype=bool)), value)
    ns.truth("asarray(False)", ns.array("asarray(False)", ns("asarray(False)", False)), False)
    ns.number("float32(0.1)", ns("float32(0.1)", 0.1), f32(0.1))

    def f32_array(value: float) -> Any:
        call = f"asarray({value!r}, dtype=float32)"
        return ns.array(call, ns(call, value, dtype=f32_))

    two, three = f32_array(2.0), f32_array(3.0)
    ns.c.now("arithmetic on namespace().asarray(2.0, dtype=float32) and float32(0.5)")
    ns.number("float32(0.5)", two * ns("float32(0.5)", 0.5), 1.0)
    ns.truth("asarray(2.0, dtype=float32) < asarray(3.0, dtype=float32)", two < three, True)
    for value in (1.0, 3.0e38, math.inf, -math.inf, math.nan):
        call = f"isfinite(asarray({value!r}, dtype=float32))"
        ns.truth(call, ns(call, f32_array(value)), math.isfinite(value))
    ns.number("maximum(2.0, float32(3.0))", ns("maximum", two, ns("float32(3.0)", 3.0)), 3.0)
    ns.number("maximum(3.0, float32(2.0))", ns("maximum", three, ns("float32(2.0)", 2.0)), 3.0)
    ns.number("minimum(2.0, 3.0)", ns("minimum", two, three), 2.0)
    ns.number("minimum(3.0, 2.0)", ns("minimum", three, two), 2.0)
    seven = ns("asarray(7, dtype=int32)", 7, dtype=i32)
    kinds = (
        ("flag(True)", flags[True].dtype, {"bool": True, "real floating": False}),
        ("asarray(2.0, dtype=float32)", two.dtype, {"bool": False, "real floating": True}),
        ("asarray(7, dtype=int32)", seven.dtype, {"bool": False, "real floating": False}),
    )
    for made, dtype, answers in kinds:
        for kind, answer in answers.items():
            call = f"isdtype({made}.dtype, {kind!r})"
            got = ns(call, dtype, kind)
            if got is not answer:
                raise ns.broken(call, f"returned {got!r}, not {answer!r}")
    for value in (True, False):
        call = f"where(flag({value}), asarray(2.0, dtype=float32), asarray(3.0, dtype=float32))"
        ns.number(call, ns(call, flags[value], two, three), 2.0 if value else 3.0)
        call = f"where(flag({value}), 5, asarray(7, dtype=int32))"
        ns.number(call, ns(call, flags[value], 5, seven), 5 if value else 7)


def _namespace_leaves(ns: _Namespace, flags: dict[bool, Any]) -> None:
    """What ``select`` asks of the namespace for the library's arrays: ``asarray`` keeps
    shape and dtype, and on a device ``is_array`` and ``where``; then ``map_pairs``."""
    c = ns.c
    hosts = [np.arange(6, dtype=d).reshape(2, 3) for d in c.subject.dtypes[:2]]
    leaves = [c.array(h) for h in hosts]
    seen = [
        ns.array(f"asarray(<a {h.dtype} array>)", ns("asarray", x), h.shape)
        for h, x in zip(hosts, leaves, strict=True)
    ]
    if len({str(x.dtype) for x in seen}) != len(seen):
        raise ns.broken(
            f"asarray(<a {hosts[-1].dtype} array>)",
            f"gave the dtype {seen[-1].dtype}, as of a {hosts[0].dtype} array",
        )
    if not ns.xp.on_host:  # where is the device select's, is_array its test for an array
        if ns("is_array(<an array>)", leaves[0]) is not True:
            raise ns.broken("is_array(<an array>)", "returned something else than True")
        if ns("is_array(1.0)", 1.0) is not False:
            raise ns.broken("is_array(1.0)", "returned something else than False")
        for value in (True, False):
            a, b = c.array(hosts[0]), c.array(hosts[0][::-1].copy())
            call = f"where(flag({value}), <an array>, <another>)"
            got = c.host(ns.array(call, ns(call, flags[value], a, b), hosts[0].shape))
            if not _same_bits(got, hosts[0] if value else hosts[0][::-1]):
                raise ns.broken(call, f"gave {got!r}")
    _namespace_map_pairs(ns, leaves[0])


def _namespace_map_pairs(ns: _Namespace, leaf: Any) -> None:
    """``map_pairs(fn, on_skip, on_step)``: ``fn(path, a, b)`` per pair of leaves, the
    results in ``on_step``'s structure, InvalidArgumentError for trees that differ."""
    calls: list[tuple[Any, ...]] = []
    results: list[object] = []

    def fn(*args: Any) -> object:
        calls.append(args)
        results.append(object())
        return results[-1]

    on_skip = {"w": leaf, "b": [leaf, None], "t": (leaf,)}
    on_step = {"w": leaf, "b": [leaf, None], "t": (leaf,)}
    pairs = 3
    call = "map_pairs(fn, on_skip, on_step)"
    out = ns(call, fn, on_skip, on_step)
    for args in calls:
        if len(args) != len(("path", "a", "b")) or not isinstance(args[0], str):
            shown = ", ".join(type(a).__qualname__ for a in args)
            raise ns.broken(call, f"called fn({shown})")
    if len(calls) != pairs:
        raise ns.broken(call, f"called fn {len(calls)} times for {pairs} pairs of leaves")
    try:
        kept = out["b"][1] is None and type(out["t"]) is tuple
        placed = {id(out["w"]), id(out["b"][0]), id(out["t"][0])} == {id(r) for r in results}
    except Exception as exc:
        raise ns.broken(call, f"returned {out!r}, not a tree of on_step's structure") from exc
    if not (kept and placed):
        raise ns.broken(call, f"returned {out!r}, not on_step's structure holding fn's results")
    ns.c.now("namespace().map_pairs(fn, on_skip, on_step) of trees that differ")
    try:
        ns.xp.map_pairs(fn, {"w": leaf}, {"w": leaf, "b": leaf})
    except InvalidArgumentError:
        return
    except Exception as exc:
        raise ns.broken(
            call, f"raised {type(exc).__name__} for trees that differ, not InvalidArgumentError"
        ) from exc
    raise ns.broken(call, "paired trees that differ without raising InvalidArgumentError")


def _check_unscale_values(c: _Check) -> None:
    """Every dtype and scale: the rules' bits, the flag of the unscaled values, in place
    or functional but never half of each, with a host or a device (0-d array) scale."""
    for i, dtype in enumerate(c.subject.dtypes):
        for j, scale in enumerate(_SCALES[dtype]):
            host = _values(dtype, scale, 37, seed=100 * i + j)
            if scale < 1.0:  # the unscale itself overflows these
                host[5] = host.dtype.type(_dtype_max(dtype) / 2)
            for scale_arg in (scale, c.array(np.array(scale, np.float32))):
                _one_unscale(c, host, scale, scale_arg)


def _one_unscale(c: _Check, host: np.ndarray, scale: float, scale_arg: Any) -> None:
    grads = [c.array(host)]
    before = [c.host(g) for g in grads]
    want = [_unscaled(b, scale) for b in before]
    case = f"{host.dtype} at scale={scale!r} ({type(scale_arg).__name__})"
    out, found = c.unscale({"grads": grads}, scale_arg)
    got = [c.host(g) for g in out["grads"]]
    for g, w in zip(got, want, strict=True):
        if not _same_bits(g, w):
            raise c.fail(f"unscale of {case} gave {g!r}, the rules give {w!r}")
    after = [c.host(g) for g in grads]
    in_place = all(_same_bits(a, w) for a, w in zip(after, want, strict=True))
    untouched = all(_same_bits(a, b) for a, b in zip(after, before, strict=True))
    if not (in_place or untouched):
        raise c.fail(f"unscale of {case} changed its inputs, but not to the result")
    expected = _non_finite(*want)
    if c.flag(found, "unscale()") is not expected:
        raise c.fail(f"unscale of {case} flagged {not expected}, not {expected}")


class _Pair(NamedTuple):
    c: Any
    d: Any


def _check_unscale_trees(c: _Check) -> None:
    """Nested dicts, lists, tuples and NamedTuples with None leaves; 0-d, empty and
    strided arrays; NaN, +inf or -inf; one flag for the whole tree; empty trees are clean."""
    dtype = c.subject.dtypes[-1]
    scale = 2.0**16 if dtype != np.dtype(np.float16) else 2.0**8
    for k, special in enumerate((None, np.nan, np.inf, -np.inf)):
        wide = _values(dtype, scale, 24, seed=13).reshape(4, 6)
        if special is not None:
            wide[2, 4] = dtype.type(special)  # a column the strided view keeps
        leaves = [
            c.array(_values(dtype, scale, 12, seed=7 + k)),
            c.array(np.array(_values(dtype, scale, 3, seed=11)[2])),  # 0-d
            c.array(np.zeros((0, 3), dtype)),
            c.array(wide)[:, ::2],
        ]
        tree = {"a": [leaves[0], None, (leaves[1],)], "b": _Pair(leaves[2], leaves[3])}
        want = [_unscaled(c.host(x), scale) for x in leaves]
        out, found = c.unscale(tree, scale)
        if out["a"][1] is not None or type(out["a"][2]) is not tuple or type(out["b"]) is not _Pair:
            raise c.fail("unscale did not keep the tree's structure")
        got = [c.host(x) for x in (out["a"][0], out["a"][2][0], out["b"].c, out["b"].d)]
        for g, w in zip(got, want, strict=True):
            if not _same_bits(g, w):
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


def _check_subnormals(c: _Check) -> None:
    """Subnormal inputs and results, exactly as the rules give them; a backend that
    declares ``flushes_subnormals`` (XLA) exactly as flushing gives them."""
    expect = _unscaled_flushed if c.subject.flushes_subnormals else _unscaled
    for dtype in c.subject.dtypes:
        # Shrinks into the subnormals; lifts out of them; shrinks past them (a half type's
        # float32 product then rounds to +-0, which a cast that is not IEEE misses).
        for scale in (2.0**16, 2.0**-8, 2.0**70):
            host = _subnormal_values(dtype)
            want = expect(host, scale)
            out, found = c.unscale([c.array(host)], scale)
            got = c.host(out[0])
            if not _same_bits(got, want):
                raise c.fail(
                    f"unscale of {dtype} subnormals at scale={scale!r} gave {got!r}, "
                    f"the rules give {want!r}"
                    + (" (with subnormals flushed)" if c.subject.flushes_subnormals else "")
                )
            if c.flag(found, "unscale()"):
                raise c.fail(f"subnormal {dtype} values were flagged as non-finite")


def _check_find_non_finite(c: _Check) -> None:
    """Detection alone: the right flag for every dtype and special value, nothing modified."""
    for i, dtype in enumerate(c.subject.dtypes):
        for special in (None, np.nan, np.inf, -np.inf):
            hosts = [_values(dtype, 1.0, 37, seed=200 + i), _values(dtype, 1.0, 5, seed=300)]
            if special is not None:
                hosts[0][17] = dtype.type(special)
            grads = [c.array(h) for h in hosts]
            found = c.find_non_finite({"g": grads, "none": None})
            if c.flag(found, "find_non_finite()") is not (special is not None):
                raise c.fail(f"{dtype} holding {special!r} flagged wrongly")
            if not all(_same_bits(c.host(g), h) for g, h in zip(grads, hosts, strict=True)):
                raise c.fail("find_non_finite modified a gradient")
    if c.flag(c.find_non_finite([]), "find_non_finite()"):
        raise c.fail("the empty tree was flagged")


def _check_leaf_report(c: _Check) -> None:
    """Where the backend counts non-finite elements per leaf (the optional
    ``non_finite_counts``): each leaf once, at its first path, with its NaN and inf
    counts, for every dtype, nothing modified."""
    if not callable(getattr(c.backend, "non_finite_counts", None)):
        return  # optional: non_finite_leaves then tells the user what to add
    for i, dtype in enumerate(c.subject.dtypes):
        hosts = [_values(dtype, 1.0, 37, seed=500 + i), _values(dtype, 1.0, 5, seed=600)]
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
        if not all(_same_bits(c.host(g), h) for g, h in zip(grads, hosts, strict=True)):
            raise c.fail("non_finite_counts modified a gradient")
    if non_finite_leaves({"none": None}, backend=c.backend) != ():
        raise c.fail("a tree without leaves was reported")


def _check_rejects_bad_leaves(c: _Check) -> None:
    """A bad leaf raises GradientTypeError naming its path, before any leaf is touched."""
    good_host = _values(c.subject.dtypes[-1], 4.0, 8, seed=400)
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
        if not _same_bits(c.host(good), good_host):
            raise c.fail(f"unscale modified a good leaf before refusing a {what}")


def _check_rejects_bad_scales(c: _Check) -> None:
    """0, negative, inf, NaN, subnormal, too large, bool and non-numbers: GradientValueError
    from unscale (before any gradient is touched) and from scale_loss."""
    host = _values(c.subject.dtypes[-1], 1.0, 8, seed=500)
    loss = c.array(np.array(_LOSS, np.float32))
    for scale in _BAD_SCALES:
        grads = [c.array(host)]
        c.raises(
            GradientValueError,
            functools.partial(c.unscale, grads, scale),
            f"unscale at scale={scale!r}",
        )
        if not _same_bits(c.host(grads[0]), host):
            raise c.fail(f"unscale modified a gradient before refusing scale={scale!r}")
        c.raises(
            GradientValueError,
            functools.partial(c.backend.scale_loss, loss, scale),
            f"scale_loss at scale={scale!r}",
        )


def _check_scale_loss(c: _Check) -> None:
    """``loss * f32(scale)``, float32 for float16 and float32 losses."""
    for dtype in (np.float16, np.float32):
        if np.dtype(dtype) not in c.subject.dtypes:  # the Array API has no float16
            continue
        loss = c.array(np.array(_LOSS, dtype))
        c.now(f"scale_loss(<a {np.dtype(dtype)} loss>, {_LOSS_SCALE})")
        out = c.host(c.backend.scale_loss(loss, _LOSS_SCALE))
        if out.dtype != np.float32 or float(out) != _LOSS * _LOSS_SCALE:
            raise c.fail(f"scale_loss({_LOSS} as {dtype.__name__}, {_LOSS_SCALE}) gave {out!r}")


def _check_select(c: _Check) -> None:
    """The chosen tree's values leaf by leaf; mismatched trees raise InvalidArgumentError."""
    old_h: dict[str, Any] = {
        "w": np.array([1.0, -0.0, 3.0], np.float32),
        "b": [np.array(2.0, c.subject.dtypes[0])],
    }
    new_h: dict[str, Any] = {
        "w": np.array([4.0, 5.0, 6.0], np.float32),
        "b": [np.array(7.0, c.subject.dtypes[0])],
    }

    def tree(h: Mapping[str, Any]) -> dict[str, Any]:
        return {"w": c.array(h["w"]), "b": [c.array(h["b"][0])], "n": None}

    dirty = c.find_non_finite([c.array(np.array([np.inf], np.float32))])
    clean = c.find_non_finite([c.array(np.ones(1, np.float32))])
    for flag, skip in ((dirty, True), (clean, False), (True, True), (False, False)):
        old_tree, new_tree = tree(old_h), tree(new_h)
        c.now(f"select(<a {'true' if skip else 'false'} flag>, on_skip, on_step)")
        out = c.backend.select(flag, old_tree, new_tree)
        want = old_h if skip else new_h
        if out["n"] is not None or not _same_bits(c.host(out["w"]), want["w"]):
            raise c.fail(f"select with a {'true' if skip else 'false'} flag chose wrongly")
        if not _same_bits(c.host(out["b"][0]), want["b"][0]):
            raise c.fail(f"select changed a {c.subject.dtypes[0]} leaf")
    old = tree(old_h)
    others = [d for d in c.subject.dtypes if d != np.dtype(np.float32)]
    other_dtype = others[-1] if others else np.dtype(np.int32)
    mismatched = {
        "a missing key": {"w": old["w"], "b": old["b"]},
        "a longer list": {**old, "b": [*old["b"], old["b"][0]]},
        "a leaf for None": {**old, "n": old["w"]},
        "another dtype": {**old, "w": c.array(new_h["w"].astype(other_dtype))},
        "another shape": {**old, "w": c.array(np.ones(4, np.float32))},
    }
    for what, other in mismatched.items():
        c.raises(
            InvalidArgumentError,
            functools.partial(c.backend.select, dirty, old, other),
            f"select of trees with {what}",
        )
    c.raises(GradientTypeError, lambda: c.backend.select(1, old, tree(new_h)), "select(1, ...)")


def _check_flags(c: _Check) -> None:
    """``any`` ORs flags (none: false), ``to_bool`` reads them; others: GradientTypeError."""
    backend = c.backend
    dirty = c.find_non_finite([c.array(np.array([np.nan], np.float32))])
    clean = c.find_non_finite([c.array(np.ones(1, np.float32))])
    c.now("any() of flags")
    cases = {
        "any()": (backend.any(), False),
        "any(clean, dirty)": (backend.any(clean, dirty), True),
        "any(clean, clean)": (backend.any(clean, clean), False),
        "any(True, clean)": (backend.any(True, clean), True),
        "np.bool_(False)": (np.bool_(False), False),
        "True": (True, True),
    }
    for what, (flag, want) in cases.items():
        if c.flag(flag, what) is not want:
            raise c.fail(f"{what} read as {not want}")
    for bad in _BAD_FLAGS:
        c.raises(GradientTypeError, functools.partial(backend.to_bool, bad), f"to_bool({bad!r})")
        c.raises(GradientTypeError, functools.partial(backend.any, clean, bad), f"any(.., {bad!r})")


#: The update check's runs: configs and flag sequences reaching each edge of the rule
#: (growth past float32's largest value, the ceiling, the floor, hysteresis), compared
#: step by step with the host rule; a device state is carried from step to step.
_UPDATE_RUNS: tuple[tuple[dict[str, Any], tuple[bool, ...]], ...] = (
    ({"growth_interval": 1, "hysteresis": 2}, (True, False, True, True, False)),
    ({"init_scale": 2.0**127, "growth_interval": 1}, (False, False, True, False)),
    ({"init_scale": 2.0**126, "growth_interval": 1, "at_max_scale": "clamp"}, (False,) * 3),
    ({"init_scale": 2.0**20, "max_scale": 2.0**21, "growth_interval": 1}, (False, False, True)),
    ({"init_scale": 8.0, "min_scale": 2.0, "growth_interval": 2}, (True,) * 3 + (False,) * 2),
)


def _same_value(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check_update(c: _Check) -> None:
    """Runs of transitions equal to the host rule step by step, at every edge (growth
    past float32's largest value held or clamped, the ceiling, the floor, hysteresis),
    with device or host flags; a refused step raises or is recorded."""
    backend = c.backend
    dirty = c.find_non_finite([c.array(np.array([np.inf], np.float32))])
    clean = c.find_non_finite([c.array(np.ones(1, np.float32))])
    state = init(ScalerConfig(growth_interval=1, hysteresis=2))
    for flag, found in ((dirty, True), (clean, False), (True, True), (False, False)):
        c.now(f"update(state, <a {'device' if flag is not found else 'host'} flag>)")
        got = backend.update(state, flag)
        if not isinstance(got, ScalerState) or got.to_host() != host_update(state, found):
            raise c.fail(f"update with found={found} gave {got!r}")
    for kwargs, founds in _UPDATE_RUNS:
        config = "ScalerConfig(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
        host = device = init(ScalerConfig(**kwargs))
        for step, found in enumerate(founds, 1):
            want = host_update(host, found)
            call = f"update(state, found={found}) at step {step} of {config}"
            c.now(call)
            device = backend.update(device, dirty if found else clean)
            if not isinstance(device, ScalerState):
                raise c.fail(f"{call} returned {device!r}, not a ScalerState")
            fields = {
                n: (float if n in FLOAT_FIELDS else int)(getattr(device, n)) for n in DATA_FIELDS
            }
            wrong = [n for n in DATA_FIELDS if not _same_value(fields[n], getattr(want, n))]
            if wrong:
                raise c.fail(
                    f"{call} gave "
                    + ", ".join(f"{n}={fields[n]!r}" for n in wrong)
                    + ", but the host rule gives "
                    + ", ".join(f"{n}={getattr(want, n)!r}" for n in wrong)
                )
            host = want
    c.now("update(state, <a device flag>) of a collapsing state")
    try:
        failed = backend.update(init(ScalerConfig(init_scale=FLT_MIN)), dirty)
    except ScaleCollapseError:
        pass
    else:
        c.raises(
            ScaleCollapseError, failed.check, "check() after a collapse neither raised nor recorded"
        )
    c.raises(
        InvalidArgumentError,
        lambda: backend.update("not a state", clean),  # type: ignore[arg-type]
        "update of a str",
    )
    c.raises(GradientTypeError, lambda: backend.update(state, 1), "update(state, 1)")


def _exact_norm(arrays: Iterable[np.ndarray]) -> float:
    return math.sqrt(math.fsum(float(v) ** 2 for a in arrays for v in a.astype(np.float64).ravel()))


def _clipped(u: np.ndarray, coef: np.float32) -> np.ndarray:
    """The rules' clipped value of an unscaled leaf: ``u * coef`` in float32 (float64 for
    float64), rounded to the leaf's dtype."""
    if u.dtype == np.dtype(np.float64):
        return np.asarray(u * np.float64(coef))
    return np.asarray(u.astype(np.float32) * coef, dtype=u.dtype)


def _coefficient(norm: float, max_norm: float) -> np.float32:
    """PyTorch's ``clip_grad_norm_`` coefficient in its float32 steps, clamped at 1."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        coef = (np.float32(1.0) / (np.float32(norm) + np.float32(1e-6))) * np.float32(max_norm)
    out: np.float32 = np.float32(min(coef, np.float32(1.0)))
    return out


def _check_norm_and_clip(c: _Check) -> None:
    """``unscale_and_norm`` writes ``unscale``'s bits and a norm within 1e-6 of the exact one
    (non-finite with the flag); ``unscale_and_clip`` stores the rules' clipped values for its
    norm, the coefficient clamped at 1 (a norm below ``max_norm`` changes nothing), writes
    nothing on a skipped step (a planted NaN, or ``reduce`` saying skip), and refuses a bad
    ``max_norm`` before anything changes; on a tree of every dtype, ``measure`` without
    ``write`` writes nothing, and nothing at all on leaves made with ``writable=False``."""
    for i, dtype in enumerate(c.subject.dtypes):
        host = _values(dtype, 1024.0, 37, seed=900 + i)
        want = _unscaled(host, 1024.0)
        exact = _exact_norm([want])
        out, found, norm = c.unscale_and_norm([c.array(host.copy())], 1024.0)
        if not _same_bits(c.host(out[0]), want):
            raise c.fail(f"unscale_and_norm of {dtype} did not store unscale()'s values")
        got = float(c.host(norm))
        if c.flag(found, "unscale_and_norm()") or abs(got - exact) > 1e-6 * exact:
            raise c.fail(
                f"unscale_and_norm of {dtype} gave norm {got!r}, the exact one is {exact!r}"
            )
        out, found, norm = c.unscale_and_clip([c.array(host.copy())], 1024.0, 1.0)
        coef = _coefficient(float(c.host(norm)), 1.0)
        if c.flag(found, "unscale_and_clip()") or not _same_bits(
            c.host(out[0]), _clipped(want, coef)
        ):
            raise c.fail(
                f"unscale_and_clip of {dtype} did not store the unscaled values times {coef}"
            )
        bad = host.copy()
        bad[3] = np.nan
        for reduce, grads in ((None, bad), (lambda f: c.backend.any(f, True), host)):
            given = [c.array(grads.copy())]
            out, found, norm = c.unscale_and_clip(given, 1024.0, 1.0, reduce)
            if not c.flag(found, "unscale_and_clip()"):
                raise c.fail(f"unscale_and_clip of {dtype} did not report the skip")
            if not (_same_bits(c.host(out[0]), grads) and _same_bits(c.host(given[0]), grads)):
                raise c.fail(
                    f"unscale_and_clip of {dtype} wrote to the gradients of a skipped step"
                )
        if math.isfinite(float(c.host(c.unscale_and_norm([c.array(bad.copy())], 1024.0)[2]))):
            raise c.fail(f"unscale_and_norm of {dtype} with a NaN gave a finite norm")
    _check_clip_passes(c)
    given = [c.array(_values(c.subject.dtypes[-1], 2.0, 5, seed=7))]
    before = c.host(given[0])
    bad_norms: tuple[Any, ...] = (0.0, -1.0, float("inf"), float("nan"), True, "1")
    for max_norm in bad_norms:
        c.raises(
            InvalidArgumentError,
            functools.partial(c.unscale_and_clip, given, 2.0, max_norm),
            f"unscale_and_clip(max_norm={max_norm!r})",
            "max_norm",
        )
    if not _same_bits(c.host(given[0]), before):
        raise c.fail("a refused unscale_and_clip changed the gradients")


def _clip_tree(c: _Check, scale: float, nan_at: int | None = None) -> tuple[Any, ...]:
    """A tree of one leaf per dtype and a 0-d leaf: ``(tree, leaves, paths, hosts)``,
    with a NaN in leaf ``nan_at`` when given."""
    dtypes = c.subject.dtypes
    hosts = [_values(d, scale, 29, seed=950 + i) for i, d in enumerate(dtypes)]
    hosts.append(np.array(_values(dtypes[-1], scale, 3, seed=990)[2]))
    if nan_at is not None:
        hosts[nan_at].reshape(-1)[-1] = np.nan
    leaves = [c.array(h.copy()) for h in hosts]
    paths = [f"grads['g'][{i}]" for i in range(len(dtypes))] + ["grads['s'][0]"]
    return {"g": leaves[:-1], "s": (leaves[-1],)}, leaves, paths, hosts


def _tree_leaves(tree: Any) -> list[Any]:
    return [*tree["g"], tree["s"][0]]


def _first_changed(c: _Check, paths: list[str], leaves: list[Any], hosts: list[Any]) -> str:
    """The path of the first leaf whose values are no longer ``hosts``'s ('' for none)."""
    for path, leaf, host in zip(paths, leaves, hosts, strict=True):
        if not _same_bits(c.host(leaf), host):
            return path
    return ""


def _check_clip_passes(c: _Check) -> None:
    """The passes under the clip, called as the core calls them, on a tree of every dtype:
    the read-only pass writes nothing, a skipped step writes nothing, and ``rescale``
    stores the rules' values, the coefficient clamped at 1."""
    backend, scale = c.backend, 1024.0
    tree, leaves, paths, hosts = _clip_tree(c, scale)
    exact = _exact_norm(_unscaled(h, scale) for h in hosts)
    call = "measure(leaves(grads, writable=False), scale, write=False)"
    c.now(call)
    _, found, norm = backend.measure(backend.leaves(tree, writable=False), scale, write=False)
    changed = _first_changed(c, paths, leaves, hosts)
    if changed:
        raise c.fail(
            f"{call} changed {changed}, but on leaves made with writable=False measure "
            f"must write nothing (the read-only pass: fold_clip measures gradients that a "
            f"fused optimizer then reads, still scaled)"
        )
    got = float(c.host(norm))
    if c.flag(found, "measure()") or abs(got - exact) > 1e-6 * exact:
        raise c.fail(f"{call} gave the norm {got!r}, the exact one is {exact!r}")
    for nan_at in (1, None):  # a NaN flags the skip; else the caller's decision does
        tree, leaves, paths, hosts = _clip_tree(c, scale, nan_at)
        call = "measure(leaves(grads, writable=True), scale, write=False)"
        c.now(call)
        prepared = backend.leaves(tree, writable=True)
        _, found, norm = backend.measure(prepared, scale, write=False)
        changed = _first_changed(c, paths, leaves, hosts)
        if changed:
            raise c.fail(
                f"{call} changed {changed} before a skipped step, but without write "
                f"measure must write nothing: a skipped step's gradients keep their scaled "
                f"values"
            )
        skip = found if nan_at is not None else backend.any(found, True)
        call = "rescale(leaves, scale, norm, max_norm=1.0, skip=<a true flag>)"
        c.now(call)
        out = backend.rescale(prepared, scale, norm, 1.0, skip)
        changed = _first_changed(c, paths, leaves, hosts) or _first_changed(
            c, paths, _tree_leaves(out), hosts
        )
        if changed:
            raise c.fail(
                f"{call} changed {changed}, but on a skipped step rescale must write "
                f"nothing: the gradients keep their scaled values"
            )
    for factor in (0.25, 20.0):  # max_norm below the norm, then above it
        tree, leaves, paths, hosts = _clip_tree(c, scale)
        max_norm = float(f32(exact * factor))
        prepared = backend.leaves(tree, writable=True)
        c.now("measure(leaves(grads, writable=True), scale, write=False)")
        _, found, norm = backend.measure(prepared, scale, write=False)
        measured = float(c.host(norm))
        coef = _coefficient(measured, max_norm)
        call = f"rescale(leaves, scale, norm={measured!r}, max_norm={max_norm!r}, skip=False)"
        c.now(call)
        out = backend.rescale(prepared, scale, norm, max_norm, found)
        for path, leaf, host in zip(paths, _tree_leaves(out), hosts, strict=True):
            stored, want = c.host(leaf), _clipped(_unscaled(host, scale), coef)
            if _same_bits(stored, want):
                continue
            shown = _difference(path, stored, want)
            if coef != 1:
                raise c.fail(f"{call} stored {shown} (the unscaled value times {float(coef)!r})")
            raise c.fail(
                f"{call} stored {shown} (the unscaled values times {_ratio(stored, want):.4g}), "
                f"but the coefficient min(1, max_norm / (norm + 1e-6)) is clamped at 1: a "
                f"norm below max_norm must leave unscale()'s values as they are"
            )


def _difference(path: str, got: np.ndarray, want: np.ndarray) -> str:
    """Where ``got`` first differs from ``want``, for a message: ``grads[0][2]=1.5, the
    rules give 0.75``."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return (
            f"{path} as a {got.dtype} array of shape {got.shape}, the rules give a "
            f"{want.dtype} array of shape {want.shape}"
        )
    differs = ~np.array(
        [_same_bits(g, w) for g, w in zip(got.reshape(-1), want.reshape(-1), strict=True)]
    )
    at = tuple(int(i) for i in np.unravel_index(int(np.argmax(differs)), got.shape))
    index = "".join(f"[{i}]" for i in at)
    return f"{path}{index}={got[at]}, the rules give {want[at]}"


def _ratio(got: np.ndarray, want: np.ndarray) -> float:
    """The median of ``got / want`` over the finite, non-zero elements (NaN for none)."""
    g, w = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    keep = np.isfinite(g) & np.isfinite(w) & (w != 0)
    return float(np.median(g[keep] / w[keep])) if keep.any() else math.nan


_CHECKS: Mapping[str, Callable[[_Check], None]] = MappingProxyType(
    {
        "protocol": _check_protocol,
        "namespace": _check_namespace,
        "unscale_values": _check_unscale_values,
        "unscale_trees": _check_unscale_trees,
        "subnormals": _check_subnormals,
        "find_non_finite": _check_find_non_finite,
        "leaf_report": _check_leaf_report,
        "norm_and_clip": _check_norm_and_clip,
        "rejects_bad_leaves": _check_rejects_bad_leaves,
        "rejects_bad_scales": _check_rejects_bad_scales,
        "scale_loss": _check_scale_loss,
        "select": _check_select,
        "flags": _check_flags,
        "update": _check_update,
    }
)

#: What each check asks of a backend, by name, in the order :func:`check_backend` runs them.
BACKEND_CHECKS: Mapping[str, str] = MappingProxyType(
    {name: " ".join((check.__doc__ or "").split()) for name, check in _CHECKS.items()}
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


def _torch_conversions() -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    torch = importlib.import_module("torch")

    def asarray(a: np.ndarray) -> Any:  # bfloat16 through int16: NumPy has no bfloat16 for torch
        a = np.array(a, order="C")
        if a.dtype == _BF16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    def to_numpy(t: Any) -> np.ndarray:
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(_BF16)  # type: ignore[no-any-return]
        return t.numpy()  # type: ignore[no-any-return]

    return asarray, to_numpy


def _mlx_conversions() -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    mx = importlib.import_module("mlx.core")

    def asarray(a: np.ndarray) -> Any:  # mx.array alone turns float64 into float32
        a = np.array(a)
        if a.dtype == _BF16:
            return mx.array(a.view(np.uint16)).view(mx.bfloat16)
        return mx.array(a, dtype=mx.bool_ if a.dtype == np.bool_ else getattr(mx, a.dtype.name))

    def to_numpy(x: Any) -> np.ndarray:
        if x.dtype == mx.bfloat16:
            return np.array(x.view(mx.uint16)).view(_BF16)
        return np.array(x)

    return asarray, to_numpy


def _from_dlpack(x: Any) -> np.ndarray:
    """An Array API array as a NumPy array, through the standard's DLPack interchange
    (NumPy's own scalars, which have none, through ``np.asarray``)."""
    return np.from_dlpack(x) if hasattr(x, "__dlpack__") else np.asarray(x)


def _default_conversions(
    backend: Any,
) -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    name = str(getattr(backend, "name", ""))
    if name == "numpy":
        return np.array, np.asarray
    if name == "jax":
        jnp = importlib.import_module("jax.numpy")
        return jnp.asarray, np.asarray
    if name == "cupy":
        return _cupy_conversions()
    if name == "torch":
        return _torch_conversions()
    if name == "mlx":
        return _mlx_conversions()
    if name == "array_api":  # its namespace's own asarray, and back through DLPack
        return backend.namespace().asarray, _from_dlpack
    raise InvalidArgumentError(
        f"backend {name!r} is not one scaler-core knows how to make arrays for; pass "
        f"asarray= (a NumPy array to one of its arrays) and to_numpy= (back)"
    )


def _round_trips(
    asarray: Callable[[np.ndarray], Any], to_numpy: Callable[[Any], np.ndarray]
) -> tuple[np.dtype[Any], ...]:
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
    flushes_subnormals: bool | None = None,
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
            known for the ``numpy``, ``jax``, ``cupy``, ``torch``, ``mlx`` and
            ``array_api`` backends.
        to_numpy: The way back.
        flushes_subnormals: The library flushes subnormals in arithmetic (see
            :class:`BackendSubject`); by default true for ``jax`` (XLA), false
            otherwise.
        only: Names of the checks to run; all when omitted.

    Returns:
        The names of the checks that ran (all passed).

    Raises:
        BackendContractError: A check failed; the message names it, the case,
            the member and what the rules expect. An exception the contract does
            not document, raised by a member (or by ``asarray``/``to_numpy``), is
            reported so too, naming the call and chained from the original.
        InvalidArgumentError: ``only`` names an unknown check, or ``asarray`` /
            ``to_numpy`` are needed and missing.

    >>> import scaler_core as sc
    >>> check_backend(sc.get_backend("numpy"), only=["unscale_values", "select"])
    ['unscale_values', 'select']
    """
    backend = get_backend(backend)
    names = list(_CHECKS) if only is None else list(only)
    unknown = sorted(set(names) - set(_CHECKS))
    if unknown:
        raise InvalidArgumentError(
            f"only={names!r} names {unknown!r}, but the checks are {list(BACKEND_CHECKS)!r}"
        )
    if asarray is None or to_numpy is None:
        default_in, default_out = _default_conversions(backend)
        asarray = default_in if asarray is None else asarray
        to_numpy = default_out if to_numpy is None else to_numpy
    name = str(getattr(backend, "name", ""))
    flushes = name == "jax" if flushes_subnormals is None else bool(flushes_subnormals)
    subject = BackendSubject(backend, asarray, to_numpy, _round_trips(asarray, to_numpy), flushes)
    if not subject.dtypes:
        raise BackendContractError(
            f"check 'dtypes' failed for backend {subject.name!r}: asarray/to_numpy round-trip "
            f"none of float16, bfloat16, float32, float64"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        for name in names:
            _run(name, subject)
    return names


def _run(name: str, subject: BackendSubject) -> None:
    """Check ``name``; whatever a member raises that the contract does not document
    becomes a :class:`BackendContractError` naming the call (chained from it), with the
    namespace's own fault where it has one (the flag operations and the transition run
    on it, so its faults surface anywhere)."""
    check = _Check(name, subject)
    try:
        _CHECKS[name](check)
    except Exception as exc:
        error = exc if isinstance(exc, BackendContractError) else check.unexpected(exc)
        fault = None if name in ("protocol", "namespace") else _namespace_fault(subject)
        if fault is not None:
            error = BackendContractError(
                f"{error}; namespace() breaks the contract too, which may be why: {fault}"
            )
        if error is exc:
            raise
        raise error from exc


def _namespace_fault(subject: BackendSubject) -> str | None:
    """What the ``namespace`` check finds wrong with the backend's namespace, or None."""
    probe = _Check("namespace", subject)
    try:
        _check_namespace(probe)
    except BackendContractError as exc:
        return str(exc).removeprefix(probe.prefix)
    except Exception as exc:
        return str(probe.unexpected(exc)).removeprefix(probe.prefix)
    return None
