"""Every gradient operation, written once over a backend's fused passes.

A backend provides the passes its array library really has (see
:class:`scaler_core.Backend`): validated leaves, unscale with detection, a measuring
pass that can also write, and a rescale pass that applies the clip coefficient or
nothing. Each user-level operation is composed here, once, from those passes, and
the functional API, both facades, the optax wrapper and the torch drop-in call these
functions and nothing below them: an operation added later is added here, not to
every backend.

The clip coefficient's formula lives here too (:func:`clip_coefficient`), written
against an array namespace so each backend evaluates it with its own library, on its
own device; the CUDA kernels restate it, because a kernel cannot call Python, and
the tests hold the two equal bit for bit.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from ._errors import GradientValueError, InvalidArgumentError
from ._f32 import FLT_MAX, f32

__all__ = [
    "CLIP_EPS",
    "clip_coefficient",
    "find_non_finite",
    "max_norm_of",
    "unscale",
    "unscale_and_clip",
    "unscale_and_norm",
]

#: What PyTorch's ``clip_grad_norm_`` adds to the norm before dividing (a float32 value).
CLIP_EPS = f32(1e-6)


def max_norm_of(max_norm: Any) -> float:
    """``max_norm`` as a float after checking it is a positive, finite float32-range real.

    Raises:
        InvalidArgumentError: It is not a real number (an array is not: its value
            would have to be read back), or not in (0, FLT_MAX].

    >>> max_norm_of(1)
    1.0
    """
    must = (
        f"a real number > 0 and at most {FLT_MAX!r} (the largest float32); pass the norm "
        f"to clip to, e.g. max_norm=1.0"
    )
    if isinstance(max_norm, bool) or not isinstance(max_norm, numbers.Real):
        shown = (
            f"a {type(max_norm).__module__}.{type(max_norm).__qualname__}"
            if hasattr(max_norm, "shape") and hasattr(max_norm, "dtype")
            else repr(max_norm)  # an array is named, not shown: repr may read it back
        )
        raise InvalidArgumentError(f"max_norm={shown}, but it must be {must}")
    try:
        value = float(max_norm)
    except (OverflowError, ValueError):
        raise InvalidArgumentError(f"max_norm={max_norm!r}, but it must be {must}") from None
    if not (math.isfinite(value) and 0.0 < value <= FLT_MAX and f32(value) > 0.0):
        raise InvalidArgumentError(f"max_norm={max_norm!r}, but it must be {must}")
    return value


def clip_coefficient(xp: Any, norm: Any, max_norm: float) -> Any:
    """PyTorch's ``clip_grad_norm_`` coefficient, in its float32 steps, clamped at 1.

    ``min(1, f32(f32(1 / f32(norm + 1e-6)) * f32(max_norm)))``: PyTorch forms
    ``max_norm / (norm + 1e-6)`` as a reciprocal and a product, each rounded to
    float32, then clamps. ``xp`` is the norm's array namespace (``asarray(value,
    dtype=xp.float32)`` and ``minimum``); ``norm`` is a float32 value of it. The
    result is a float32 value of the same library, on the norm's device: nothing is
    read back. (In NumPy, an overflow to inf warns: callers run it under
    ``np.errstate``.)

    >>> import numpy as np
    >>> float(clip_coefficient(np, np.float32(2.0), 1.0))
    0.4999997615814209
    """
    one = xp.asarray(1.0, dtype=xp.float32)
    denominator = norm + xp.asarray(CLIP_EPS, dtype=xp.float32)
    return xp.minimum((one / denominator) * xp.asarray(max_norm, dtype=xp.float32), one)


def _given(scale: Any) -> Any:
    """``scale``, unless it is ``None`` (which the passes read as "detection alone")."""
    if scale is None:
        raise GradientValueError(
            "scale=None, but it must be a real number; pass state.scale or a float"
        )
    return scale


def unscale(backend: Any, grads: Any, scale: Any) -> tuple[Any, Any]:
    """Every gradient times ``1/scale``, and one non-finite flag: ``(grads, found)``."""
    _given(scale)
    return backend.unscale(backend.leaves(grads, writable=True), scale)  # type: ignore[no-any-return]


def unscale_and_norm(backend: Any, grads: Any, scale: Any) -> tuple[Any, Any, Any]:
    """:func:`unscale` and the global L2 norm, one pass: ``(grads, found, norm)``."""
    _given(scale)
    return backend.measure(backend.leaves(grads, writable=True), scale, write=True)  # type: ignore[no-any-return]


def find_non_finite(backend: Any, grads: Any) -> Any:
    """Whether any element is NaN or inf: one read, nothing written."""
    _, found = backend.unscale(backend.leaves(grads, writable=False), None)
    return found


def unscale_and_clip(
    backend: Any,
    grads: Any,
    scale: Any,
    max_norm: Any,
    reduce: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any, Any]:
    """Unscale, detect and clip to ``max_norm``: a read, the decision, then a write or none.

    The measuring pass reads every gradient and writes nothing: the flag and the
    norm of the unscaled values. ``reduce`` (when given) turns that flag into the
    step's decision (a facade ORs in its other groups and replicas there, on the
    device). The rescale pass then stores each unscaled value times
    :func:`clip_coefficient`, or, on a skipped step, writes nothing.

    Returns:
        ``(grads, found, norm)``: the decision flag (after ``reduce``) and the norm
        before clipping (what ``clip_grad_norm_`` returns).

    Raises:
        InvalidArgumentError: ``max_norm`` is not a positive finite real, or
            ``reduce`` is not callable; the backend's errors for bad leaves or a
            bad scale. All before anything is modified.
    """
    _given(scale)
    limit = max_norm_of(max_norm)
    if reduce is not None and not callable(reduce):
        raise InvalidArgumentError(
            f"reduce={reduce!r}, but it must be a callable that takes the flag and returns "
            f"the step's decision flag, or None"
        )
    prepared = backend.leaves(grads, writable=True)
    _, found, norm = backend.measure(prepared, scale, write=False)
    if reduce is not None:
        found = reduce(found)
    return backend.rescale(prepared, scale, norm, limit, found), found, norm
