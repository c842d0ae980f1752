"""The Array API backend: any array library that implements the Array API standard.

Written against the standard alone (https://data-apis.org/array-api/latest/): a
leaf's library is ``x.__array_namespace__()``, or, for arrays without that method
(torch tensors, NumPy before 2.0), ``array_api_compat.array_namespace(x)`` where
array-api-compat is installed. Every leaf of a call must come from one namespace.
The registry sends here any array whose type has ``__array_namespace__`` and that no
other backend claims; ``get_backend("array_api")`` also takes arrays that a backend
of their own serves (NumPy's, torch's through array-api-compat), and
``ArrayApiBackend(xp)`` is bound to one namespace ``xp``, for calls with no arrays.

Functional, like the JAX backend: the standard does not promise in-place writes, so
every pass returns a new tree and never writes to a gradient (``writable`` asks
nothing). The arithmetic is the rules': ``inv = f32(1 / f64(scale))``
(:func:`~scaler_core.backend_kit.inverse_scale`: a host scale checked, a device scale
failing closed), float16 and bfloat16 (where the library has them) computed in
float32 and rounded back, float64 in float64. The flag is a 0-d boolean array: true
where any element as stored after unscaling is NaN or +-inf. The norm's sum of
squares is accumulated in float64 where the leaves' device has float64 (then within
one float32 ulp of the exact norm), else in float32. In float64 no square of a
float16, bfloat16 or float32 value overflows, nor does their sum: that sum is NaN
or inf exactly when a value is, so it is the flag of those leaves too, and the
measuring pass reads each of them once.

Every array made here lives on the leaves' device (``device=`` of the standard's
creation functions; a leaf on another device gets its factors moved there with
``to_device``, and its partial results are brought to the first leaf's device).
Nothing is read back to the host but in :meth:`ArrayApiNamespace.read` and
:meth:`ArrayApiBackend.non_finite_counts`.

>>> import numpy as np
>>> import scaler_core as sc
>>> grads = {"w": np.array([512.0, -2048.0], np.float16)}
>>> out, found = sc.unscale(grads, 1024.0, backend="array_api")
>>> out["w"].tolist(), bool(found), grads["w"].tolist()
([0.5, -2.0], False, [512.0, -2048.0])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import numpy as np

from scaler_core import _registry
from scaler_core._backend import Backend
from scaler_core._coerce import describe
from scaler_core._errors import GradientTypeError, InvalidArgumentError
from scaler_core._ops import as_flag
from scaler_core._tree import first_of_each
from scaler_core.backend_kit import clip_coefficient, inverse_scale, leaves_with_paths, map_pairs

from ._common import ACCEPTED

__all__ = [
    "BACKEND",
    "ArrayApiBackend",
    "ArrayApiNamespace",
    "Prepared",
    "array_namespace_of",
    "host_namespace",
    "namespace_on",
]


# ---------------------------------------------------------------- arrays and devices
@functools.cache
def _compat() -> Any:
    """array-api-compat, or ``None`` where it is not installed (imported on first need)."""
    try:
        import array_api_compat  # noqa: PLC0415 - optional: only for arrays without the method
    except ImportError:
        return None
    return array_api_compat


def array_namespace_of(value: object) -> Any:
    """The Array API namespace of ``value``, or ``None`` where it is no such array.

    ``value.__array_namespace__()`` where its type has that method; else, where
    array-api-compat is installed and takes it, ``array_api_compat.array_namespace``.

    >>> import numpy as np
    >>> array_namespace_of(np.ones(2)) is np, array_namespace_of(1.0)
    (True, None)
    """
    kind = type(value)
    if kind.__module__ == "builtins":
        return None
    if callable(getattr(kind, "__array_namespace__", None)):
        return value.__array_namespace__()  # type: ignore[attr-defined]
    compat = _compat()
    if compat is not None and compat.is_array_api_obj(value):
        return compat.array_namespace(value)
    return None


def _library(xp: Any) -> str:
    return str(getattr(xp, "__name__", type(xp).__qualname__))


def _device(x: Any) -> Any:
    """``x.device``, the standard's attribute (array-api-compat's ``device`` where absent)."""
    try:
        return x.device
    except AttributeError:
        return _compat().device(x)


def _moved(x: Any, device: Any) -> Any:
    """``x`` on ``device`` (itself where it is there already, or ``device`` is ``None``)."""
    if device is None or _device(x) == device:
        return x
    to_device = getattr(x, "to_device", None)
    if callable(to_device):
        return to_device(device)
    return _compat().to_device(x, device)


# ---------------------------------------------------------------- the namespace
class _DType:
    """A dtype of the library, callable as the core calls it: ``float32(x)`` is a 0-d
    value made on the namespace's device."""

    __slots__ = ("dtype", "ns")

    def __init__(self, ns: ArrayApiNamespace, dtype: Any) -> None:
        self.ns, self.dtype = ns, dtype

    def __call__(self, value: Any) -> Any:
        return self.ns.asarray(value, dtype=self)

    def __repr__(self) -> str:
        return f"<{_library(self.ns.xp)} {self.dtype} on {self.ns.device}>"


def _float64_missing(xp: Any, device: Any) -> str | None:
    """``None`` where ``device`` has float64, as the standard's inspection API says (a
    library without that API: where its namespace has ``float64``); else the fix."""
    info = getattr(xp, "__array_namespace_info__", None)
    if info is None:
        has = getattr(xp, "float64", None) is not None
    else:
        has = "float64" in info().dtypes(device=device, kind="real floating")
    if has:
        return None
    return f"run the step on a device of {_library(xp)} that has float64 ({device} has none)"


def _half_dtypes(xp: Any) -> tuple[Any, ...]:
    """The library's float16 and bfloat16, those its namespace has (the standard has neither)."""
    halves = (getattr(xp, "float16", None), getattr(xp, "bfloat16", None))
    return tuple(d for d in halves if d is not None)


class ArrayApiNamespace:
    """A library's own Array API namespace, on one device, with what the standard lacks
    (see :meth:`scaler_core.Backend.namespace`): ``on_host``, ``float64_missing``,
    ``flag``, ``read``, ``is_array``, ``map_pairs``, callable ``float32``, ``float64``
    and ``int32``, and an ``asarray`` that takes those and Python's ``bool`` as dtypes
    and makes its arrays on the device. Every other member (``where``, ``logical_or``,
    ``isfinite``, ``isdtype``, ``maximum``, ``minimum``...) is the library's own.

    Attributes:
        xp: The library's namespace.
        device: The device its arrays are made on (``None``: the library's default).
        half: The library's float16 and bfloat16, those it has: computed in float32.
    """

    on_host = False
    map_pairs = staticmethod(map_pairs)

    def __init__(self, xp: Any, device: Any = None) -> None:
        self.xp, self.device = xp, device
        self.float32 = _DType(self, xp.float32)
        self.float64 = _DType(self, getattr(xp, "float64", None))
        self.int32 = _DType(self, xp.int32)
        self.float64_missing = _float64_missing(xp, device)
        self.half = _half_dtypes(xp)

    def __getattr__(self, name: str) -> Any:
        if name == "xp":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.xp, name)

    def __repr__(self) -> str:
        return f"ArrayApiNamespace({_library(self.xp)}, device={self.device!r})"

    def _dtype(self, dtype: Any) -> Any:
        if isinstance(dtype, _DType):
            return dtype.dtype
        return self.xp.bool if dtype is bool else dtype

    def asarray(self, value: Any, dtype: Any = None) -> Any:
        """An array of the library on the device: one of its arrays (cast where ``dtype``
        differs, moved where it lives elsewhere), a 0-d one filled with a Python number,
        anything else (a NumPy value) through the library's ``asarray``."""
        dt = self._dtype(dtype)
        if self.is_array(value):
            if dt is not None and value.dtype != dt:
                value = self.xp.astype(value, dt)
            return _moved(value, self.device)
        if type(value) in (bool, int, float):  # a Python number: filled on the device
            return self.xp.full((), value, dtype=dt, device=self.device)
        return self.xp.asarray(value, dtype=dt, device=self.device)

    def flag(self, value: bool) -> Any:
        """A 0-d boolean array holding ``value``, filled on the device."""
        return self.xp.full((), bool(value), dtype=self.xp.bool, device=self.device)

    def is_array(self, value: Any) -> bool:
        return array_namespace_of(value) is self.xp

    @staticmethod
    def read(flag: Any) -> bool:
        return bool(flag)


class _HostNamespace(ArrayApiNamespace):
    """NumPy's Array API namespace, deciding on the host: flags are ``numpy.bool_``."""

    on_host = True

    def flag(self, value: bool) -> Any:
        return self.xp.bool(value)

    def asarray(self, value: Any, dtype: Any = None) -> Any:
        """As :meth:`ArrayApiNamespace.asarray`, but a device library's array comes back
        as it is: a host select reads its shape and dtype, and copies nothing."""
        if dtype is None and not _registry.is_host(value) and array_namespace_of(value) is not None:
            return value
        return super().asarray(value, dtype)


@functools.cache
def host_namespace() -> ArrayApiNamespace:
    """Where the registered backend has no device value to go by (no leaves, host flags):
    NumPy's Array API namespace on the host, as host values go with every library."""
    return _HostNamespace(array_namespace_of(np.empty(0)), "cpu")


_NAMESPACES: dict[tuple[int, Any], ArrayApiNamespace] = {}


def namespace_on(xp: Any, device: Any = None) -> ArrayApiNamespace:
    """The :class:`ArrayApiNamespace` of ``xp`` on ``device`` (kept per namespace and
    hashable device)."""
    try:
        key = (id(xp), device)
        hash(key)
    except TypeError:  # an unhashable device: made each time
        return ArrayApiNamespace(xp, device)
    ns = _NAMESPACES.get(key)
    if ns is None:
        ns = _NAMESPACES.setdefault(key, ArrayApiNamespace(xp, device))
    return ns


# ---------------------------------------------------------------- the passes
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _quiet(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """``method`` under ``np.errstate(all="ignore")``: NumPy, and array-api-strict, which
    computes with it, warn where a value becomes inf or NaN (an unscale that overflows,
    a skipped step's ``inf * 0`` that ``where`` then drops), values the flag reports.
    NumPy's setting alone: no other library reads it."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with np.errstate(all="ignore"):
            return method(*args, **kwargs)

    return run


def _times(ns: ArrayApiNamespace, g: Any, factor: Any) -> Any:
    """``g * factor`` (a 0-d float32) rounded to ``g``'s dtype on ``g``'s device: half
    types computed in float32, float64 in float64."""
    xp, factor = ns.xp, _moved(factor, _device(g))
    if g.dtype in ns.half:
        return xp.astype(xp.astype(g, xp.float32) * factor, g.dtype)
    if g.dtype == xp.float64:
        return g * xp.astype(factor, xp.float64)
    return g * factor


def _non_finite(ns: ArrayApiNamespace, ys: Sequence[Any]) -> Any:
    """Whether any element of ``ys`` is NaN or +-inf: a flag on ``ns``'s device."""
    xp, found = ns.xp, ns.flag(False)
    for y in ys:
        found = found | _moved(xp.any(~xp.isfinite(y)), ns.device)
    return found


def _flag_and_norm(ns: ArrayApiNamespace, ys: Sequence[Any]) -> tuple[Any, Any]:
    """The flag and the float32 L2 norm of the unscaled leaves ``ys``, on ``ns``'s device.

    Squares are summed in float64 where the device has it; there the sum over the
    float16, bfloat16 and float32 leaves is also their flag (see the module docstring).
    """
    xp = ns.xp
    wide = xp.float32 if ns.float64_missing else xp.float64
    narrow = xp.zeros((), dtype=wide, device=ns.device)
    total, checked = xp.zeros((), dtype=wide, device=ns.device), []
    for y in ys:
        w = xp.astype(y, wide, copy=False)
        square_sum = _moved(xp.sum(w * w), ns.device)
        if wide == xp.float64 and y.dtype != xp.float64:
            narrow = narrow + square_sum
        else:  # its squares may overflow with finite values: checked on its own
            total = total + square_sum
            checked.append(y)
    found = ~xp.isfinite(narrow) | _non_finite(ns, checked)
    return found, xp.astype(xp.sqrt(narrow + total), xp.float32)


class Prepared:
    """What :meth:`ArrayApiBackend.plan` returns: the tree, its leaves validated.

    Attributes:
        grads: The gradient tree as given (returned as it is where nothing changes).
        paths: Each distinct leaf's first path.
        arrays: The distinct leaves (by identity), in tree order.
        ns: The namespace on the first leaf's device (the backend's own without leaves).
        unscaled: ``(scale, unscaled leaves)`` of the last unscale, which the clip pass
            after the measuring pass reuses.
    """

    __slots__ = ("arrays", "grads", "ns", "paths", "unscaled")

    def __init__(
        self, grads: Any, paths: list[str], arrays: list[Any], ns: ArrayApiNamespace
    ) -> None:
        self.grads, self.paths, self.arrays, self.ns = grads, paths, arrays, ns
        self.unscaled: tuple[Any, list[Any]] | None = None

    def tree(self, out: Sequence[Any]) -> Any:
        """A tree of ``grads``'s structure holding ``out[i]`` where ``arrays[i]`` was (an
        array at several paths gets one result at each)."""
        if out is self.arrays:
            return self.grads
        new = {id(a): y for a, y in zip(self.arrays, out, strict=True)}
        return map_pairs(lambda _path, _a, b: new[id(b)], self.grads, self.grads, root="grads")


class ArrayApiBackend(Backend):
    """Unscale, detection, norm and clip for the arrays of any Array API library.

    Functional: every pass returns a new tree; the flag is a 0-d boolean array and the
    norm a 0-d float32 array of the leaves' library, on their device. The clip pass
    selects with the standard's ``where`` on the skip flag, never reading it back.

    Args:
        xp: An Array API namespace (``x.__array_namespace__()``) to serve alone, and
            to make flags with where a call has no array; ``None`` (the registered
            backend) serves every library, and decides on the host where a call has no
            device value (:func:`host_namespace`).
        device: The device of ``xp`` for calls with no array (``None``: its default).

    Raises:
        InvalidArgumentError: ``xp`` is not an Array API namespace.
    """

    name = "array_api"

    def __init__(self, xp: Any = None, device: Any = None) -> None:
        if xp is not None and not all(
            callable(getattr(xp, m, None)) for m in ("asarray", "full", "isdtype")
        ):
            raise InvalidArgumentError(
                f"xp={xp!r}, but it must be an Array API namespace (with asarray, full and "
                f"isdtype); pass x.__array_namespace__() of one of your arrays, or None"
            )
        self._xp, self._device = xp, device

    def __repr__(self) -> str:
        if self._xp is None:
            return "ArrayApiBackend()"
        return f"ArrayApiBackend({_library(self._xp)}, device={self._device!r})"

    def _default(self) -> ArrayApiNamespace:
        return host_namespace() if self._xp is None else namespace_on(self._xp, self._device)

    def _serves(self, xp: Any) -> bool:
        return xp is not None and (self._xp is None or xp is self._xp)

    def plan(self, grads: Any, *, writable: bool) -> Prepared:
        """See :meth:`scaler_core.Backend.plan`: every leaf checked (an array of one
        Array API namespace, of float16, bfloat16, float32 or float64), each array once;
        ``writable`` asks nothing (nothing is written)."""
        xp, first = self._xp, ""
        paths, arrays = [], []
        for path, leaf in first_of_each(leaves_with_paths(grads)):
            own = array_namespace_of(leaf)
            if own is None:
                kind = type(leaf)
                raise GradientTypeError(
                    f"{path} is a {kind.__module__}.{kind.__qualname__}, but the array_api "
                    f"backend needs arrays of an Array API library (with __array_namespace__, "
                    f"or served by array-api-compat) of dtype {ACCEPTED}; convert it with "
                    f"xp.asarray(x)"
                )
            if xp is None:
                xp, first = own, path
            elif own is not xp:
                other = (
                    f"{first} is a {_library(xp)} array"
                    if first
                    else f"{self!r} serves {_library(xp)} arrays alone"
                )
                raise GradientTypeError(
                    f"{path} is a {_library(own)} array but {other}; one call takes arrays of "
                    f"one library: convert them, or make one call per library"
                )
            accepted = (xp.float32, getattr(xp, "float64", None), *_half_dtypes(xp))
            if leaf.dtype not in accepted:
                raise GradientTypeError(
                    f"{path} has dtype {leaf.dtype}, but gradients must be {ACCEPTED}; cast it "
                    f"with xp.astype(x, xp.float32) or leave it out of the tree"
                )
            paths.append(path)
            arrays.append(leaf)
        ns = namespace_on(xp, _device(arrays[0])) if arrays else self._default()
        return Prepared(grads, paths, arrays, ns)

    def _unscaled(self, leaves: Prepared, scale: Any) -> list[Any]:
        """The unscaled leaves (the given ones for a host scale of 1), once per scale."""
        kept = leaves.unscaled
        if kept is not None and kept[0] is scale:
            return kept[1]
        ns = leaves.ns
        inv = inverse_scale(ns, scale)  # a host scale checked here, before any work
        if not ns.is_array(scale) and float(scale) == 1.0:
            out = leaves.arrays
        else:
            out = [_times(ns, g, inv) for g in leaves.arrays]
        leaves.unscaled = (scale, out)
        return out

    @_quiet
    def unscale(self, leaves: Prepared, scale: Any) -> tuple[Any, Any]:
        """See :meth:`scaler_core.Backend.unscale`: a new tree; with ``scale`` ``None``
        (or a host scale of 1), detection alone and the tree as given."""
        if scale is None:
            return leaves.grads, _non_finite(leaves.ns, leaves.arrays)
        out = self._unscaled(leaves, scale)
        return leaves.tree(out), _non_finite(leaves.ns, out)

    @_quiet
    def measure(self, leaves: Prepared, scale: Any, *, write: bool) -> tuple[Any, Any, Any]:
        """See :meth:`scaler_core.Backend.measure`: with ``write`` a new tree of the
        unscaled leaves, without it the tree as given; the flag and norm of the unscaled
        values either way."""
        out = self._unscaled(leaves, scale)
        found, norm = _flag_and_norm(leaves.ns, out)
        return (leaves.tree(out) if write else leaves.grads), found, norm

    @_quiet
    def clip(self, leaves: Prepared, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        """See :meth:`scaler_core.Backend.clip`: a new tree, leaf by leaf the given leaf
        where ``skip`` (decided on the device, with ``where``), else the unscaled leaf times
        the clip coefficient."""
        ns = leaves.ns
        flag = as_flag(ns, skip, "skip")
        out = self._unscaled(leaves, scale)
        if not ns.is_array(norm):
            norm = ns.asarray(norm, dtype=ns.float32)
        coef = clip_coefficient(ns, norm, max_norm)
        clipped = [
            ns.xp.where(_moved(flag, _device(g)), g, _times(ns, u, coef))
            for g, u in zip(leaves.arrays, out, strict=True)
        ]
        return leaves.tree(clipped)

    @_quiet
    def scale_loss(self, loss: Any, scale: Any) -> Any:
        """See :meth:`scaler_core.Backend.scale_loss`: ``loss * f32(scale)`` on the loss's
        device, float32 for float16, bfloat16 and float32 losses; a device scale that is
        not a positive normal float32 gives NaN.

        Raises:
            GradientTypeError: ``loss`` is not an array this backend serves.
            GradientValueError: A host scale that is not a positive normal float32.
        """
        xp = array_namespace_of(loss)
        if not self._serves(xp):
            raise GradientTypeError(
                f"loss={describe(loss)}, but the array_api backend scales an array of an Array "
                f"API library{'' if self._xp is None else ' ' + _library(self._xp)}; pass the "
                f"loss the model computed"
            )
        ns = namespace_on(xp, _device(loss))
        inv = inverse_scale(ns, scale)  # checks the scale; NaN for a bad device one
        if ns.is_array(scale):
            s = xp.where(xp.isnan(inv), inv, ns.asarray(scale, dtype=ns.float32))
        else:
            s = ns.float32(float(scale))
        if loss.dtype in ns.half:
            loss = xp.astype(loss, xp.float32)
        return loss * s

    def namespace(self, *values: Any) -> ArrayApiNamespace:
        """See :meth:`scaler_core.Backend.namespace`: the namespace of the first of
        ``values`` that is an array this backend serves, on its device; without one, the
        bound namespace on its device. The registered backend serves every library but
        takes no host value (NumPy's: they go with every library) for one: without a
        device value it answers with :func:`host_namespace`, and decides on the host."""
        for value in values:
            xp = array_namespace_of(value)
            if self._serves(xp) and (self._xp is not None or not _registry.is_host(value)):
                return namespace_on(xp, _device(value))
        return self._default()

    def non_finite_counts(self, grads: Any) -> list[tuple[str, int, int]]:
        """See :class:`scaler_core.Backend` (``non_finite_counts``): each distinct leaf's
        NaN and +-inf counts (``count_nonzero``), read back as ints.

        Raises:
            GradientTypeError: As :meth:`plan`.
        """
        prepared = self.plan(grads, writable=False)
        xp = prepared.ns.xp
        return [
            (path, int(xp.count_nonzero(xp.isnan(g))), int(xp.count_nonzero(xp.isinf(g))))
            for path, g in zip(prepared.paths, prepared.arrays, strict=True)
        ]


BACKEND = ArrayApiBackend()
