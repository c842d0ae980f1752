"""What a flag and a norm must be, and which array library a value comes from.

The checks every entry point runs on the values a step is given, before any rule
reads them: a found flag (:func:`host_flag`), a gradient norm (:func:`host_norm`,
:func:`device_norm`), the one array library of a step's device values
(:func:`one_library`), and the errors that say what was wrong and what to pass
instead. Backends, facades and the transition import them from here, so a bad
value gets the same message wherever it enters. Nothing here knows the state or
its rules; host values are told apart by their type's module, so no array library
is ever imported.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from ._config import ScalerConfig, shown
from ._errors import GradientTypeError, GradientValueError, InvalidArgumentError

__all__ = [
    "FLAG_MUST",
    "NORM_MUST",
    "array_library",
    "describe",
    "device_norm",
    "flag_error",
    "host_flag",
    "host_norm",
    "mixed_error",
    "module_library",
    "norm_missing_error",
    "one_library",
]


# ------------------------------------------------------------------ found flags
#: What every flag check says a flag must be.
FLAG_MUST = (
    "it must be a bool or a 0-d boolean array; pass the flag returned by unscale() or "
    "find_non_finite()"
)


def flag_error(what: str, shown: str) -> GradientTypeError:
    """The one error for a value that is not a found flag (``shown`` is its description)."""
    return GradientTypeError(f"{what}={shown}, but {FLAG_MUST}")


def host_flag(found: object, what: str = "found_non_finite") -> bool | None:
    """``found`` as a Python bool when it is a host flag, else ``None``.

    Host flags: ``bool``, NumPy's ``bool_`` and 0-d NumPy boolean arrays (checked
    by type name, so NumPy is never imported here). ``None`` means "not a host
    value": a device array, for its backend to check.

    Raises:
        GradientTypeError: ``found`` is an int, a float, another non-bool, or a
            NumPy value that is not a 0-d boolean.
    """
    if isinstance(found, bool):
        return found
    typ = type(found)
    if typ.__module__ == "numpy":
        if str(getattr(found, "dtype", "")) == "bool" and getattr(found, "shape", None) == ():
            return bool(found)
        raise flag_error(what, repr(found))
    if (
        isinstance(found, (int, float, complex, str, bytes, list, tuple, dict, set))
        or found is None
    ):
        raise flag_error(what, repr(found))  # a container of flags is not a flag either
    return None


# ------------------------------------------------------------- gradient norms
#: What every grad_norm check says a norm must be.
NORM_MUST = (
    "it must be a real number or a 0-d float array; pass the norm returned by "
    "scaler_core.unscale_and_norm() or unscale_and_clip()"
)


def norm_missing_error(cfg: ScalerConfig) -> InvalidArgumentError:
    """The one error for a missing ``grad_norm`` under spike skipping."""
    return InvalidArgumentError(
        f"grad_norm=None, but spike_threshold={cfg.spike_threshold!r} needs this step's "
        f"global gradient norm; pass the norm returned by scaler_core.unscale_and_norm() or "
        f"unscale_and_clip() as update(state, found, grad_norm=norm)"
    )


def host_norm(value: object, what: str = "grad_norm") -> float | None:
    """``value`` as a Python float when it is a host norm, else ``None`` (a device array).

    Host norms: ``int`` and ``float`` (not ``bool``), NumPy floating scalars and
    0-d NumPy float arrays, ml_dtypes scalars (bfloat16), checked by type name so
    NumPy is never imported here. A norm is ``>= 0``, NaN or ``+inf``.

    Raises:
        GradientTypeError: ``value`` is a bool, a string, a container, a complex
            number, ``None``, or a NumPy value that is not a 0-d float.
        GradientValueError: ``value`` is a negative host number (``-inf`` too), or
            an int too large for a float (``10**400``; ``math.inf`` is the norm).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            out = float(value)
        except OverflowError:  # an int beyond every float: refused, not taken as inf
            if value < 0:
                out = -math.inf
            else:
                raise GradientValueError(
                    f"{what}={shown(value)}, but it is too large for a float (a norm is at "
                    f"most {sys.float_info.max!r}, or inf); pass math.inf for a norm that "
                    f"overflowed, or the norm returned by scaler_core.unscale_and_norm() or "
                    f"unscale_and_clip()"
                ) from None
    elif type(value).__module__ in _NUMPY_MODULES:
        dtype = str(getattr(value, "dtype", ""))
        if not dtype.startswith(("float", "bfloat")) or getattr(value, "shape", None) != ():
            raise GradientTypeError(f"{what}={value!r}, but {NORM_MUST}")
        out = float(value)  # type: ignore[arg-type]
    elif isinstance(value, (bool, complex, str, bytes, list, tuple, dict, set)) or value is None:
        raise GradientTypeError(f"{what}={value!r}, but {NORM_MUST}")
    else:
        return None
    if out < 0:
        raise GradientValueError(
            f"{what}={shown(value)}, but a norm is >= 0 (NaN or inf on a step whose gradients "
            f"are not finite); pass the norm returned by scaler_core.unscale_and_norm() or "
            f"unscale_and_clip(), or math.sqrt of a sum of squares"
        )
    return out


def device_norm(value: object, what: str = "grad_norm") -> Any:
    """``value`` itself when it is a device norm: a 0-d float array of an array library.

    Raises:
        GradientTypeError: It is not (see :func:`host_norm` for host values).
    """
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    name = str(dtype).removeprefix("torch.")
    if shape is None or tuple(shape) != () or not name.startswith(("float", "bfloat")):
        raise GradientTypeError(f"{what}={describe(value)}, but {NORM_MUST}")
    return value


#: Modules of NumPy's host values (ml_dtypes holds NumPy's bfloat16 scalars).
_NUMPY_MODULES = frozenset({"numpy", "ml_dtypes"})
#: Modules whose values are host values: they go with every array library.
_HOST_MODULES = _NUMPY_MODULES | {"builtins"}
#: JAX's concrete arrays live in ``jaxlib``, its tracers in ``jax``: one library.
_SAME_LIBRARY = {"jaxlib": "jax"}


def module_library(value: object) -> str:
    """The library ``value``'s type comes from (its top-level module; ``jaxlib`` is ``jax``)."""
    top = type(value).__module__.partition(".")[0]
    return _SAME_LIBRARY.get(top, top)


def array_library(value: object) -> str | None:
    """The array library of a device value; ``None`` for a host value (a Python
    number or bool, a NumPy or ml_dtypes value), which goes with every library."""
    library = module_library(value)
    return None if library in _HOST_MODULES else library


def describe(value: object) -> str:
    """``value`` for a message: its repr on the host; type, shape and dtype for a
    device array (whose repr would copy it to the host)."""
    if array_library(value) is None:
        return shown(value)
    shape = getattr(value, "shape", None)
    shape = tuple(shape) if shape is not None else None
    return f"<{type(value).__name__} shape={shape} dtype={getattr(value, 'dtype', None)}>"


def one_library(*named: tuple[str, object]) -> tuple[str, str, object] | None:
    """The first device value among ``(name, value)`` pairs, once every device value
    is known to come from its library: ``(library, name, value)``.

    Host values go with any library. ``None`` when every value is a host value. A
    state is passed as its fields, each named ``state.<field>`` (:func:`mixed_error`
    tells a state's fields by that prefix).

    Raises:
        GradientTypeError: Two values come from two libraries (the message names
            both, their libraries and what to do).

    >>> one_library(("found_non_finite", True), ("state.scale", 65536.0)) is None
    True
    """
    first: tuple[str, str, object] | None = None
    for name, value in named:
        library = array_library(value)
        if library is None:
            continue
        if first is None:
            first = (library, name, value)
        elif library != first[0]:
            raise mixed_error(first, (library, name, value))
    return first


def mixed_error(
    first: tuple[str, str, object], second: tuple[str, str, object]
) -> GradientTypeError:
    """The one error for a step whose values come from two array libraries."""
    (lib_a, name_a, a), (lib_b, name_b, b) = first, second
    states = [n for n in (name_a, name_b) if n.startswith("state.")]
    fix = (
        "keep the state where the step's gradients are, or bring it to the host with "
        "state.to_host() (a host state goes with any library)"
        if states
        else "pass the flag and the norm that unscale_and_norm() returned for this step"
    )
    return GradientTypeError(
        f"{name_a}={describe(a)} is a {lib_a} array but {name_b}={describe(b)} is a {lib_b} "
        f"array; one step takes the values of one library (a Python or NumPy value goes "
        f"with any): {fix}"
    )
