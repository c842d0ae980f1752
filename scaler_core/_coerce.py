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
import numbers
import sys
from typing import Any

from . import _registry
from ._config import ScalerConfig, shown
from ._errors import GradientTypeError, GradientValueError, InvalidArgumentError
from ._f32 import f32, is_normal_f32

__all__ = [
    "FLAG_MUST",
    "NORM_MUST",
    "array_library",
    "describe",
    "device_norm",
    "flag_error",
    "host_flag",
    "host_inverse_scale",
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

    Host flags: ``bool``, and the host library's 0-d booleans (NumPy's ``bool_`` and
    0-d boolean arrays, told by the registry and the host namespace's ``isdtype``, so
    NumPy is never imported here). ``None`` means "not a host value": a device array,
    for its backend to check.

    Raises:
        GradientTypeError: ``found`` is an int, a float, another non-bool, or a
            NumPy value that is not a 0-d boolean.
    """
    if isinstance(found, bool):
        return found
    if _host_array(found):
        if _is_0d(found, "bool"):
            return bool(found)
        raise flag_error(what, repr(found))
    if (
        isinstance(found, (int, float, complex, str, bytes, list, tuple, dict, set))
        or found is None
    ):
        raise flag_error(what, repr(found))  # a container of flags is not a flag either
    return None


# ----------------------------------------------------------------------- scales
def host_inverse_scale(scale: Any) -> float:
    """``f32(1 / f64(scale))`` after checking ``scale`` is a positive normal float32.

    Args:
        scale: A Python real number, or a host library's real scalar or 0-d array.

    Raises:
        GradientValueError: ``scale`` is not a real number (a bool, a string, an
            array of another shape), or not a positive, finite, normal float32 value.

    >>> host_inverse_scale(65536.0)
    1.52587890625e-05
    """
    if _host_array(scale) and getattr(scale, "shape", None) == ():
        scale = scale[()]  # a 0-d host array: its scalar (a bool stays a bool)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise GradientValueError(
            f"scale={scale!r}, but it must be a real number; pass state.scale or a float"
        )
    value = float(scale)
    if not is_normal_f32(value):
        raise GradientValueError(
            f"scale={scale!r}, but it must be a positive, finite, normal float32 value; "
            f"pass the scale of a valid ScalerState"
        )
    return f32(1.0 / f32(value))


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

    Host norms: ``int`` and ``float`` (not ``bool``), and the host library's 0-d
    floats (NumPy's floating scalars and 0-d float arrays, ml_dtypes' bfloat16), told
    as :func:`host_flag` tells its flags. A norm is ``>= 0``, NaN or ``+inf``.

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
    elif _host_array(value):
        if not _is_0d(value, "real floating"):
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
    if _registry.claim(value) is None or not _is_0d(value, "real floating"):
        raise GradientTypeError(f"{what}={describe(value)}, but {NORM_MUST}")
    return value


def _host_array(value: object) -> bool:
    """Whether ``value`` is a value of the host library (not a Python builtin)."""
    owner = _registry.claim(value)  # builtins are nobody's
    return owner is not None and owner.host


def _is_0d(value: object, kind: str) -> bool:
    """Whether ``value`` is a 0-d array or scalar whose dtype its backend's namespace
    says is of ``kind`` (``"bool"``, ``"real floating"``)."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or tuple(shape) != ():
        return False
    return bool(_registry.namespace_of(value).isdtype(dtype, kind))


def module_library(value: object) -> str:
    """The library ``value`` comes from, as messages name it (``jax`` for jaxlib's
    arrays): the registry's answer."""
    return _registry.library_of(value)


def array_library(value: object) -> str | None:
    """The array library of a device value; ``None`` for a host value (a Python
    number or bool, a NumPy or ml_dtypes value), which goes with every library."""
    owner = _registry.claim(value)
    if owner is None:
        return None if type(value).__module__ == "builtins" else _registry.library_of(value)
    return None if owner.host else owner.library


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
