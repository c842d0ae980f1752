"""The functional API: pure functions over states and gradient trees."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

from . import _ops
from ._backend import Backend, backend_for, resolve_backend
from ._coerce import device_norm, host_flag, host_norm, norm_missing_error, one_library
from ._config import ScalerConfig
from ._errors import InvalidArgumentError, InvalidStateError
from ._state import DATA_FIELDS, ScalerState, host_update, require_state, step_skipped

__all__ = ["find_non_finite", "unscale", "unscale_and_clip", "unscale_and_norm", "update"]


def update(state: ScalerState, found_non_finite: Any, grad_norm: Any = None) -> ScalerState:
    """Advance the scaler by one step. Pure: ``state`` is never modified.

    In plain words: a step with non-finite gradients is skipped; the growth
    tracker restarts and, once the hysteresis credit is spent, the scale is
    multiplied by ``backoff_factor`` (not below ``min_scale``). A clean step
    counts towards ``growth_interval`` (except the first ``growth_delay`` after
    a skipped step, 0 by default); on reaching it the scale is multiplied
    by ``growth_factor`` unless that would overflow float32 or pass
    ``max_scale``. Every product is rounded to float32, so with the default
    config the trajectory equals PyTorch's ``GradScaler`` bit for bit. A step
    that would leave the scale 0, subnormal or non-finite, or pass a fail-closed
    limit, is refused.

    With spike skipping on (``spike_threshold=k``), a step with finite gradients
    whose ``grad_norm`` lies more than ``k`` standard deviations above the mean
    of the last ``spike_window`` steps' norms is skipped too (a spike), without
    backing off the scale or counting towards growth; every step with finite
    gradients and a finite norm moves the window's statistics (see
    :mod:`scaler_core._state` for the exact float32 formulas).

    With a host flag (``bool``, NumPy bool), a host norm (a number, a NumPy
    float) and a host state the transition runs in Python and raises on a
    refused step. With a device flag, norm or state (CuPy, JAX, also inside
    ``jax.jit``) it runs on the device with no host synchronisation and records
    a refusal in ``state.failure``; the first host-side look
    (:meth:`ScalerState.check`, :meth:`ScalerState.current_scale`,
    :func:`to_dict`) raises it.

    Args:
        state: The current state.
        found_non_finite: Whether any gradient of this step was NaN or inf.
        grad_norm: This step's global gradient norm (the norm returned by
            ``unscale_and_norm()`` or ``unscale_and_clip()``). Needed when the config
            has ``spike_threshold`` set; ignored otherwise.

    Returns:
        The next state.

    Raises:
        ScaleCollapseError: (host) The step would collapse the scale, or back
            off at a floor configured with ``at_min_scale="raise"``.
        SkipLimitError: (host) The step would pass ``max_consecutive_skips``.
        GradientTypeError: ``found_non_finite`` is not a boolean flag,
            ``grad_norm`` is not a real number or a 0-d float array, or the flag,
            the norm and the state hold arrays of two libraries (a Python or
            NumPy value goes with any library).
        GradientValueError: ``grad_norm`` is a negative number (a device norm
            is not read back to check: a negative one counts as NaN).
        InvalidArgumentError: ``state`` is not a :class:`ScalerState`, or
            ``spike_threshold`` is set and ``grad_norm`` is None.

    >>> from scaler_core import ScalerConfig, init
    >>> s = init(ScalerConfig(growth_interval=2))
    >>> s = update(update(s, False), False)
    >>> s.scale, s.growth_tracker
    (131072.0, 0)
    >>> update(s, True).scale
    65536.0
    >>> s = init(ScalerConfig(spike_threshold=3.0, spike_window=4))
    >>> for norm in (1.0, 1.2, 0.8, 1.0):
    ...     s = update(s, False, grad_norm=norm)
    >>> s = update(s, False, grad_norm=50.0)
    >>> s.last_step, s.skipped_steps, s.scale
    (<StepKind.SPIKE_SKIP: 'spike_skip'>, 1, 65536.0)
    """
    cfg = require_state(state).config
    spiking = cfg.spike_threshold is not None
    if spiking and grad_norm is None:
        raise norm_missing_error(cfg)
    # Every argument is checked here, before any work: its type, a host norm's sign,
    # and one array library for the device values among them (a host value goes
    # with any). The backend then runs the same checks again, for direct callers.
    flag = host_flag(found_non_finite)
    norm = host_norm(grad_norm) if spiking else None
    named: list[tuple[str, Any]] = []
    if flag is None:
        named.append(("found_non_finite", found_non_finite))
    if spiking and norm is None:
        named.append(("grad_norm", device_norm(grad_norm)))
    named.extend((f"state.{n}", getattr(state, n)) for n in DATA_FIELDS)
    device = one_library(*named)
    if device is None:
        if state.on_host:
            return host_update(state, bool(flag), norm)
        backend = backend_for(state.scale, root="state.scale")
    else:
        _, label, value = device
        backend = backend_for(value, root=label)
    if not spiking:  # backends written before spike skipping take two arguments
        return backend.update(state, found_non_finite)
    return backend.update(state, found_non_finite, grad_norm)


# ------------------------------------------------------------------ user policies
# A user's policy is called here, and only here, for every caller (LossScaler(policy=),
# simulate, check_policy), so it means one thing wherever it runs.

#: ``policy(state, found) -> state``; ``policy(state, found, grad_norm)`` under spike skipping.
Policy = Callable[..., ScalerState]
#: A policy as every caller calls it: ``step(state, found, grad_norm)``; the norm may be
#: ``None`` with spike skipping off.
PolicyStep = Callable[[ScalerState, Any, Any], ScalerState]

#: How many arguments a policy is called with: (state, found), and (state, found, grad_norm).
_PLAIN, _SPIKING = 2, 3


def policy_name(policy: object) -> str:
    """How messages name a user's policy: its qualified name, else its repr."""
    name = getattr(policy, "__qualname__", None)
    return name if isinstance(name, str) else repr(policy)


def policy_step(name: str, config: ScalerConfig, policy: Policy) -> PolicyStep:
    """``policy`` as the core calls it under ``config``: ``step(state, found, grad_norm)``.

    With spike skipping off, ``policy(state, found)``. With it on,
    ``policy(state, found, grad_norm)``, or, for a policy of two arguments (which
    cannot see the norm), :func:`_spike_skipping`. A policy that cannot take its
    arguments is refused here, before any step. What the step returns is the
    policy's, unchecked: see :func:`policy_result`.

    Args:
        name: The policy as the message names it (``"'mine'"``, ``"my_policy"``).
        config: The config of the states the step will be given.
        policy: The user's transition.

    Returns:
        The step function.

    Raises:
        InvalidArgumentError: ``policy`` cannot be called with the arguments
            ``config`` needs.
    """
    spiking = config.spike_threshold is not None
    try:
        signature = inspect.signature(policy)
    except (TypeError, ValueError):  # no signature to read (some builtins): call as documented
        takes = {_SPIKING if spiking else _PLAIN}
    else:
        takes = {n for n in (_PLAIN, _SPIKING) if _binds(signature, n)}
    if spiking and _SPIKING in takes:
        return _with_norm(policy)
    if _PLAIN in takes:
        return _spike_skipping(policy) if spiking else _without_norm(policy)
    if spiking:
        called, fix = "policy(state, found, grad_norm)", "take (state, found), or add grad_norm"
    elif _SPIKING in takes:
        called = "policy(state, found)"
        fix = "give grad_norm a default (grad_norm=None), or turn spike skipping on"
    else:
        called, fix = "policy(state, found)", "take (state, found)"
    raise InvalidArgumentError(
        f"policy {name} takes {_brief_signature(signature)}, but its config has spike "
        f"skipping {'on' if spiking else 'off'}, so it is called as {called}: {fix}"
    )


def policy_result(name: str, new: object) -> ScalerState:
    """``new``, the state a policy returned, or the refusal naming the policy."""
    if not isinstance(new, ScalerState):
        raise InvalidStateError(
            f"policy {name} returned {new!r}, but it must return a ScalerState "
            f"(build it with dataclasses.replace(state, ...))"
        )
    return new


def _binds(signature: inspect.Signature, n: int) -> bool:
    try:
        signature.bind(*range(n))
    except TypeError:
        return False
    return True


def _brief_signature(signature: inspect.Signature) -> str:
    """``(state, found)``: the parameters' names, without annotations or defaults."""
    return "(" + ", ".join(signature.parameters) + ")"


def _without_norm(policy: Policy) -> PolicyStep:
    def step(state: ScalerState, found: Any, grad_norm: Any = None) -> ScalerState:
        return policy(state, found)

    return step


def _with_norm(policy: Policy) -> PolicyStep:
    def step(state: ScalerState, found: Any, grad_norm: Any) -> ScalerState:
        if grad_norm is None:  # as update() refuses it: the policy would get no norm
            raise norm_missing_error(state.config)
        return policy(state, found, grad_norm)

    return step


def _spike_skipping(policy: Policy) -> PolicyStep:
    """A two-argument ``policy(state, found)`` under spike skipping.

    It cannot see the norm, so the spike rule stays the core's: a step that
    :func:`update` finds to be a spike is ``update``'s own (``SPIKE_SKIP``: only
    the skip counters and the window move, and a passed ``max_consecutive_skips``
    raises), and ``policy`` is not called. Every other step is ``policy``'s, run
    on the state with spike skipping off in its config (so it may call
    ``update(state, found)`` as usual); its result gets the config back and the
    window statistics ``update`` keeps (moved on a step with finite gradients,
    left on one without).
    """

    def step(state: ScalerState, found: Any, grad_norm: Any) -> ScalerState:
        config = state.config
        if grad_norm is None:
            raise norm_missing_error(config)
        window = state
        if not found:
            window = update(state, False, grad_norm=grad_norm)
            if step_skipped(window):  # a spike: finite gradients, skipped
                return window
        plain = dataclasses.replace(config, spike_threshold=None)
        new: object = policy(dataclasses.replace(state, config=plain), found)
        if not isinstance(new, ScalerState):  # the caller refuses it, in its own words
            return new  # type: ignore[return-value]
        return dataclasses.replace(
            new,
            config=config,
            norm_mean=window.norm_mean,
            norm_var=window.norm_var,
            norm_count=window.norm_count,
        )

    return step


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
    return _ops.unscale(resolve_backend(backend, grads), grads, scale)


def unscale_and_norm(
    grads: Any, scale: float | Any | ScalerState, *, backend: str | Backend | None = None
) -> tuple[Any, Any, Any]:
    """:func:`unscale`, plus the global L2 norm of the unscaled gradients, in one pass.

    The norm (float32, kept on the device) is accumulated in float64 and rounded
    once: within one float32 ulp of the exact norm, and NaN or inf when ``found``
    is true. See :meth:`Backend.measure`.

    Returns:
        ``(grads, found, norm)``.

    >>> import numpy as np
    >>> g = {"w": np.array([6.0, 8.0], np.float32)}
    >>> _, found, norm = unscale_and_norm(g, 2.0)
    >>> g["w"].tolist(), bool(found), float(norm)
    ([3.0, 4.0], False, 5.0)
    """
    if isinstance(scale, ScalerState):
        scale = scale.scale
    return _ops.unscale_and_norm(resolve_backend(backend, grads), grads, scale)


def unscale_and_clip(
    grads: Any,
    scale: float | Any | ScalerState,
    max_norm: float,
    *,
    backend: str | Backend | None = None,
) -> tuple[Any, Any, Any]:
    """Unscale, detect and clip to ``max_norm`` in two reads and one write, or leave alone.

    One read gives the flag and the norm of the unscaled gradients; when the step
    is skipped (``found``), nothing is written and the gradients keep their scaled
    values; otherwise one more pass stores each unscaled value times PyTorch's
    ``clip_grad_norm_`` coefficient, ``min(1, max_norm / (norm + 1e-6))`` formed in
    float32 as PyTorch forms it. Equivalent to ``unscale`` then
    ``torch.nn.utils.clip_grad_norm_(params, max_norm)``, for a step that is taken.
    See :meth:`Backend.measure` and :meth:`Backend.clip`.

    Returns:
        ``(grads, found, norm)``: ``norm`` is the norm before clipping, as
        ``clip_grad_norm_`` returns it.

    Raises:
        InvalidArgumentError: ``max_norm`` is not a positive finite number.

    >>> import numpy as np
    >>> g = {"w": np.array([6.0, 8.0], np.float32)}
    >>> _, found, norm = unscale_and_clip(g, 2.0, max_norm=1.0)
    >>> [round(v, 6) for v in g["w"].tolist()], bool(found), float(norm)
    ([0.6, 0.8], False, 5.0)
    """
    if isinstance(scale, ScalerState):
        scale = scale.scale
    return _ops.unscale_and_clip(resolve_backend(backend, grads), grads, scale, max_norm)


def find_non_finite(grads: Any, *, backend: str | Backend | None = None) -> Any:
    """Whether any element of any gradient is NaN or inf; modifies nothing.

    >>> import numpy as np
    >>> bool(find_non_finite([np.array([1.0, np.inf])]))
    True
    """
    return _ops.find_non_finite(resolve_backend(backend, grads), grads)
