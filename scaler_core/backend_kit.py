"""What a backend author calls: the core's own tree walk, inverse scale and clip coefficient.

A backend (see :class:`scaler_core.Backend` and ``docs/reference.md``) writes its
library's passes; the rules those passes share are written once, in the core, and
served here, so a backend restates none of them and cannot drift from the others:

- :func:`leaves_with_paths`: each leaf of a gradient tree (nested dicts, lists,
  tuples and NamedTuples; ``None`` skipped) with the path messages name it by;
- :func:`map_pairs`: two trees paired leaf by leaf, what a namespace's
  ``map_pairs`` is for nested containers;
- :func:`inverse_scale`: ``f32(1 / f64(scale))`` on the backend's namespace, a host
  scale checked, a device scale failing closed (NaN) where it is not a positive
  normal float32;
- :func:`clip_coefficient`: PyTorch's ``clip_grad_norm_`` coefficient, clamped at 1,
  computed in the norm's library on its device;
- :func:`float_leaves`: a tree's distinct leaves, each checked to be a floating array
  of the namespace's library, with the message every backend gives;
- :func:`state_on`: a state whose data fields are 0-d arrays of a namespace's library
  (what each device integration's ``to_device`` is);
- :class:`DeviceNamespace`: every member of a device namespace, made from a few of the
  library's own functions (and :class:`CallableDType`, the dtypes the core calls).

>>> import numpy as np
>>> from scaler_core import get_backend
>>> xp = get_backend("numpy").namespace()
>>> [path for path, _ in leaves_with_paths({"w": np.ones(2), "b": [None, np.ones(1)]})]
["grads['w']", "grads['b'][1]"]
>>> float(inverse_scale(xp, 1024.0)), float(clip_coefficient(xp, np.float32(0.5), 1.0))
(0.0009765625, 1.0)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._coerce import describe
from ._errors import GradientTypeError, InvalidArgumentError
from ._ops import clip_coefficient, inverse_scale
from ._state import ScalerState, convert_fields
from ._tree import leaves_with_paths, map_pairs

__all__ = [
    "CallableDType",
    "DeviceNamespace",
    "clip_coefficient",
    "float_leaves",
    "inverse_scale",
    "leaves_with_paths",
    "map_pairs",
    "state_on",
]


def state_on(xp: Any, state: ScalerState) -> ScalerState:
    """``state`` with a 0-d float32 scale and 0-d int32 counters, arrays of the namespace
    ``xp``'s library (``xp.asarray(value, dtype=xp.float32)`` and ``xp.int32``), so the
    transition on that library's flags keeps it there with no host synchronisation.

    Nothing is read back and nothing is checked: a recorded failure moves with the
    state and raises at the first host-side look. With spike skipping off, the window
    statistics stay Python numbers (they never change then).

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`~scaler_core.ScalerState`.

    >>> import scaler_core as sc
    >>> state = state_on(sc.get_backend("numpy").namespace(), sc.init())
    >>> type(state.scale).__name__, state.scale.dtype.name, state.growth_tracker.dtype.name
    ('ndarray', 'float32', 'int32')
    """
    return convert_fields(
        state,
        lambda value: xp.asarray(value, dtype=xp.float32),
        lambda value: xp.asarray(value, dtype=xp.int32),
        host_static=True,
    )


def float_leaves(grads: Any, xp: Any, root: str = "grads") -> list[Any]:
    """The distinct leaves of ``grads`` (by identity, in tree order), after checking that
    every leaf is an array of the namespace ``xp``'s library (``xp.is_array``) with a
    floating dtype (``xp.isdtype(dtype, "real floating")``), before any is touched.

    Raises:
        GradientTypeError: A leaf is not; the message names its path.

    >>> import numpy as np
    >>> from scaler_core import get_backend
    >>> w = np.ones(2, np.float32)
    >>> len(float_leaves({"w": w, "tied": w}, get_backend("numpy").namespace()))
    1
    """
    distinct: dict[int, Any] = {}
    for path, leaf in leaves_with_paths(grads, root):
        if not (xp.is_array(leaf) and xp.isdtype(getattr(leaf, "dtype", None), "real floating")):
            raise GradientTypeError(
                f"{path} is {describe(leaf)}, but gradients must be float16, bfloat16, float32 "
                f"or float64 arrays of the backend's library; convert or cast it, or leave it "
                f"out of the tree"
            )
        distinct.setdefault(id(leaf), leaf)
    return list(distinct.values())


class CallableDType:
    """A library's dtype that is also callable, as a namespace's ``float32``, ``float64``
    and ``int32`` must be: ``float32(x)`` is ``x`` as a 0-d value of that dtype, made by
    ``make(x, dtype)`` on the device. ``dtype`` is the library's own.

    >>> import numpy as np
    >>> f32 = CallableDType(np.float32, lambda x, dtype: np.asarray(x, dtype))
    >>> f32(0.1).dtype, f32.dtype is np.float32
    (dtype('float32'), True)
    """

    __slots__ = ("dtype", "make")

    def __init__(self, dtype: Any, make: Callable[[Any, Any], Any]) -> None:
        self.dtype, self.make = dtype, make

    def __call__(self, value: Any) -> Any:
        return self.make(value, self.dtype)

    def __repr__(self) -> str:
        return f"CallableDType({self.dtype!r})"


class DeviceNamespace:
    """A device namespace (what :meth:`scaler_core.Backend.namespace` returns) made from
    a few of a library's own functions, for a library without the Array API standard's
    ``__array_namespace__`` (one with it needs no backend: ``array_api`` serves it).

    Every member the core reads is served: ``on_host`` (``False``), ``float64_missing``
    (``None``), ``flag``, ``read``, ``is_array``, ``logical_or``, ``where`` (a Python
    number is filled in with the other argument's dtype first), ``map_pairs``,
    ``asarray``, the callable dtypes ``float32``, ``float64`` and ``int32``,
    ``isdtype``, ``isfinite``, ``maximum`` and ``minimum`` (``b`` where it is below
    ``a``, else ``a``: a NaN ``a`` keeps its bits, as PyTorch's clamp keeps them).

    Args:
        library: The library's module: ``where``, ``logical_or``, ``isfinite`` and
            ``maximum`` are taken from it unless given.
        array_type: The type (or types) of its arrays.
        full: ``full(value, dtype)``: a 0-d array holding the Python number or bool
            ``value``, of the library's ``dtype``, made on the device.
        floats: Every floating dtype of the library (what ``isdtype`` calls ``"real
            floating"``: a norm's).
        dtypes: The library's ``float32``, ``float64``, ``int32`` and ``bool`` dtypes,
            by those names (default: the library's attributes of those names).
        members: Members to serve instead (``where=``, ``read=``,
            ``float64_missing=``...), each as the namespace table of the reference
            page says; and ``astype(array, dtype)`` (default: ``array.astype(dtype)``).

    >>> import numpy as np
    >>> xp = DeviceNamespace(
    ...     np,
    ...     np.ndarray,
    ...     full=lambda v, d: np.full((), v, d),
    ...     floats=(np.dtype("float32"), np.dtype("float64")),
    ...     dtypes={n: np.dtype(n) for n in ("float32", "float64", "int32", "bool")},
    ... )
    >>> xp.where(xp.flag(True), 5, xp.asarray(7, dtype=xp.int32)).item(), xp.read(xp.flag(False))
    (5, False)
    """

    on_host = False
    float64_missing: str | None = None
    map_pairs = staticmethod(map_pairs)

    def __init__(
        self,
        library: Any,
        array_type: type | tuple[type, ...],
        *,
        full: Callable[[Any, Any], Any],
        floats: Iterable[Any],
        dtypes: Mapping[str, Any] | None = None,
        **members: Any,
    ) -> None:
        names = ("float32", "float64", "int32", "bool")
        if dtypes is None:
            dtypes = {n: getattr(library, n) for n in names if hasattr(library, n)}
        missing = sorted(set(names) - set(dtypes))
        if missing:
            raise InvalidArgumentError(
                f"dtypes={dict(dtypes)!r} lacks {missing}; pass the library's float32, "
                f"float64, int32 and bool dtypes by those names"
            )
        self.array_type, self.full, self.bool = array_type, full, dtypes["bool"]
        self.floats = tuple(floats)
        self.astype = members.pop("astype", lambda array, dtype: array.astype(dtype))
        self.float32, self.float64, self.int32 = (
            CallableDType(dtypes[n], full) for n in ("float32", "float64", "int32")
        )
        self._where = members.pop("where", library.where)
        for name in ("logical_or", "isfinite", "maximum"):
            setattr(self, name, members.pop(name, getattr(library, name)))
        for name, member in members.items():
            setattr(self, name, member)

    def is_array(self, value: Any) -> bool:
        return isinstance(value, self.array_type)

    def flag(self, value: bool) -> Any:
        return self.full(bool(value), self.bool)

    def read(self, flag: Any) -> bool:
        return bool(flag)

    def isdtype(self, dtype: Any, kind: str) -> bool:
        if kind == "bool":
            return bool(dtype == self.bool)
        if kind == "real floating":
            return dtype in self.floats
        raise InvalidArgumentError(f"kind={kind!r}, but the core asks 'bool' or 'real floating'")

    def asarray(self, value: Any, dtype: Any = None) -> Any:
        dt = self.bool if dtype is bool else getattr(dtype, "dtype", dtype)
        if self.is_array(value):
            return value if dt is None or value.dtype == dt else self.astype(value, dt)
        if dt is None:
            dt = self.bool if isinstance(value, bool) else self.float32.dtype
            dt = self.int32.dtype if type(value) is int else dt
        return self.full(value, dt)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        like = b if self.is_array(b) else a
        if self.is_array(like):
            a, b = (v if self.is_array(v) else self.full(v, like.dtype) for v in (a, b))
        return self._where(cond, a, b)

    def minimum(self, a: Any, b: Any) -> Any:
        return self.where(b < a, b, a)
