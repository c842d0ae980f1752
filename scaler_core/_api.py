"""The functional API: pure functions over states and gradient trees."""

from __future__ import annotations

from typing import Any

from ._backend import Backend, backend_for, resolve_backend
from ._state import ScalerState, host_flag, host_update, require_state

__all__ = ["find_non_finite", "unscale", "update"]


def update(state: ScalerState, found_non_finite: Any) -> ScalerState:
    """Advance the scaler by one step. Pure: ``state`` is never modified.

    In plain words: a step with non-finite gradients is skipped; the growth
    tracker restarts and, once the hysteresis credit is spent, the scale is
    multiplied by ``backoff_factor`` (not below ``min_scale``). A clean step
    counts towards ``growth_interval``; on reaching it the scale is multiplied
    by ``growth_factor`` unless that would overflow float32 or pass
    ``max_scale``. Every product is rounded to float32, so with the default
    config the trajectory equals PyTorch's ``GradScaler`` bit for bit. A step
    that would leave the scale 0, subnormal or non-finite, or pass a fail-closed
    limit, is refused.

    With a host flag (``bool``, NumPy bool) and a host state the transition runs
    in Python and raises on a refused step. With a device flag or state (CuPy,
    JAX, also inside ``jax.jit``) it runs on the device with no host
    synchronisation and records a refusal in ``state.failure``; the first
    host-side look (:meth:`ScalerState.check`, :meth:`ScalerState.current_scale`,
    :func:`to_dict`) raises it.

    Args:
        state: The current state.
        found_non_finite: Whether any gradient of this step was NaN or inf.

    Returns:
        The next state.

    Raises:
        ScaleCollapseError: (host) The step would collapse the scale, or back
            off at a floor configured with ``at_min_scale="raise"``.
        SkipLimitError: (host) The step would pass ``max_consecutive_skips``.
        GradientTypeError: ``found_non_finite`` is not a boolean flag.
        InvalidArgumentError: ``state`` is not a :class:`ScalerState`.

    >>> from scaler_core import ScalerConfig, init
    >>> s = init(ScalerConfig(growth_interval=2))
    >>> s = update(update(s, False), False)
    >>> s.scale, s.growth_tracker
    (131072.0, 0)
    >>> update(s, True).scale
    65536.0
    """
    flag = host_flag(found_non_finite)
    if flag is not None and require_state(state).on_host:
        return host_update(state, flag)
    if flag is None:
        backend = backend_for(found_non_finite, root="found_non_finite")
    else:
        backend = backend_for(state.scale, root="state.scale")
    return backend.update(state, found_non_finite)


def unscale(
    grads: Any, scale: float | Any | ScalerState, *, backend: str | Backend | None = None
) -> tuple[Any, Any]:
    """Unscale every gradient and return one non-finite flag for all of them.

    See :meth:`Backend.unscale` for the exact arithmetic. The backend is taken
    from the arrays unless named.

    Args:
        grads: A tree of gradient arrays of one library.
        scale: The scale (a float or device scalar), or a :class:`ScalerState`.
        backend: A backend name or object; ``None`` picks it from ``grads``.

    Returns:
        ``(grads, found)``; NumPy and CuPy modify ``grads`` in place.

    >>> import numpy as np
    >>> g = {"w": np.array([2.0, 4.0], np.float32)}
    >>> _, found = unscale(g, 2.0)
    >>> g["w"].tolist(), bool(found)
    ([1.0, 2.0], False)
    """
    if isinstance(scale, ScalerState):
        scale = scale.scale
    return resolve_backend(backend, grads).unscale(grads, scale)


def find_non_finite(grads: Any, *, backend: str | Backend | None = None) -> Any:
    """Whether any element of any gradient is NaN or inf; modifies nothing.

    >>> import numpy as np
    >>> bool(find_non_finite([np.array([1.0, np.inf])]))
    True
    """
    return resolve_backend(backend, grads).find_non_finite(grads)
