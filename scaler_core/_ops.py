"""Every gradient and flag operation, written once over a backend's passes and namespace.

A backend provides the passes its array library really has (see
:class:`scaler_core.Backend`): a plan of the validated gradients, unscale with
detection, a measuring pass that can also write, and a clip pass that applies the clip
coefficient or nothing. Each user-level operation is composed here, once, from those passes, and
the functional API, both facades, the optax wrapper and the torch drop-in call these
functions and nothing below them: an operation added later is added here, not to
every backend.

The flag operations (:func:`select`, :func:`any_found`, :func:`to_bool`, the step's
:func:`update`) are written here once too, over the backend's array namespace
(``Backend.namespace``): a host library decides on the host, a device library on its
device with nothing read back. ``scaler_core.Backend`` serves them as its methods.

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

from ._coerce import describe, flag_error, host_flag, host_inverse_scale
from ._config import shown
from ._errors import GradientValueError, InvalidArgumentError, InvalidConfigError
from ._f32 import FLT_MAX, FLT_MIN, f32, is_f32_exact
from ._state import ScalerState, device_update, host_update, require_state

__all__ = [
    "CLIP_EPS",
    "any_found",
    "as_flag",
    "clip_coefficient",
    "clip_divisor",
    "find_non_finite",
    "fold_clip",
    "max_norm_of",
    "require_float32_factors",
    "select",
    "to_bool",
    "unscale",
    "unscale_and_clip",
    "unscale_and_norm",
    "update",
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
        seen = (
            f"a {type(max_norm).__module__}.{type(max_norm).__qualname__}"
            if hasattr(max_norm, "shape") and hasattr(max_norm, "dtype")
            else shown(max_norm)  # an array is named, not shown: repr may read it back
        )
        raise InvalidArgumentError(f"max_norm={seen}, but it must be {must}")
    try:
        value = float(max_norm)
    except (OverflowError, ValueError):
        raise InvalidArgumentError(f"max_norm={shown(max_norm)}, but it must be {must}") from None
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


def inverse_scale(xp: Any, scale: Any) -> Any:
    """``f32(1 / f64(scale))``, a float32 value of ``xp``'s library: what a pass
    multiplies the gradients by.

    A host scale (a number, a NumPy scalar or 0-d array) is checked here and refused
    if it is not a positive normal float32. A 0-d float array of ``xp``'s library (a
    device state's scale) is not read back: where it is not a positive normal float32
    the inverse is NaN, so every unscaled gradient is NaN and the step's flag is set
    (fail closed) instead of flipping or zeroing the gradients. In float32 the
    correctly rounded ``1 / s`` equals ``f32(1 / f64(s))`` (53 >= 2 * 24 + 2), so the
    device form needs no float64.

    Raises:
        GradientValueError: A host scale that is not a positive normal float32, or
            an array scale that is not a 0-d float.

    >>> from scaler_core import get_backend
    >>> float(inverse_scale(get_backend("numpy").namespace(), 65536.0))
    1.52587890625e-05
    """
    if xp.on_host or not xp.is_array(scale):
        return xp.float32(host_inverse_scale(scale))
    if tuple(scale.shape) != () or not xp.isdtype(scale.dtype, "real floating"):
        raise GradientValueError(
            f"scale={describe(scale)}, but a device scale must be a 0-d float array; pass "
            f"state.scale"
        )
    s = xp.asarray(scale, dtype=xp.float32)
    valid = xp.isfinite(s) & (s >= xp.float32(FLT_MIN))
    return xp.where(valid, xp.float32(1.0) / s, xp.float32(math.nan))


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
    return backend.unscale(backend.plan(grads, writable=True), scale)  # type: ignore[no-any-return]


def unscale_and_norm(backend: Any, grads: Any, scale: Any) -> tuple[Any, Any, Any]:
    """:func:`unscale` and the global L2 norm, one pass: ``(grads, found, norm)``."""
    _given(scale)
    return backend.measure(backend.plan(grads, writable=True), scale, write=True)  # type: ignore[no-any-return]


def find_non_finite(backend: Any, grads: Any) -> Any:
    """Whether any element is NaN or inf: one read, nothing written."""
    _, found = backend.unscale(backend.plan(grads, writable=False), None)
    return found


def _clip_args(scale: Any, max_norm: Any, reduce: Any, reduce_norm: Any) -> float:
    """The clip's arguments checked (the scale given, ``max_norm``, ``reduce``,
    ``reduce_norm``): the limit."""
    _given(scale)
    limit = max_norm_of(max_norm)
    if reduce is not None and not callable(reduce):
        raise InvalidArgumentError(
            f"reduce={reduce!r}, but it must be a callable that takes the flag and returns "
            f"the step's decision flag, or None"
        )
    if reduce_norm is not None and not callable(reduce_norm):
        raise InvalidArgumentError(
            f"reduce_norm={reduce_norm!r}, but it must be a callable that takes the norm of "
            f"these gradients and returns the norm to clip by (over every replica's), or None"
        )
    return limit


def unscale_and_clip(  # noqa: PLR0913 - the facades' two reductions, each its own hook
    backend: Any,
    grads: Any,
    scale: Any,
    max_norm: Any,
    reduce: Callable[[Any], Any] | None = None,
    *,
    reduce_norm: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any, Any]:
    """Unscale, detect and clip to ``max_norm``: a read, the decision, then a write or none.

    The measuring pass reads every gradient and writes nothing: the flag and the
    norm of the unscaled values. ``reduce`` (when given) turns that flag into the
    step's decision (a facade ORs in its other groups and replicas there, on the
    device), and ``reduce_norm`` that norm into the one to clip by (a facade whose
    replicas each hold a shard of the gradients combines their norms there), in that
    order. The clip pass then stores each unscaled value times
    :func:`clip_coefficient`, or, on a skipped step, writes nothing.

    Returns:
        ``(grads, found, norm)``: the decision flag (after ``reduce``) and the norm
        clipped by (after ``reduce_norm``; what ``clip_grad_norm_`` returns).

    Raises:
        InvalidArgumentError: ``max_norm`` is not a positive finite real, or
            ``reduce`` or ``reduce_norm`` is not callable; the backend's errors for
            bad leaves or a bad scale. All before anything is modified.
    """
    limit = _clip_args(scale, max_norm, reduce, reduce_norm)
    plan = backend.plan(grads, writable=True)
    _, found, norm = backend.measure(plan, scale, write=False)
    found, norm = _reduced(found, norm, reduce, reduce_norm)
    return backend.clip(plan, scale, norm, limit, found), found, norm


def _reduced(found: Any, norm: Any, reduce: Any, reduce_norm: Any) -> tuple[Any, Any]:
    """The measured flag and norm after the facade's ``reduce`` and ``reduce_norm``."""
    if reduce is not None:
        found = reduce(found)
    if reduce_norm is not None:
        norm = reduce_norm(norm)
    return found, norm


def fold_clip(  # noqa: PLR0913 - the facades' two reductions, each its own hook
    backend: Any,
    grads: Any,
    scale: Any,
    max_norm: Any,
    reduce: Callable[[Any], Any] | None = None,
    *,
    reduce_norm: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any, Any]:
    """Unscale, detect and clip folded into an optimizer's own pass: a read, nothing written.

    For an optimizer that divides each gradient by a ``grad_scale`` inside its update
    (PyTorch's fused ones). The measuring pass reads every gradient and writes nothing
    (the leaves are prepared read-only): the flag and the norm of the unscaled values,
    as :func:`unscale_and_clip` measures them. ``reduce`` turns the flag into the
    step's decision and ``reduce_norm`` the norm into the one to clip by, as there.
    The optimizer then divides by :func:`clip_divisor`, ``scale / coef``: one rounding
    where unscaling and clipping make two, so the gradient it uses is within a float32
    ulp or so of the clipped one (and equal to it when nothing is clipped and the
    scale is a power of two).

    Returns:
        ``(found, norm, divisor)``: the decision flag, the norm before clipping (what
        ``clip_grad_norm_`` returns), and the float32 divisor, on the norm's device.

    Raises:
        InvalidArgumentError: As :func:`unscale_and_clip`, before anything is read.
    """
    limit = _clip_args(scale, max_norm, reduce, reduce_norm)
    _, found, norm = backend.measure(backend.plan(grads, writable=False), scale, write=False)
    found, norm = _reduced(found, norm, reduce, reduce_norm)
    return found, norm, clip_divisor(backend.namespace(norm), scale, norm, limit)


def clip_divisor(xp: Any, scale: Any, norm: Any, max_norm: float) -> Any:
    """``scale / clip_coefficient(norm)`` in float32: what to divide a scaled gradient by
    to unscale and clip it in one rounding. NaN where the norm is (a skipped step).

    ``xp`` as for :func:`clip_coefficient` (in NumPy a norm of inf divides by a zero
    coefficient, which warns: callers run it under ``np.errstate``).

    >>> import numpy as np
    >>> float(clip_divisor(np, 1024.0, np.float32(2.0), 1.0))
    2048.0009765625
    """
    return xp.asarray(scale, dtype=xp.float32) / clip_coefficient(xp, norm, max_norm)


# ------------------------------------------------------------------- flags
# The flag operations, written once over each backend's array namespace (see
# scaler_core.Backend.namespace): a flag stays on its device, and only to_bool reads
# one back to the host.


def as_flag(xp: Any, found: Any, what: str = "found") -> Any:
    """``found`` as a flag of ``xp``'s library: a host bool made with ``xp.flag``, a
    0-d boolean array of the library as it is.

    Raises:
        GradientTypeError: ``found`` is neither (an int, a float, an array of
            another shape or dtype, a container); the message names ``what``.
    """
    if not xp.on_host and xp.is_array(found):  # a device flag: the common case, first
        if tuple(found.shape) == () and xp.isdtype(found.dtype, "bool"):
            return found
        raise flag_error(what, describe(found))
    host = host_flag(found, what)
    if host is None:
        raise flag_error(what, describe(found))
    return xp.flag(host)


def to_bool(backend: Any, found: Any) -> bool:
    """The flag as a Python bool: the one deliberate host synchronisation."""
    xp = backend.namespace(found)
    return bool(xp.read(as_flag(xp, found)))


def any_found(backend: Any, *flags: Any) -> Any:
    """The logical OR of several flags, on the first device flag's device (no read)."""
    xp = backend.namespace(*flags)
    out = None
    for i, f in enumerate(flags):
        flag = as_flag(xp, f, f"flags[{i}]")
        out = flag if out is None else xp.logical_or(out, flag)
    return xp.flag(False) if out is None else out


def select(backend: Any, found: Any, on_skip: Any, on_step: Any) -> Any:
    """A tree of ``on_step``'s structure holding ``on_skip``'s leaves where ``found``
    is true, else ``on_step``'s: what keeps parameters and optimizer state bit for bit
    on a skipped step.

    A host library decides on the host and copies nothing; a device library selects
    leaf by leaf on the device (``xp.where``), so nothing is read back.

    Raises:
        GradientTypeError: ``found`` is not a flag.
        InvalidArgumentError: The trees differ in structure, or a pair of leaves
            differs in shape or dtype (the message names the leaf).
    """
    xp = backend.namespace(found)
    flag = as_flag(xp, found)
    if xp.on_host:
        skip = bool(xp.read(flag))

        def choose(path: str, a: Any, b: Any) -> Any:
            _check_pair(path, xp.asarray(a), xp.asarray(b))
            return a if skip else b

    else:

        def choose(path: str, a: Any, b: Any) -> Any:
            a, b = _on_device(xp, a), _on_device(xp, b)
            _check_pair(path, a, b)
            return xp.where(flag, a, b)

    return xp.map_pairs(choose, on_skip, on_step)


def _on_device(xp: Any, leaf: Any) -> Any:
    return leaf if xp.is_array(leaf) else xp.asarray(leaf)


def _check_pair(path: str, skip: Any, step: Any) -> None:
    if tuple(skip.shape) != tuple(step.shape) or skip.dtype != step.dtype:
        raise InvalidArgumentError(
            f"{path} has shape {tuple(step.shape)} and dtype {step.dtype}, but on_skip has "
            f"{tuple(skip.shape)} and {skip.dtype}; select keeps shapes and dtypes, so cast "
            f"the updated value back to the old one's dtype"
        )


def update(backend: Any, state: Any, found: Any, grad_norm: Any = None) -> ScalerState:
    """One transition of ``state``, where the backend's flags live.

    A host library reads the flag and runs :func:`scaler_core._state.host_update`
    (a failing step raises); a device library runs :func:`device_update` on the
    state's device (a failing step is recorded in ``state.failure``, raised at the
    first host-side look), with no host synchronisation.

    Raises:
        InvalidStateError: ``state`` is not a ScalerState.
        GradientTypeError: ``found`` is not a flag.
        InvalidConfigError: A factor is not exactly a float32 and the namespace
            has no exact float64 to form the product in (JAX without x64).
    """
    state = require_state(state)
    xp = backend.namespace(state.scale, found)
    flag = as_flag(xp, found, "found_non_finite")
    if xp.on_host:
        return host_update(state if state.on_host else state.to_host(), xp.read(flag), grad_norm)
    require_float32_factors(xp, state.config)
    return device_update(xp, state, flag, grad_norm)


def require_float32_factors(xp: Any, config: Any) -> None:
    """Refuse a factor float32 cannot hold where the namespace ``xp`` has no float64
    to multiply it in (its ``float64_missing`` says how to enable it).

    Raises:
        InvalidConfigError: ``growth_factor`` or ``backoff_factor`` is not exactly
            a float32; the message gives the float32 to use.
    """
    fix = xp.float64_missing
    if fix is None:
        return
    for name in ("growth_factor", "backoff_factor"):
        value = getattr(config, name)
        if not is_f32_exact(value):
            raise InvalidConfigError(
                f"{name}={value!r}, but it must be exactly representable in float32 so every "
                f"backend rounds alike; use {f32(value)!r} (or {fix})"
            )
