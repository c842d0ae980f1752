"""The rule of the transition: stated once, read by the host and by every device.

Theory of operation
-------------------
One step is one call of ``update(state, found_non_finite, grad_norm=None)`` on a
:class:`~scaler_core._state.ScalerState`. It *classifies* the step into a
:class:`~scaler_core._state.StepKind` and applies that kind:

* Clean step, dynamic scale: ``growth_tracker += 1``. When it reaches
  ``growth_interval`` the candidate ``f32(scale * growth_factor)`` replaces the
  scale if it is finite and not above ``max_scale`` (GROW), otherwise the scale
  stays (GROWTH_BLOCKED) or, with ``at_max_scale="clamp"``, becomes the ceiling
  (``max_scale``, or the largest float32 without one; GROW if that is above the
  scale); either way the tracker returns to 0 and, with
  ``hysteresis_refill="on_growth"``, the hysteresis budget refills.
  Otherwise COUNT. With ``hysteresis_refill="on_clean_step"`` (or
  ``"on_clean_step_or_backoff"``) every clean step refills the budget.
  With ``growth_delay=d`` the growth is due when the tracker reaches
  ``growth_interval + d`` and a growth sets it to ``d`` instead of 0: the first
  ``d`` clean steps after a non-finite step (or the start) do not count
  (DeepSpeed >= 0.17.1 grows first after ``scale_window + 1`` clean steps).
* Non-finite step, dynamic scale: ``growth_tracker = 0``. While more than one
  hysteresis credit is left, one is spent and the scale stays (HYSTERESIS).
  Otherwise the scale becomes ``f32(scale * backoff_factor)``, raised to
  ``min_scale`` if that is set (BACKOFF); a scale already at ``min_scale`` stays
  (HOLD_AT_FLOOR) or, with ``at_min_scale="raise"``, fails (FLOOR_RAISE).
  With ``hysteresis_refill="on_clean_step_or_backoff"`` a BACKOFF or
  HOLD_AT_FLOOR also refills the hysteresis budget (Paddle).
  Without a floor, a backoff that would give 0, a subnormal or a non-finite
  value fails (COLLAPSE).
* Static scale: the scale and trackers never change (STATIC_CLEAN, STATIC_SKIP).
* Spike skipping (only with ``spike_threshold=k``; off by default, and then
  ``grad_norm`` is ignored and the statistics never change): with ``x`` the
  step's gradient norm as a float32, ``d = x - norm_mean`` and ``W =
  spike_window``, a step whose gradients are finite is a spike once the window
  is full (``norm_count >= W``) when ``d > 0`` and ``d*d > k*k * norm_var``
  (``x = +inf`` is a spike, NaN never is). A spike is skipped (SPIKE_SKIP) and
  changes nothing but the skip counters: the scale, the growth and the
  hysteresis trackers stay. Every step with finite gradients and a finite norm,
  spikes included (so a lasting shift of the norm is absorbed within about a
  window), updates the statistics with ``n = min(norm_count + 1, W)`` and ``a =
  1/n``: ``norm_mean += a*d``, ``norm_var = (1 - a) * (norm_var + a*d*d)``,
  ``norm_count = n``; a step whose statistics would overflow float32 leaves them
  as they were. Every operation is rounded to float32 and a subnormal result is
  flushed to 0 (as XLA does), so the host and every device agree bit for bit.
  Non-finite gradients take precedence: their rules apply, statistics untouched.
  With spike skipping off the statistics are static: :func:`device_update`
  passes them through as they are (no arithmetic, no conversion), and under JAX
  they are pytree auxiliary data beside the config, not leaves, so a jitted step
  neither receives nor returns them (the field declaration says so, with
  ``static_when``; :mod:`scaler_core._registration` reads it).
* Every step: ``steps += 1``; a non-finite or spike step is skipped
  (``skipped_steps`` and ``consecutive_skips`` += 1), any other zeroes
  ``consecutive_skips``; ``last_kind`` records the step's
  :attr:`StepKind.code`. A step that would take ``consecutive_skips`` past
  ``max_consecutive_skips`` fails (SKIP_LIMIT). Counters saturate at int32 max
  instead of wrapping.

Invariants, after every step that did not fail: the scale is a finite, positive,
normal float32 within ``[min_scale, max_scale]``; ``0 <= growth_tracker <
growth_interval + growth_delay`` from a state that held it (a state whose interval
was shortened below its tracker, as PyTorch's ``set_growth_interval`` allows, counts
on without growing until a backoff, as PyTorch's kernel does); ``1 <=
hysteresis_tracker <= hysteresis``; ``consecutive_skips <= skipped_steps <= steps``;
``norm_mean`` and ``norm_var`` are finite float32 values, ``norm_var >= 0``, ``0 <=
norm_count <= spike_window``; ``last_kind`` is 0 or the code of a kind that does not
fail.

One rule, two readers: :func:`advance` states the rule once, branch-free (its
Python branches read only the config), over an array namespace ``xp``: every
choice is an ``xp.where``, every float32 operation is rounded with
``xp.asarray(..., dtype=xp.float32)``. A device runs it on 0-d arrays (traced once
under ``jax.jit``, on CuPy, torch devices, MLX, any Array API library), the host on
Python scalars (:data:`HOST`: ``where(c, a, b)`` is ``a if c else b``, float32
rounding is :func:`~scaler_core._f32.f32`), so the two agree by construction. The
host keeps Python scalars rather than NumPy's 0-d arrays, which cost some fifteen
times as much a step (``benchmarks/bench_transition.py``), and shortcuts that give the
same values: its flush of a subnormal is a Python branch (:func:`_flusher`), its
product is ``f32(value * factor)`` as defined (:func:`_product`) and, as Python
rounds subnormals as IEEE does, needs no correction for a device that flushes them
(:func:`_backoff_product`), and it remembers a step's weights in the window
(:func:`_weights`).

What differs is what each does with a refused step (failing closed), which
:mod:`scaler_core._state` decides: the host raises and the caller's state is
untouched; a device cannot raise, and keeps the old state with the refusal's code
in ``failure``, which freezes it until the first host-side look raises the same
error. This module names the outcomes; the state's table numbers them
(:class:`Codes`), so the rule sits below the state and imports nothing of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from ._coerce import (
    array_library,
    describe,
    device_norm,
    host_norm,
    mixed_error,
    module_library,
    norm_missing_error,
)
from ._config import ScalerConfig
from ._errors import GradientTypeError
from ._f32 import FLT_MAX, FLT_MIN, INT32_MAX, f32, is_f32_exact

__all__ = ["HOST", "Codes", "ScalarNamespace", "advance", "device_x", "host_x"]


@dataclasses.dataclass(frozen=True, slots=True)
class Codes:
    """The int code of each outcome the rule writes, by the rule's name for it.

    The state's table numbers them (the :class:`~scaler_core._state.StepKind` codes
    of the kinds a step can take, and the :class:`~scaler_core._state.Failure` codes
    of its refusals) and hands them in; the rule names outcomes and never numbers
    them.
    """

    count: int
    grow: int
    growth_blocked: int
    hysteresis: int
    backoff: int
    hold_at_floor: int
    static_clean: int
    static_skip: int
    spike_skip: int
    collapse: int
    floor_raise: int
    skip_limit: int


class ScalarNamespace:
    """Python scalars as the array namespace of :func:`advance`: the host's reading of
    the rule, on a ``float`` scale, ``int`` counters and ``bool`` flags.

    ``where(c, a, b)`` is ``a if c else b``; ``float32`` rounds a Python float to the
    nearest float32 (:func:`~scaler_core._f32.f32`), ``float64`` and ``int32`` are
    ``float`` and ``int``, ``asarray(value, dtype)`` is ``dtype(value)``. Python's
    float arithmetic is float64, which the rule rounds back to float32 after every
    operation: one rounding of the float64 result of ``+ - * /`` on two float32
    values is the float32 result (float64 carries more than twice float32's digits).

    >>> HOST.where(True, 1, 2), HOST.asarray(0.1, dtype=HOST.float32)
    (1, 0.10000000149011612)
    """

    float32 = staticmethod(f32)
    float64 = float
    int32 = int
    isfinite = staticmethod(math.isfinite)
    maximum = staticmethod(max)

    @staticmethod
    def asarray(value: Any, dtype: Any = None) -> Any:
        return value if dtype is None else dtype(value)

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b


#: The host's namespace: the rule run on Python scalars.
HOST = ScalarNamespace()


def host_x(cfg: ScalerConfig, grad_norm: object) -> float | None:
    """The step's norm as the rule reads it (float32, flushed); ``None`` when spikes are off."""
    if cfg.spike_threshold is None:
        return None
    if grad_norm is None:
        raise norm_missing_error(cfg)
    value = host_norm(grad_norm)
    if value is None:
        raise GradientTypeError(
            f"grad_norm={describe(device_norm(grad_norm))} is a device array, but a host "
            f"state with a host flag steps on the host; pass a host norm, or use "
            f"scaler_core.update, which moves the step to the norm's device"
        )
    return _host_ftz(value)


def device_x(xp: Any, cfg: ScalerConfig, grad_norm: Any, ours: tuple[str, str, Any]) -> Any:
    """The step's norm as a 0-d float32 array of ``xp``, flushed (:func:`_flusher`).

    A device norm must come from ``ours[0]``, the library of the flag ``ours[2]``. A
    negative device norm cannot be refused without reading it back (a host
    synchronisation); it counts as NaN (no spike, statistics untouched), so a wrong
    norm never moves the window.
    """
    if grad_norm is None:
        raise norm_missing_error(cfg)
    value = host_norm(grad_norm)
    if value is None:
        value = device_norm(grad_norm)
        if array_library(value) != ours[0]:
            raise mixed_error(ours, (module_library(value), "grad_norm", value))
    x = xp.asarray(value, dtype=xp.float32)
    return _flusher(xp)(xp.where(x < 0.0, xp.float32(math.nan), x))


# -------------------------------------------------------------------- the rule
def advance(xp: Any, state: Any, found: Any, x: Any, code: Codes) -> dict[str, Any]:  # noqa: PLR0912, PLR0915 - the whole rule, top to bottom
    """The data fields after one step, with the refusal of a failing step in ``failure``.

    The whole rule, as the module docstring states it, written once for the host
    and every device: Python branches read only the config; every choice that
    depends on the state is an ``xp.where``, so one trace serves every step. Where
    a field is chosen twice, the later choice wins: a non-finite step's over a
    clean step's (a spike's gradients are finite, so it never meets the former).

    Args:
        xp: The namespace: :data:`HOST` for Python scalars, or a device's.
        state: The :class:`~scaler_core._state.ScalerState` before the step, its
            fields values of ``xp``.
        found: The flag, a bool value of ``xp``.
        x: The step's norm, a float32 value of ``xp`` (flushed: :func:`host_x`,
            :func:`device_x`), or ``None`` with spike skipping off.
        code: The codes to write for the step's kind and refusal.

    Returns:
        The data fields after the step by name, values of ``xp`` (the window
        statistics as they were with spike skipping off). ``failure`` is the code of
        this step's refusal (0 for none) and ``last_kind`` the code of its kind; a
        refused step's other fields are meaningless: the caller raises, or keeps the
        old state.

    >>> from scaler_core import init
    >>> from scaler_core._state import _CODES
    >>> fields = advance(HOST, init(), True, None, _CODES)
    >>> fields["scale"], fields["growth_tracker"], fields["skipped_steps"], fields["failure"]
    (32768.0, 0, 1, 0)
    """
    cfg = state.config
    where, f32_, i32 = xp.where, xp.float32, xp.int32
    scale, growth, hyst = state.scale, state.growth_tracker, state.hysteresis_tracker
    consec = state.consecutive_skips
    mean, var, count = state.norm_mean, state.norm_var, state.norm_count
    skip = found
    if x is not None:
        spike, mean, var, count = _window(xp, cfg, state, found, x)
        skip = found | spike
    fail = xp.asarray(0, dtype=i32)  # no refusal
    kind = xp.asarray(code.count if cfg.dynamic else code.static_clean, dtype=i32)
    if cfg.dynamic:
        # A clean step counts; the one that fills the interval is due to grow.
        counted = growth + 1
        due = where(skip, False, counted == cfg.growth_interval + cfg.growth_delay)
        grown = _product(xp, scale, cfg.growth_factor)
        fits = xp.isfinite(grown)
        if cfg.max_scale is not None:
            fits = fits & (grown <= f32_(cfg.max_scale))
        if cfg.at_max_scale == "clamp":
            grown = where(fits, grown, f32_(FLT_MAX if cfg.max_scale is None else cfg.max_scale))
        else:
            grown = where(fits, grown, scale)
        kind = where(due, code.growth_blocked, kind)
        kind = where(due & (grown > scale), code.grow, kind)
        # A non-finite step spends a hysteresis credit while more than one is left,
        # else backs off: to the floor at most, or failing on a collapse.
        absorbed = found & (hyst > 1)
        backing_off = found & (hyst <= 1)
        backed = _backoff_product(xp, scale, cfg.backoff_factor)
        kind = where(backing_off, code.backoff, kind)
        if cfg.min_scale is None:
            normal = (backed >= FLT_MIN) & (backed <= FLT_MAX)  # not 0, subnormal, inf, NaN
            fail = where(normal, fail, where(backing_off, code.collapse, fail))
        else:
            backed = xp.maximum(backed, f32_(cfg.min_scale))
            at_floor = backing_off & (scale <= f32_(cfg.min_scale))
            kind = where(at_floor, code.hold_at_floor, kind)
            if cfg.at_min_scale == "raise":
                fail = where(at_floor, code.floor_raise, fail)
        kind = where(absorbed, code.hysteresis, kind)
        scale = where(backing_off, backed, where(due, grown, scale))
        # The budget refills on a growth, or on every clean step (and on a backoff).
        if cfg.hysteresis_refill == "on_growth":
            refilled = where(due, cfg.hysteresis, hyst)
        else:
            refilled = where(skip, hyst, cfg.hysteresis)
            if cfg.hysteresis_refill == "on_clean_step_or_backoff":
                refilled = where(backing_off, cfg.hysteresis, refilled)
        hyst = where(absorbed, hyst - 1, refilled)
        if x is not None:
            counted = where(spike, growth, counted)  # a spike does not count
        growth = where(found, 0, where(due, cfg.growth_delay, counted))
    else:
        kind = where(found, code.static_skip, kind)
    if x is not None:
        kind = where(spike, code.spike_skip, kind)
    if cfg.max_consecutive_skips is not None:
        # The skip limit takes precedence over every other refusal.
        over = skip & (consec + 1 > cfg.max_consecutive_skips)
        fail = where(over, code.skip_limit, fail)
    return {
        "scale": scale,
        "growth_tracker": growth,
        "hysteresis_tracker": hyst,
        "steps": _sat_inc(xp, state.steps),
        "skipped_steps": where(skip, _sat_inc(xp, state.skipped_steps), state.skipped_steps),
        "consecutive_skips": where(skip, _sat_inc(xp, consec), 0),
        "failure": fail,
        "norm_mean": mean,
        "norm_var": var,
        "norm_count": count,
        "last_kind": kind,
    }


def _sat_inc(xp: Any, n: Any) -> Any:
    """``n + 1``, saturating at int32 max instead of wrapping."""
    return xp.where(n < INT32_MAX, n + 1, n)


# ------------------------------------------------------------- spike skipping
def _window(xp: Any, cfg: ScalerConfig, state: Any, found: Any, x: Any) -> Any:
    """``(spike, norm_mean, norm_var, norm_count)`` after a step of norm ``x``: the
    spike arithmetic, every operation rounded to float32 and flushed (:func:`_flusher`).

    Its constants are Python floats that float32 holds: an operation a library forms
    in float64 instead (NumPy 1 with 0-d arrays) is still rounded once to float32
    before the next, which gives the float32 result.
    """
    where, ftz = xp.where, _flusher(xp)
    mean, var, count = state.norm_mean, state.norm_var, state.norm_count
    window = cfg.spike_window
    d = ftz(x - mean)
    dd = ftz(d * d)
    spike = (count >= window) & (d > 0.0) & (dd > ftz(_squared(cfg.spike_threshold) * var))
    usable = where(found, False, xp.isfinite(x) & xp.isfinite(dd))
    # Unusable steps compute on zeros, so no inf * 0 is ever formed (its result is dropped).
    d, dd = where(usable, d, 0.0), where(usable, dd, 0.0)
    n = where(count < window, count + 1, window)
    a, rest = _host_weights(n) if xp is HOST else _weights(xp, n)
    new_mean = ftz(mean + ftz(a * d))
    new_var = ftz(rest * ftz(var + ftz(a * dd)))
    usable = usable & xp.isfinite(new_mean) & xp.isfinite(new_var)
    return (
        where(found, False, spike),
        where(usable, new_mean, mean),
        where(usable, new_var, var),
        where(usable, n, count),
    )


def _weights(xp: Any, n: Any) -> tuple[Any, Any]:
    """``(a, 1 - a)`` with ``a = 1/n``, rounded and flushed: the weights of the step and of
    the window before it."""
    ftz = _flusher(xp)
    a = ftz(1.0 / xp.asarray(n, dtype=xp.float32))  # exact count: spike_window <= 2**24
    return a, ftz(1.0 - a)


#: The host's weights, remembered: ``n`` takes one value once the window is full.
_host_weights = functools.lru_cache(maxsize=256)(functools.partial(_weights, HOST))


def _flusher(xp: Any) -> Callable[[Any], Any]:
    """The function that rounds a value of ``xp`` to float32 and makes a subnormal 0.0
    (XLA flushes them, so every path does)."""
    if xp is HOST:  # the same test, a Python branch on a Python float
        return _host_ftz
    asarray, where, f32_ = xp.asarray, xp.where, xp.float32

    def ftz(value: Any) -> Any:
        value = asarray(value, dtype=f32_)
        return where((value > -FLT_MIN) & (value < FLT_MIN), 0.0, value)

    return ftz


def _host_ftz(value: float) -> float:
    value = f32(value)
    return 0.0 if -FLT_MIN < value < FLT_MIN else value


@functools.cache
def _squared(k: float) -> float:
    """``k*k`` as a float32 (the spike test's threshold on ``d*d``)."""
    return f32(k * k)


# ------------------------------------------------------------------ products
#: The float32 just below 2**-102: a product ``p`` with ``p * 2**24`` at least this
#: rounds (ties to even) to FLT_MIN, not to a subnormal.
_BELOW_2_102 = (2.0**24 - 1) * 2.0**-126


def _product(xp: Any, value: Any, factor: float) -> Any:
    """``f32(value * factor)``, correctly rounded, on values of ``xp``.

    A factor that float32 holds exactly is multiplied in float32 (the product is
    then the correctly rounded one). Any other factor (PyTorch accepts
    ``backoff_factor=0.9``) is multiplied in float64 and rounded once to float32,
    as PyTorch's kernels do. On the host this is the definition itself: Python's
    float64 product of the two, rounded once.
    """
    if xp is HOST:
        return f32(value * factor)
    if is_f32_exact(factor):
        return xp.asarray(value * factor, dtype=xp.float32)
    wide = xp.asarray(value, dtype=xp.float64) * xp.float64(factor)
    return xp.asarray(wide, dtype=xp.float32)


def _backoff_product(xp: Any, scale: Any, factor: float) -> Any:
    """``f32(scale * factor)`` as IEEE rounds it, also where the device flushes subnormals.

    XLA (CPU and GPU) flushes a subnormal float32 result to 0, which would turn a
    product that IEEE rounds *up* to FLT_MIN (``FLT_MIN * (1 - 2**-24)`` is such a
    tie) into a recorded collapse the host does not see. The same product taken
    ``2**24`` higher is normal, and rounding is monotonic, so comparing it with the
    float32 just below ``2**-102`` says whether IEEE gives FLT_MIN.
    """
    backed = _product(xp, scale, factor)
    if xp is HOST:  # Python's float32 rounding keeps subnormals: nothing to correct
        return backed
    high = _product(xp, scale * 2.0**24, factor)
    rounds_to_min = (backed < FLT_MIN) & (high >= _BELOW_2_102)
    return xp.where(rounds_to_min, xp.float32(FLT_MIN), backed)
