"""What every backend's passes share: the accepted dtypes, the scale and leaf checks.

One statement of each rule, so the backends cannot drift apart: the same bad
leaf or scale gives the same error class and message on every backend. (Flags and
``select`` are checked once, in the core: ``scaler_core._ops``.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from scaler_core._coerce import host_inverse_scale
from scaler_core._errors import GradientTypeError

__all__ = [
    "ACCEPTED",
    "FLOAT_DTYPES",
    "HALF_DTYPES",
    "NORM_CHUNK",
    "LeafKind",
    "bit_counts",
    "inv_scale_of",
    "is_bfloat16",
    "norm_of_sums",
]


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16, NumPy's bfloat16.

    ml_dtypes is imported only for a dtype of that name: its import takes over a
    second, and an array of its bfloat16 exists only once something imported it.

    >>> is_bfloat16(np.dtype(np.float16))
    False
    """
    if dtype.name != "bfloat16":
        return False
    import ml_dtypes  # noqa: PLC0415 - already imported: its dtype is in use

    return bool(dtype == np.dtype(ml_dtypes.bfloat16))


class _Dtypes:
    """A set of dtypes for ``in``: NumPy's own ones listed, bfloat16 recognised by
    :func:`is_bfloat16` (without importing ml_dtypes unless it is in use). Each
    dtype's answer is kept, so a test costs a dict lookup, as a set's would."""

    __slots__ = ("_bfloat16", "_known", "_native")

    def __init__(self, native: tuple[np.dtype[Any], ...], *, bfloat16: bool) -> None:
        self._native = native
        self._bfloat16 = bfloat16
        self._known: dict[np.dtype[Any], bool] = dict.fromkeys(native, True)

    def __contains__(self, dtype: object) -> bool:
        if not isinstance(dtype, np.dtype):
            return False
        known = self._known.get(dtype)
        if known is None:
            known = self._known[dtype] = dtype in self._native or (
                self._bfloat16 and is_bfloat16(dtype)
            )
        return known

    def __repr__(self) -> str:
        names = [d.name for d in self._native] + ["bfloat16"] * self._bfloat16
        return f"<dtypes {', '.join(sorted(names))}>"


#: The gradient dtypes every backend accepts.
FLOAT_DTYPES = _Dtypes(
    (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)), bfloat16=True
)
#: Computed in float32 and written back rounded to their own dtype.
HALF_DTYPES = _Dtypes((np.dtype(np.float16),), bfloat16=True)
ACCEPTED = "float16, bfloat16, float32 or float64"


#: ``f32(1 / f64(scale))`` after checking ``scale``: the core's one statement of it.
inv_scale_of = host_inverse_scale


@dataclass(frozen=True)
class LeafKind:
    """The gradient leaves one backend accepts, and how to say what is wrong.

    Attributes:
        backend: The backend's name, as in the messages.
        array_type: The array type (or types) a leaf must be.
        type_name: How the messages spell it (``"numpy.ndarray"``).
        module: The library's usual alias, for the cast hint (``"np"``).
        convert: How to turn a value into such an array.
        exact: If given, the only types taken: a subclass of ``array_type`` not
            listed is refused (its arithmetic, or a mask, would differ between
            paths), with ``subclass_hint`` saying how to pass its data instead.
        subclass_hint: What to pass instead of a refused subclass.
        numpy_dtype: For a library whose dtypes are not NumPy's (torch), the
            NumPy dtype of a leaf's dtype, or ``None`` for one with none.
        cast: How to cast a leaf to float32, for the message.
    """

    backend: str
    array_type: type | tuple[type, ...]
    type_name: str
    module: str
    convert: str
    exact: tuple[type, ...] = ()
    subclass_hint: str = ""
    numpy_dtype: Callable[[Any], np.dtype[Any] | None] | None = None
    cast: str = ""

    def check(self, path: str, leaf: object) -> None:
        """Raise if ``leaf`` is not an array of this library with an accepted dtype.

        Raises:
            GradientTypeError: ``leaf`` is of another type, or of an integer,
                bool, complex or object dtype; the message names ``path``.
        """
        kind = type(leaf)
        if not isinstance(leaf, self.array_type):
            raise GradientTypeError(
                f"{path} is a {kind.__module__}.{kind.__qualname__}, but the {self.backend} "
                f"backend needs {self.type_name} leaves of dtype {ACCEPTED}; convert it with "
                f"{self.convert}"
            )
        if self.exact and kind not in self.exact:
            raise GradientTypeError(
                f"{path} is a {kind.__module__}.{kind.__qualname__}, a subclass of "
                f"{self.type_name} that the {self.backend} backend does not take (its "
                f"arithmetic or its mask would not be a plain array's); {self.subclass_hint}"
            )
        dtype = leaf.dtype  # type: ignore[attr-defined]
        known = np.dtype(dtype) if self.numpy_dtype is None else self.numpy_dtype(dtype)
        if known is None or known not in FLOAT_DTYPES:
            cast = self.cast or f".astype({self.module}.float32)"
            raise GradientTypeError(
                f"{path} has dtype {dtype}, but gradients must be {ACCEPTED}; cast it with "
                f"{cast} or leave it out of the tree"
            )


#: Elements per chunk of a norm's sum of squares: each chunk is summed in float64,
#: and the chunks' sums are added exactly, so the split of work never shows.
NORM_CHUNK = 1 << 17


def norm_of_sums(sums: Any) -> np.float32:
    """The norm from chunks' float64 sums of squares: exactly added, then one sqrt.

    A NaN sum gives NaN, an infinite one inf (the norm of non-finite gradients).

    >>> float(norm_of_sums([9.0, 16.0]))
    5.0
    """
    try:  # every sum is >= 0, +inf or NaN, and fsum keeps a NaN a NaN
        total = math.fsum(sums)
    except (OverflowError, ValueError):
        total = math.inf
    with np.errstate(over="ignore"):
        norm: np.float32 = np.float32(math.sqrt(total))
    return norm


_UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
#: Per dtype: the bits without the sign, and the all-ones exponent. Above it: NaN; equal: inf.
#: By the dtype's name (the leaves are validated: only the accepted dtypes get here).
_BITS: dict[str, tuple[np.unsignedinteger[Any], np.unsignedinteger[Any]]] = {
    "float16": (np.uint16(0x7FFF), np.uint16(0x7C00)),
    "bfloat16": (np.uint16(0x7FFF), np.uint16(0x7F80)),
    "float32": (np.uint32(0x7FFF_FFFF), np.uint32(0x7F80_0000)),
    "float64": (np.uint64(0x7FFF_FFFF_FFFF_FFFF), np.uint64(0x7FF0_0000_0000_0000)),
}
#: Elements per piece: 0.5 to 2 MiB of input, so a piece and its temporaries stay in
#: cache (NumPy) and the temporaries stay small next to the gradients (CuPy).
_PIECE = 1 << 18


def _pieces(a: Any, per: int) -> Iterator[Any]:
    """Views of ``a`` that together hold each element once, of at most ``per`` elements
    where the layout allows: a C-contiguous array is cut flat, others along their first
    axis (a row longer than ``per`` is cut in turn). Works for NumPy and CuPy arrays."""
    if a.ndim == 0 or a.size <= per:
        yield a
    elif a.flags.c_contiguous:
        flat = a.reshape(-1)
        for start in range(0, flat.size, per):
            yield flat[start : start + per]
    else:
        rows = a.shape[0]
        row = a.size // rows
        if row <= per:
            step = per // row
            for start in range(0, rows, step):
                yield a[start : start + step]
        else:
            for i in range(rows):
                yield from _pieces(a[i], per)


def bit_counts(xp: Any, a: Any) -> tuple[Any, Any]:
    """``(nan, inf)`` of one NumPy or CuPy array (``xp`` its module), from its bits.

    An element is NaN when its bits without the sign exceed the all-ones exponent,
    and +-inf when they equal it: that holds for the four accepted dtypes alike
    (float16 and bfloat16 through their ``uint16`` view, no float arithmetic on a
    half type), never raises a floating-point warning, and reads each element once,
    in pieces that keep the temporaries in cache. NumPy gives ints; CuPy gives 0-d
    device arrays (nothing read back).

    >>> nan, inf = bit_counts(np, np.array([np.nan, np.inf, -np.inf, 1.0], np.float16))
    >>> int(nan), int(inf)
    (1, 2)
    """
    magnitude_mask, exponent = _BITS[np.dtype(a.dtype).name]
    bits = a.view(_UINT[a.dtype.itemsize])  # same itemsize: a view, whatever the strides
    nan: Any = 0
    inf: Any = 0
    for piece in _pieces(bits, _PIECE):
        magnitude = piece & magnitude_mask
        nan = nan + xp.count_nonzero(magnitude > exponent)
        inf = inf + xp.count_nonzero(magnitude == exponent)
    return nan, inf
