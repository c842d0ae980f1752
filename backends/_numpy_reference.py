"""The NumPy reference backend: clear, correct, in place.

Every faster path (``_numpy.py``, the default NumPy backend) is tested against
it, bit for bit; the fast path also hands it the calls it has no faster
answer for (overlapping arrays).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from scaler_core._backend import Backend
from scaler_core._errors import GradientValueError, InvalidArgumentError
from scaler_core._ops import clip_coefficient
from scaler_core._tree import leaves_with_paths, map_pairs

from ._common import (
    HALF_DTYPES,
    NORM_CHUNK,
    LeafKind,
    bit_counts,
    inv_scale_of,
    norm_of_sums,
)

__all__ = [
    "BACKEND",
    "LEAVES",
    "NumpyReferenceBackend",
    "Prepared",
    "chunk_sums",
    "clip_in_place",
    "numpy_leaves",
    "unscaled_copy",
]

#: NumPy gradient leaves: plain arrays (and memory maps, plain buffers on a file).
LEAVES = LeafKind(
    "numpy",
    np.ndarray,
    "numpy.ndarray",
    "np",
    "np.asarray(x)",
    exact=(np.ndarray, np.memmap),
    subclass_hint="pass a plain view of its data, np.asarray(x) (np.ma.getdata(x) for a "
    "masked array: its masked elements are then checked too)",
)


def numpy_leaves(grads: Any, *, writable: bool) -> list[tuple[str, np.ndarray]]:
    """Every leaf of ``grads``, validated, each array once (by identity).

    Raises:
        GradientTypeError: A leaf is not a NumPy array, or has a dtype other
            than float16, bfloat16, float32 or float64.
        GradientValueError: ``writable`` and a leaf is read-only.
    """
    out: list[tuple[str, np.ndarray]] = []
    seen: set[int] = set()
    for path, leaf in leaves_with_paths(grads):
        LEAVES.check(path, leaf)
        if writable and not leaf.flags.writeable:
            raise GradientValueError(
                f"{path} is read-only, but unscaling works in place; pass a writable array "
                f"(np.array(x) makes a writable copy)"
            )
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append((path, leaf))
    return out


def _all_finite(a: np.ndarray) -> bool:
    return bool(np.isfinite(a).all())


def chunk_sums(u: np.ndarray) -> list[float]:
    """The float64 sums of squares of ``u``'s elements, in memory order, a chunk each.

    Chunks are :data:`NORM_CHUNK` elements; the norm is the exact sum of these sums
    (:func:`norm_of_sums`), so only the order within a chunk is the summing code's.
    """
    flat = np.ravel(u, order="K").astype(np.float64)
    return [float(np.dot(c, c)) for c in np.split(flat, range(NORM_CHUNK, flat.size, NORM_CHUNK))]


def unscaled_copy(g: np.ndarray, inv: float) -> np.ndarray:
    """What :meth:`NumpyReferenceBackend.unscale` would store in ``g``, as a new array."""
    if g.dtype in HALF_DTYPES:
        out: np.ndarray = np.multiply(g, np.float32(inv), dtype=np.float32).astype(g.dtype)
    else:
        out = np.multiply(g, g.dtype.type(inv))
    return out


def clip_in_place(g: np.ndarray, u: np.ndarray, coef: np.float32) -> None:
    """Store ``u * coef`` in ``g``: computed in float32 (float64 for float64), rounded to
    ``g``'s dtype, as PyTorch's ``_foreach_mul_`` of the unscaled gradient does."""
    if g.dtype in HALF_DTYPES:
        g[...] = np.multiply(u, coef, dtype=np.float32)
    else:
        np.multiply(u, g.dtype.type(coef), out=g)


class Prepared:
    """What :meth:`NumpyReferenceBackend.plan` returns: the tree and its work.

    Attributes:
        grads: The gradient tree, returned as it is (NumPy works in place).
        work: The validated arrays, each once (the fast backend's may be a plan of
            them).
        shared: Whether two of the arrays share memory, once the fast backend has
            looked (``None`` before): its measuring and clip passes ask alike.
    """

    __slots__ = ("grads", "shared", "work")

    def __init__(self, grads: Any, work: Any) -> None:
        self.grads, self.work = grads, work
        self.shared: bool | None = None


#: Per dtype and kind, the answer of :func:`_isdtype` (a dict lookup after the first).
_KINDS: dict[tuple[Any, str], bool] = {}


def _isdtype(dtype: Any, kind: str) -> bool:
    key = (dtype, kind)
    try:
        return _KINDS[key]
    except (KeyError, TypeError):  # TypeError: an unhashable "dtype"
        pass
    try:
        d = np.dtype(dtype)
    except TypeError:
        return False
    if kind == "bool":
        out = bool(d == np.dtype(np.bool_))
    elif kind == "real floating":
        out = d.kind == "f" or d in HALF_DTYPES
    else:
        raise InvalidArgumentError(
            f"kind={kind!r}, but the host namespace answers 'bool' and 'real floating'"
        )
    with contextlib.suppress(TypeError):
        _KINDS[key] = out
    return out


class HostNamespace:
    """NumPy as :meth:`scaler_core.Backend.namespace` describes it: flags are
    ``numpy.bool_`` values, decided and advanced on the host."""

    on_host = True
    float64_missing = None
    asarray = staticmethod(np.asarray)
    where = staticmethod(np.where)
    logical_or = staticmethod(np.logical_or)
    map_pairs = staticmethod(map_pairs)
    flag = staticmethod(np.bool_)
    float32, float64, int32 = np.float32, np.float64, np.int32
    isfinite = staticmethod(np.isfinite)
    maximum = staticmethod(np.maximum)
    minimum = staticmethod(np.minimum)

    @staticmethod
    def is_array(value: Any) -> bool:
        return isinstance(value, np.ndarray | np.generic)

    @staticmethod
    def isdtype(dtype: Any, kind: str) -> bool:
        """The Array API's ``isdtype`` for the kinds the core asks (``"bool"``, ``"real
        floating"``), NumPy 1 too; bfloat16 is a real floating dtype."""
        return _isdtype(dtype, kind)

    @staticmethod
    def read(flag: Any) -> bool:
        return bool(flag)


NAMESPACE = HostNamespace()


class NumpyReferenceBackend(Backend):
    """Unscale and detection for NumPy arrays, plainly. The flag is a ``numpy.bool_``."""

    name = "numpy"

    def plan(self, grads: Any, *, writable: bool) -> Prepared:
        """See :meth:`scaler_core.Backend.plan`: the arrays, each once, in a list."""
        return Prepared(grads, [leaf for _, leaf in numpy_leaves(grads, writable=writable)])

    def unscale(self, leaves: Prepared, scale: Any) -> tuple[Any, np.bool_]:
        """See :meth:`scaler_core.Backend.unscale`."""
        inv = 1.0 if scale is None else inv_scale_of(scale)
        found = False
        # Overflow to inf is expected here (it is what the flag reports), not a warning;
        # so is a signalling NaN's 'invalid' in isfinite.
        with np.errstate(over="ignore", invalid="ignore"):
            for g in leaves.work:
                if inv != 1.0:
                    if g.dtype in HALF_DTYPES:
                        g[...] = np.multiply(g, np.float32(inv), dtype=np.float32)
                    else:
                        np.multiply(g, g.dtype.type(inv), out=g)
                if not found and not _all_finite(g):
                    found = True
        return leaves.grads, np.bool_(found)

    def measure(
        self, leaves: Prepared, scale: Any, *, write: bool
    ) -> tuple[Any, np.bool_, np.float32]:
        """See :meth:`scaler_core.Backend.measure`: unscale (or unscaled copies), then
        sum the squares."""
        inv = inv_scale_of(scale)
        if write:
            grads, found = self.unscale(leaves, scale)
            return grads, found, norm_of_sums(s for g in leaves.work for s in chunk_sums(g))
        with np.errstate(over="ignore", invalid="ignore"):
            unscaled = [unscaled_copy(g, inv) for g in leaves.work]
            found = np.bool_(not all(_all_finite(u) for u in unscaled))
            norm = norm_of_sums(s for u in unscaled for s in chunk_sums(u))
        return leaves.grads, found, norm

    def clip(self, leaves: Prepared, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        """See :meth:`scaler_core.Backend.clip`: unscaled copies, times the coefficient."""
        if self.to_bool(skip):
            return leaves.grads
        inv = inv_scale_of(scale)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            coef = clip_coefficient(np, np.float32(norm), max_norm)
            if inv != 1.0 or coef != 1.0:  # else nothing would change: write nothing
                # Every copy before any write: arrays may share memory.
                unscaled = [unscaled_copy(g, inv) for g in leaves.work]
                for g, u in zip(leaves.work, unscaled, strict=True):
                    clip_in_place(g, u, coef)
        return leaves.grads

    def scale_loss(self, loss: Any, scale: Any) -> Any:
        """See :meth:`scaler_core.Backend.scale_loss`."""
        inv_scale_of(scale)  # validates scale
        return np.multiply(loss, np.float32(scale))

    def namespace(self, *values: Any) -> HostNamespace:
        """See :meth:`scaler_core.Backend.namespace`: NumPy, on the host."""
        return NAMESPACE

    def non_finite_counts(self, grads: Any) -> list[tuple[str, int, int]]:
        """See :class:`scaler_core.Backend` (``non_finite_counts``): counted on the bits
        (:func:`bit_counts`), read-only arrays accepted, nothing modified."""
        out = []
        for path, leaf in numpy_leaves(grads, writable=False):
            nan, inf = bit_counts(np, leaf)
            out.append((path, int(nan), int(inf)))
        return out


BACKEND = NumpyReferenceBackend()
