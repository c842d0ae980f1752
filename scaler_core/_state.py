"""The scaler state and every rule of its transition.

Theory of operation
-------------------
A :class:`ScalerState` holds a float32 ``scale``, int32 counters and, for spike
skipping, float32 window statistics of the gradient norm. One step is one call of
``update(state, found_non_finite, grad_norm=None)``; it first *classifies* the
step into a :class:`StepKind`, then applies that kind. The rules:

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
growth_interval + growth_delay`` from a state that held it (a state whose interval was shortened
below its tracker, as PyTorch's ``set_growth_interval`` allows, counts on without
growing until a backoff, as PyTorch's kernel does); ``1 <= hysteresis_tracker <=
hysteresis``;
``consecutive_skips <= skipped_steps <= steps``; ``norm_mean`` and ``norm_var``
are finite float32 values, ``norm_var >= 0``, ``0 <= norm_count <=
spike_window``; ``last_kind`` is 0 or the code of a kind that does not fail.

Failing closed: on the host a failing step raises :class:`ScaleCollapseError`
(or :class:`SkipLimitError`) and returns nothing, so the caller's state is
untouched. On a device (inside ``jax.jit``, on CuPy arrays) a step cannot raise;
:func:`device_update` runs the same rules branch-free with ``where`` and, on a
failing step, returns the input state unchanged except for a nonzero
``failure`` code, which freezes the state. The first host-side look
(:meth:`ScalerState.check`, :meth:`ScalerState.current_scale`, serialisation)
raises the same error. The host and device paths are tested to agree.

Why two forms of one rule: :func:`device_update` runs on the host too (through
NumPy), but there it costs about twenty times :func:`host_update` on every step
(146 us against 6.5 us, ``benchmarks/bench_transition.py``; with the drop-in's torch
namespace on CPU tensors 70 times), so host states keep the host form. The step
kinds, their codes and which of them skip or fail are one table
(:class:`StepKind`), read by both.
"""

from __future__ import annotations

import dataclasses
import enum
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
from ._errors import (
    GradientTypeError,
    InvalidArgumentError,
    InvalidStateError,
    ReplicaMismatchError,
    ScaleCollapseError,
    SkipLimitError,
)
from ._f32 import FLT_MAX, FLT_MIN, INT32_MAX, f32, is_f32_exact, is_normal_f32
from ._registration import declare, register_loaded, static_data, static_value

__all__ = [
    "COUNTER_FIELDS",
    "DATA_FIELDS",
    "FLOAT_FIELDS",
    "SKIPPED_CODES",
    "SPIKE_FIELDS",
    "Failure",
    "ScalerState",
    "StepKind",
    "classify",
    "convert_fields",
    "device_update",
    "host_outcome",
    "host_update",
    "init",
    "require_state",
    "start_state",
    "step_skipped",
]


class StepKind(enum.Enum):
    """What one step does to the state, decided before anything is applied."""

    COUNT = "count"
    GROW = "grow"
    GROWTH_BLOCKED = "growth_blocked"
    HYSTERESIS = "hysteresis"
    BACKOFF = "backoff"
    HOLD_AT_FLOOR = "hold_at_floor"
    STATIC_CLEAN = "static_clean"
    STATIC_SKIP = "static_skip"
    COLLAPSE = "collapse"
    FLOOR_RAISE = "floor_raise"
    SKIP_LIMIT = "skip_limit"
    SPIKE_SKIP = "spike_skip"

    @property
    def code(self) -> int:
        """The kind's stable int code, as ``ScalerState.last_kind`` stores it (0: no step)."""
        return _CODE_OF_KIND[self]

    @classmethod
    def from_code(cls, code: int) -> StepKind | None:
        """The kind of a code (``None`` for 0, the code of "no step yet").

        Raises:
            InvalidArgumentError: ``code`` is not 0 nor the code of a kind.

        >>> StepKind.from_code(StepKind.SPIKE_SKIP.code)
        <StepKind.SPIKE_SKIP: 'spike_skip'>
        """
        if code == 0 and not isinstance(code, bool):
            return None
        kind = _KIND_OF_CODE.get(code) if type(code) is int else None
        if kind is None:
            raise InvalidArgumentError(
                f"code={code!r}, but it must be 0 or one of {sorted(_KIND_OF_CODE)} "
                f"(the StepKind codes)"
            )
        return kind

    @property
    def fails(self) -> bool:
        """Whether this step is refused (fail-closed)."""
        return self in _FAILING

    @property
    def skipped(self) -> bool:
        """Whether the optimizer step is skipped (non-finite gradients, or a spike)."""
        return self in _SKIPPED


class Failure(enum.IntEnum):
    """The ``failure`` code a device state records instead of raising."""

    NONE = 0
    COLLAPSE = 1
    FLOOR_RAISE = 2
    SKIP_LIMIT = 3


_FAILING = frozenset({StepKind.COLLAPSE, StepKind.FLOOR_RAISE, StepKind.SKIP_LIMIT})
_SKIPPED = frozenset(
    {
        StepKind.HYSTERESIS,
        StepKind.BACKOFF,
        StepKind.HOLD_AT_FLOOR,
        StepKind.STATIC_SKIP,
        StepKind.COLLAPSE,
        StepKind.FLOOR_RAISE,
        StepKind.SKIP_LIMIT,
        StepKind.SPIKE_SKIP,
    }
)
#: Stable codes: never renumber one (checkpoints store them); append new kinds.
_CODE_OF_KIND = {kind: code for code, kind in enumerate(StepKind, start=1)}
_KIND_OF_CODE = {code: kind for kind, code in _CODE_OF_KIND.items()}
#: The codes of the kinds whose optimizer step is skipped (from :attr:`StepKind.skipped`).
SKIPPED_CODES = tuple(sorted(code for kind, code in _CODE_OF_KIND.items() if kind.skipped))
#: The codes ``last_kind`` can hold: no step yet, or a step that was applied.
LAST_KIND_CODES = frozenset({0} | {c for k, c in _CODE_OF_KIND.items() if k not in _FAILING})
_FAILURE_OF_KIND = {
    StepKind.COLLAPSE: Failure.COLLAPSE,
    StepKind.FLOOR_RAISE: Failure.FLOOR_RAISE,
    StepKind.SKIP_LIMIT: Failure.SKIP_LIMIT,
}

#: The float32 data fields; every other data field is an int32 counter.
FLOAT_FIELDS = ("scale", "norm_mean", "norm_var")
#: The fields spike skipping added (schema version 2); older checkpoints lack them.
SPIKE_FIELDS = ("norm_mean", "norm_var", "norm_count", "last_kind")
#: The int32 data fields (counters, codes).
COUNTER_FIELDS = (
    "growth_tracker",
    "hysteresis_tracker",
    "steps",
    "skipped_steps",
    "consecutive_skips",
    "failure",
    "norm_count",
    "last_kind",
)


def _spikes_off(state: ScalerState) -> bool:
    """Whether ``state``'s config leaves spike skipping off: then its window statistics
    never change, and are static data (under JAX, not leaves). Reads only the config."""
    return state.config.spike_threshold is None


#: The declaration of a window statistic: a data field, static while spike skipping is off.
_STAT = {"static": False, "static_when": _spikes_off}


@dataclasses.dataclass(frozen=True)
class ScalerState:
    """The immutable state of one scaler: the scale and its counters.

    Fields hold Python scalars on the host, or 0-d arrays (float32 scale, int32
    counters) on a device. Build one with :func:`init`; advance it with
    :func:`scaler_core.update`. No value checks run here (they would break under
    ``jax.jit``): :func:`scaler_core.from_dict` validates loaded states, and
    :func:`scaler_core.to_dict` refuses to save one it would not load (so a state
    built by hand out of range fails at the save, not at the resume).

    Attributes:
        config: The static :class:`ScalerConfig`.
        scale: The current loss scale, a float32 value. Read it with
            :meth:`current_scale`, which checks for a recorded failure.
        growth_tracker: Clean steps since the last growth or backoff.
        hysteresis_tracker: Overflows still needed before the next backoff, in
            ``[1, hysteresis]``: at 1 the next overflow backs off. (Megatron's own
            tracker counts on past its last credit, 0, -1, ...; each is 1 here.)
        steps: Steps taken (updates), saturating at int32 max.
        skipped_steps: Steps skipped for non-finite gradients.
        consecutive_skips: Skipped steps since the last clean one.
        failure: 0, or the :class:`Failure` a device transition recorded.
        norm_mean: Spike skipping's rolling mean of the gradient norm (float32).
        norm_var: Its rolling variance (float32, >= 0).
        norm_count: Steps in the window so far, saturating at ``spike_window``.
            With spike skipping off, these three never change and stay host
            values (under JAX, static pytree data beside the config).
        last_kind: The :attr:`StepKind.code` of the last step (0: none yet);
            :attr:`last_step` reads it as a :class:`StepKind`.
    """

    config: ScalerConfig = dataclasses.field(metadata={"static": True})
    scale: Any = dataclasses.field(metadata={"static": False})
    growth_tracker: Any = dataclasses.field(default=0, metadata={"static": False})
    hysteresis_tracker: Any = dataclasses.field(default=1, metadata={"static": False})
    steps: Any = dataclasses.field(default=0, metadata={"static": False})
    skipped_steps: Any = dataclasses.field(default=0, metadata={"static": False})
    consecutive_skips: Any = dataclasses.field(default=0, metadata={"static": False})
    failure: Any = dataclasses.field(default=0, metadata={"static": False})
    norm_mean: Any = dataclasses.field(default=0.0, metadata=_STAT)
    norm_var: Any = dataclasses.field(default=0.0, metadata=_STAT)
    norm_count: Any = dataclasses.field(default=0, metadata=_STAT)
    last_kind: Any = dataclasses.field(default=0, metadata={"static": False})

    def __post_init__(self) -> None:
        # No value checks here (they break under jit/vmap). Only make sure that a
        # state can be handed to JAX whenever JAX is loaded, without this module
        # ever importing JAX itself.
        register_loaded()

    @property
    def on_host(self) -> bool:
        """Whether every field is a plain Python scalar (not a device array)."""
        return all(isinstance(getattr(self, n), float) for n in FLOAT_FIELDS) and all(
            type(getattr(self, n)) is int for n in COUNTER_FIELDS
        )

    @property
    def last_step(self) -> StepKind | None:
        """The :class:`StepKind` of the last step, ``None`` before the first.

        On a device state this reads one value back to the host.

        >>> from scaler_core import init, update
        >>> init().last_step is None, update(init(), True).last_step
        (True, <StepKind.BACKOFF: 'backoff'>)
        """
        return StepKind.from_code(_one_value(self, "last_kind", int))

    def check(self) -> ScalerState:
        """Raise the error a device transition recorded; return the state otherwise.

        On a device state this reads one value back to the host. A replicated
        state (every field with a leading replica axis, as ``jax.pmap`` returns
        it) is read as one state when every replica holds the same values.

        Raises:
            ScaleCollapseError: A transition collapsed or hit a failing floor.
            SkipLimitError: The consecutive-skip limit was passed.
            ReplicaMismatchError: The replicas of a replicated state disagree.
        """
        code = _one_value(self, "failure", int)
        if code:
            raise _failure_error(Failure(code), self, recorded=True)
        return self

    def current_scale(self) -> float:
        """The scale as a Python float, after :meth:`check` (also of a replicated state)."""
        scale: float = _one_value(self.check(), "scale", float)
        return scale

    def to_host(self) -> ScalerState:
        """This state with Python scalars in every field, after :meth:`check`.

        A replicated state gives the one state its replicas agree on.

        Raises:
            ScaleCollapseError: A failure is recorded (:meth:`check`).
            ReplicaMismatchError: The replicas of a replicated state disagree.
        """
        self.check()
        values = {n: _one_value(self, n, float if n in FLOAT_FIELDS else int) for n in DATA_FIELDS}
        return ScalerState(self.config, **values)


#: The fields that change from step to step, in the order of the declaration above,
#: which is the one source of the pytree split: the config is always static, these
#: are the leaves under JAX, less those static for the state's config
#: (``static_when``: the window statistics while spike skipping is off).
#: Every one of them is in exactly one of FLOAT_FIELDS and COUNTER_FIELDS (a test checks).
DATA_FIELDS = tuple(f.name for f in dataclasses.fields(ScalerState) if not f.metadata["static"])
declare(ScalerState, optional=SPIKE_FIELDS)  # for JAX's pytrees and flax's checkpoints


def _one_value(state: ScalerState, name: str, cast: Callable[[Any], Any]) -> Any:
    """Field ``name`` read to the host as one Python value.

    A 0-d array or a scalar is read as it is. A field with a leading replica axis
    (``jax.pmap`` replicates a state so) is read whole, in one transfer, and gives
    its value only when every replica holds the same one: a silent pick of one
    replica would hide a divergence.

    Raises:
        ReplicaMismatchError: The replicas disagree.
        InvalidStateError: The field holds no value at all (an empty array).
    """
    value = getattr(state, name)
    shape = getattr(value, "shape", None)
    if shape is None or tuple(shape) == ():
        return _cast(name, value, cast)
    values = [_cast(name, v, cast) for v in _flat(value.tolist())]
    if not values:
        raise InvalidStateError(
            f"state.{name} has shape {tuple(shape)} and holds no value; pass a state "
            f"with one value per field (or one per replica)"
        )

    def same(a: Any, b: Any) -> bool:
        nans = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
        return bool(a == b or nans)  # NaN equals NaN here

    groups: list[list[int]] = []
    for i, v in enumerate(values):
        group = next((g for g in groups if same(values[g[0]], v)), None)
        if group is None:
            groups.append([i])
        else:
            group.append(i)
    if len(groups) > 1:
        shown = ", ".join(f"replica {g[0]} holds {values[g[0]]!r}" for g in groups[:4])
        raise ReplicaMismatchError(
            f"state.{name} differs between the {len(values)} replicas of this state "
            f"(shape {tuple(shape)}): {shown}; groups that agree: {groups}. Reading one "
            f"of them would hide the divergence. Replicas diverge when their found "
            f"flags differ: OR them over the mapped axis (loss_scaled(..., axis_name=...), "
            f"scaler_core.jax.reduce_found); inspect one replica with "
            f"jax.tree_util.tree_map(lambda a: a[i], state)",
            groups=groups,
            differences={name: dict(enumerate(values))},
        )
    return values[0]


def _cast(name: str, value: Any, cast: Callable[[Any], Any]) -> Any:
    """``cast(value)``: field ``name``'s value as a Python float or int.

    Raises:
        InvalidStateError: It holds no number of that kind (a string, NaN or a
            fraction in a counter, an int no float holds), as a state built by hand
            may; the message names the field.
    """
    try:
        out = None if isinstance(value, (str, bytes)) else cast(value)
    except (TypeError, ValueError, OverflowError):
        out = None
    if out is None or (cast is int and isinstance(value, float) and out != value):
        kind = "a float32 value" if cast is float else "an int32 counter (an int)"
        raise InvalidStateError(
            f"state.{name}={describe(value)}, but it must be {kind}; build a state with "
            f"scaler_core.init() and advance it with update(), or load one with from_dict()"
        )
    return out


def _flat(value: Any) -> list[Any]:
    if isinstance(value, list):
        return [v for item in value for v in _flat(item)]
    return [value]


def _convert(
    state: ScalerState,
    real: Callable[[Any], Any],
    counter: Callable[[Any], Any],
    host_static: bool,
) -> ScalerState:
    held = static_data(state) if host_static else ()
    values = {
        n: static_value(state, n)
        if n in held
        else (real if n in FLOAT_FIELDS else counter)(getattr(state, n))
        for n in DATA_FIELDS
    }
    return ScalerState(state.config, **values)


def require_state(state: object) -> ScalerState:
    """``state`` itself if it is a :class:`ScalerState`.

    Raises:
        InvalidArgumentError: It is not.
    """
    if not isinstance(state, ScalerState):
        raise InvalidArgumentError(
            f"state={state!r}, but it must be a ScalerState; build one with scaler_core.init()"
        )
    return state


def convert_fields(
    state: ScalerState,
    scale: Callable[[Any], Any],
    counter: Callable[[Any], Any],
    *,
    host_static: bool = False,
) -> ScalerState:
    """``state`` with every float32 field (:data:`FLOAT_FIELDS`: the scale and the
    norm statistics) passed through ``scale`` and every counter through ``counter``.

    What each integration's ``to_device`` is made of: nothing is read back to
    the host and nothing is checked, so a recorded failure moves with the state
    and raises at the first host-side look, wherever the state is then.

    Args:
        state: The state to convert.
        scale: Makes a float32 field (a host or device value) a device value.
        counter: Makes an int32 field a device value.
        host_static: Keep the fields the config makes static (the window
            statistics while spike skipping is off) as host numbers instead, as
            JAX's pytree needs them (auxiliary data); a 0-d array there is read
            back.

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`ScalerState`.
        InvalidStateError: (``host_static``) a static field is traced.
    """
    return _convert(require_state(state), scale, counter, host_static)


def init(config: ScalerConfig | None = None) -> ScalerState:
    """The starting state for ``config`` (PyTorch's defaults when omitted).

    >>> init().scale
    65536.0
    """
    config = ScalerConfig() if config is None else config
    if not isinstance(config, ScalerConfig):
        raise InvalidStateError(
            f"config={config!r}, but it must be a ScalerConfig; build one with ScalerConfig(...)"
        )
    return ScalerState(config=config, scale=config.init_scale, hysteresis_tracker=config.hysteresis)


def start_state(config: ScalerConfig | None, state: ScalerState | None) -> ScalerState:
    """``state`` when given (it must agree with ``config``), else ``init(config)``.

    Raises:
        InvalidStateError: ``state`` is not a :class:`ScalerState`, or both are
            given and differ.
    """
    if state is None:
        return init(config)
    if not isinstance(state, ScalerState):
        raise InvalidStateError(
            f"state={state!r}, but it must be a ScalerState (use from_dict for a dict)"
        )
    if config is not None and config != state.config:
        raise InvalidStateError(
            f"config={config!r} differs from state.config={state.config!r}; pass only one of them"
        )
    return state


def _sat_inc(n: int) -> int:
    return n + 1 if n < INT32_MAX else n


# --------------------------------------------------------------- spike skipping
def _ftz(value: float) -> float:
    """``f32(value)``, and 0.0 for a subnormal (XLA flushes them; so does every path)."""
    out = f32(value)
    return 0.0 if -FLT_MIN < out < FLT_MIN else out


def _host_x(cfg: ScalerConfig, grad_norm: object) -> float | None:
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
    return _ftz(value)


def _host_spike(state: ScalerState, x: float) -> bool:
    cfg = state.config
    d = _ftz(x - state.norm_mean)
    if state.norm_count < cfg.spike_window or not d > 0:
        return False
    return _ftz(d * d) > _ftz(_k2(cfg) * state.norm_var)


def _k2(cfg: ScalerConfig) -> float:
    k = cfg.spike_threshold
    return 0.0 if k is None else f32(k * k)


def _host_stats(state: ScalerState, x: float) -> tuple[float, float, int]:
    """The window statistics after a step with finite gradients and norm ``x``."""
    cfg = state.config
    mean, var, count = state.norm_mean, state.norm_var, state.norm_count
    d = _ftz(x - mean)
    dd = _ftz(d * d)
    if not (math.isfinite(x) and math.isfinite(dd)):
        return mean, var, count
    n = min(count + 1, cfg.spike_window)
    a = _ftz(1.0 / n)
    new_mean = _ftz(mean + _ftz(a * d))
    new_var = _ftz(_ftz(1.0 - a) * _ftz(var + _ftz(a * dd)))
    if not (math.isfinite(new_mean) and math.isfinite(new_var)):
        return mean, var, count
    return new_mean, new_var, n


# ------------------------------------------------------------------ the host rules
def classify(state: ScalerState, found_non_finite: bool, grad_norm: object = None) -> StepKind:
    """Decide what one step does, without changing anything.

    Args:
        state: A host state (Python scalars) with no recorded failure.
        found_non_finite: Whether any gradient of this step was NaN or inf.
        grad_norm: The step's global gradient norm (a host number); needed only
            with ``spike_threshold`` set, ignored otherwise.

    Returns:
        The :class:`StepKind` of the step.

    Raises:
        InvalidArgumentError: ``spike_threshold`` is set and ``grad_norm`` is None.
        GradientTypeError: ``grad_norm`` is not a real number.
        GradientValueError: ``grad_norm`` is negative.
    """
    return _classify(state, found_non_finite, _host_x(state.config, grad_norm))


def _classify(state: ScalerState, found_non_finite: bool, x: float | None) -> StepKind:
    cfg = state.config
    limit = cfg.max_consecutive_skips
    if found_non_finite:
        if limit is not None and state.consecutive_skips + 1 > limit:
            return StepKind.SKIP_LIMIT
        if not cfg.dynamic:
            return StepKind.STATIC_SKIP
        if state.hysteresis_tracker > 1:
            return StepKind.HYSTERESIS
        if cfg.min_scale is not None:
            if state.scale <= cfg.min_scale:
                return (
                    StepKind.FLOOR_RAISE if cfg.at_min_scale == "raise" else StepKind.HOLD_AT_FLOOR
                )
            return StepKind.BACKOFF
        return StepKind.BACKOFF if is_normal_f32(_backed_off(state)) else StepKind.COLLAPSE
    if x is not None and _host_spike(state, x):
        if limit is not None and state.consecutive_skips + 1 > limit:
            return StepKind.SKIP_LIMIT
        return StepKind.SPIKE_SKIP
    if not cfg.dynamic:
        return StepKind.STATIC_CLEAN
    if state.growth_tracker + 1 != cfg.growth_interval + cfg.growth_delay:
        return StepKind.COUNT
    return StepKind.GROW if _grown(state) > state.scale else StepKind.GROWTH_BLOCKED


def _grown(state: ScalerState) -> float:
    """The scale after a due growth: the candidate, the ceiling, or unchanged."""
    cfg = state.config
    candidate = f32(state.scale * cfg.growth_factor)
    if math.isfinite(candidate) and (cfg.max_scale is None or candidate <= cfg.max_scale):
        return candidate
    if cfg.at_max_scale == "clamp":
        return FLT_MAX if cfg.max_scale is None else cfg.max_scale
    return float(state.scale)


def _backed_off(state: ScalerState) -> float:
    cfg = state.config
    scale = f32(state.scale * cfg.backoff_factor)
    return scale if cfg.min_scale is None else max(scale, cfg.min_scale)


def host_update(
    state: ScalerState, found_non_finite: bool, grad_norm: object = None
) -> ScalerState:
    """Apply one step on the host: classify, then apply; raise on a failing step.

    Args:
        state: A host state.
        found_non_finite: This step's flag.
        grad_norm: The step's global gradient norm (a host number); needed only
            with ``spike_threshold`` set, ignored otherwise.

    Raises:
        ScaleCollapseError: The step would collapse the scale, or demands a
            backoff at a floor configured to raise. ``state`` is untouched.
        SkipLimitError: The step would pass ``max_consecutive_skips``.
        InvalidArgumentError: ``spike_threshold`` is set and ``grad_norm`` is None.
        GradientTypeError: ``grad_norm`` is not a host real number.
        GradientValueError: ``grad_norm`` is negative.
    """
    require_state(state).check()
    cfg = state.config
    x = _host_x(cfg, grad_norm)
    kind = _classify(state, found_non_finite, x)
    if kind.fails:
        raise _failure_error(_FAILURE_OF_KIND[kind], state, recorded=False)
    scale = state.scale
    growth = state.growth_tracker
    hyst = state.hysteresis_tracker
    if kind is StepKind.COUNT:
        growth += 1
    elif kind in (StepKind.GROW, StepKind.GROWTH_BLOCKED):
        if kind is StepKind.GROW:
            scale = _grown(state)
        growth = cfg.growth_delay
        hyst = cfg.hysteresis
    elif kind is StepKind.HYSTERESIS:
        growth = 0
        hyst -= 1
    elif kind is StepKind.BACKOFF:
        scale = _backed_off(state)
        growth = 0
    elif kind is StepKind.HOLD_AT_FLOOR:
        growth = 0
    skipped = kind.skipped
    refill = cfg.hysteresis_refill
    if cfg.dynamic and refill != "on_growth" and not skipped:
        hyst = cfg.hysteresis
    if refill == "on_clean_step_or_backoff" and kind in (
        StepKind.BACKOFF,
        StepKind.HOLD_AT_FLOOR,
    ):
        hyst = cfg.hysteresis
    mean, var, count = state.norm_mean, state.norm_var, state.norm_count
    if x is not None and not found_non_finite:
        mean, var, count = _host_stats(state, x)
    return ScalerState(
        config=cfg,
        scale=scale,
        growth_tracker=growth,
        hysteresis_tracker=hyst,
        steps=_sat_inc(state.steps),
        skipped_steps=_sat_inc(state.skipped_steps) if skipped else state.skipped_steps,
        consecutive_skips=_sat_inc(state.consecutive_skips) if skipped else 0,
        failure=0,
        norm_mean=mean,
        norm_var=var,
        norm_count=count,
        last_kind=kind.code,
    )


def host_outcome(
    state: ScalerState, found_non_finite: bool, grad_norm: object = None
) -> ScalerState:
    """The state after one host step, with a refusal recorded instead of raised.

    What :func:`device_update` returns, computed on the host: :func:`host_update`'s
    state, or, for a failing step, ``state`` unchanged but for its ``failure``
    code; a state that already failed stays as it is. For deciding a step before
    it is committed (:func:`step_skipped` over this), never for training on.

    Args:
        state: A host state.
        found_non_finite: This step's flag.
        grad_norm: The step's global norm (a host number), as :func:`host_update`.

    Raises:
        InvalidArgumentError: ``spike_threshold`` is set and ``grad_norm`` is None.
        GradientTypeError: ``grad_norm`` is not a host real number.

    >>> from scaler_core import ScalerConfig, init
    >>> s = init(ScalerConfig(max_consecutive_skips=0))
    >>> host_outcome(s, True).failure, step_skipped(host_outcome(s, True))
    (3, True)
    """
    if require_state(state).failure:
        return state
    kind = classify(state, found_non_finite, grad_norm)
    if kind.fails:
        return dataclasses.replace(state, failure=int(_FAILURE_OF_KIND[kind]))
    return host_update(state, found_non_finite, grad_norm)


def step_skipped(state: ScalerState, xp: Any = None) -> Any:
    """Whether the step that produced ``state`` must not be applied to the model.

    The one definition of a skipped step, for every loop, facade and wrapper:
    ``state`` is the state *after* the step's update, and the step is skipped
    when a failure is recorded (``failure != 0``: the refused step, and every
    step after it until the user deals with the failure) or when ``last_kind``
    is the code of a :class:`StepKind` that is :attr:`~StepKind.skipped`
    (non-finite gradients, a spike). A step that is not applied leaves the
    parameters *and* the optimizer state as they were: select the old ones.

    Args:
        state: The state the step's update returned (host or device).
        xp: ``None`` to answer on the host (a Python bool; a device state is
            read back, also a replicated one whose replicas agree), or an array
            namespace (``jax.numpy``, ``numpy``, ``cupy``) to answer with a 0-d
            boolean array of it, with no host synchronisation (inside ``jax.jit``).

    Returns:
        A bool (``xp=None``), or a boolean array of ``xp``.

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`ScalerState`.
        ReplicaMismatchError: (``xp=None``) the replicas of a replicated state
            disagree.

    >>> from scaler_core import init, update
    >>> step_skipped(update(init(), True)), step_skipped(update(init(), False))
    (True, False)
    """
    require_state(state)
    if xp is None:
        failure = _one_value(state, "failure", int)
        return failure != 0 or _one_value(state, "last_kind", int) in SKIPPED_CODES
    i32 = xp.int32
    kind = xp.asarray(state.last_kind, dtype=i32)
    out = xp.asarray(state.failure, dtype=i32) != xp.asarray(0, dtype=i32)
    for code in SKIPPED_CODES:
        out = out | (kind == xp.asarray(code, dtype=i32))
    return out


# ---------------------------------------------------------------- the device rules
def device_update(
    xp: Any, state: ScalerState, found_non_finite: Any, grad_norm: Any = None
) -> ScalerState:
    """The same transition as :func:`host_update`, branch-free on arrays.

    Written only with ``xp.where``, ``xp.asarray``, comparisons and float32/int32
    arithmetic (float64 for a factor float32 cannot hold), so
    it traces once under ``jax.jit`` for both flag values and runs on CuPy with
    no host synchronisation. A failing step returns the input state with
    ``failure`` set (see the module docstring); a state that has failed stays
    frozen.

    Args:
        xp: An array namespace with ``asarray``, ``where``, ``isfinite``,
            ``maximum``, ``float32`` and ``int32`` (``numpy``, ``jax.numpy``,
            ``cupy``).
        state: Host or device state.
        found_non_finite: A bool, or a 0-d boolean array of that namespace.
        grad_norm: The step's global gradient norm: a real number or a 0-d
            float array of that namespace. Needed only with ``spike_threshold``
            set, ignored otherwise.

    Returns:
        A state whose fields are 0-d arrays of ``xp``.

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`ScalerState`, or
            ``spike_threshold`` is set and ``grad_norm`` is None (checked in
            Python, also under ``jax.jit``).
        GradientTypeError: ``grad_norm`` is not a real number nor a 0-d float array,
            or the flag, the norm and the state's fields are arrays of more than
            one library (``xp``'s and another).
        GradientValueError: ``grad_norm`` is a negative host number.
    """
    cfg = require_state(state).config
    f32_, i32 = xp.float32, xp.int32
    found, x = _device_inputs(xp, state, found_non_finite, grad_norm)
    # The fields the config makes static (the statistics, with spike skipping off:
    # then x is None) pass through untouched: no arithmetic, and under JAX no leaf.
    held = static_data(state)
    old = {
        n: xp.asarray(getattr(state, n), dtype=f32_ if n in FLOAT_FIELDS else i32)
        for n in DATA_FIELDS
        if n not in held
    }
    scale, growth, hyst = old["scale"], old["growth_tracker"], old["hysteresis_tracker"]
    steps, skipped, consec = old["steps"], old["skipped_steps"], old["consecutive_skips"]
    zero, one = xp.asarray(0, dtype=i32), xp.asarray(1, dtype=i32)

    def sat_inc(n: Any) -> Any:
        return xp.where(n < INT32_MAX, n + one, n)

    def code(kind: StepKind) -> Any:
        return xp.asarray(kind.code, dtype=i32)

    new = dict(old)
    if x is None:
        spike = xp.asarray(False)
    else:
        spike, new["norm_mean"], new["norm_var"], new["norm_count"] = _device_spike(
            xp, cfg, old, found, x
        )
    skip = found | spike
    clean = ~skip
    new["steps"] = sat_inc(steps)
    new["skipped_steps"] = xp.where(skip, sat_inc(skipped), skipped)
    new["consecutive_skips"] = xp.where(skip, sat_inc(consec), zero)

    fail = xp.asarray(int(Failure.NONE), dtype=i32)
    if cfg.dynamic:
        growth1 = growth + one
        at_interval = clean & (growth1 == cfg.growth_interval + cfg.growth_delay)
        grown = _product(xp, scale, cfg.growth_factor)
        can_grow = xp.isfinite(grown)
        if cfg.max_scale is not None:
            can_grow = can_grow & (grown <= f32_(cfg.max_scale))
        if cfg.at_max_scale == "clamp":
            ceiling = f32_(FLT_MAX if cfg.max_scale is None else cfg.max_scale)
            grown = xp.where(can_grow, grown, ceiling)
            can_grow = xp.asarray(True)
        absorbed = found & (hyst > one)
        backing_off = found & ~absorbed
        backed = _backoff_product(xp, scale, cfg.backoff_factor)
        at_floor = xp.asarray(False)
        if cfg.min_scale is not None:
            floor = f32_(cfg.min_scale)
            backed = xp.maximum(backed, floor)
            at_floor = scale <= floor
            if cfg.at_min_scale == "raise":
                fail = xp.where(backing_off & at_floor, int(Failure.FLOOR_RAISE), fail)
        else:
            collapse = ~(xp.isfinite(backed) & (backed >= f32_(FLT_MIN)))
            fail = xp.where(backing_off & collapse, int(Failure.COLLAPSE), fail)
        candidate = xp.where(can_grow, grown, scale)
        new["scale"] = xp.where(
            found,
            xp.where(absorbed, scale, backed),
            xp.where(at_interval, candidate, scale),
        )
        restart = xp.asarray(cfg.growth_delay, dtype=i32)
        new["growth_tracker"] = xp.where(
            found, zero, xp.where(at_interval, restart, xp.where(spike, growth, growth1))
        )
        refill = at_interval if cfg.hysteresis_refill == "on_growth" else clean
        if cfg.hysteresis_refill == "on_clean_step_or_backoff":
            refill = refill | backing_off
        new["hysteresis_tracker"] = xp.where(
            absorbed, hyst - one, xp.where(refill, cfg.hysteresis, hyst)
        )
        grow_kind = xp.where(candidate > scale, code(StepKind.GROW), code(StepKind.GROWTH_BLOCKED))
        clean_kind = xp.where(at_interval, grow_kind, code(StepKind.COUNT))
        found_kind = xp.where(
            absorbed,
            code(StepKind.HYSTERESIS),
            xp.where(at_floor, code(StepKind.HOLD_AT_FLOOR), code(StepKind.BACKOFF)),
        )
    else:
        clean_kind, found_kind = code(StepKind.STATIC_CLEAN), code(StepKind.STATIC_SKIP)
    new["last_kind"] = xp.where(
        found, found_kind, xp.where(spike, code(StepKind.SPIKE_SKIP), clean_kind)
    )
    if cfg.max_consecutive_skips is not None:
        # The skip limit is checked first on the host; give it precedence here too.
        over = skip & (consec + one > cfg.max_consecutive_skips)
        fail = xp.where(over, int(Failure.SKIP_LIMIT), fail)
    failure = old["failure"]
    fail = xp.asarray(xp.where(failure != zero, failure, fail), dtype=i32)
    keep = fail != zero
    out = {
        n: xp.asarray(xp.where(keep, old[n], new[n]), dtype=f32_ if n in FLOAT_FIELDS else i32)
        for n in old
        if n != "failure"
    }
    out.update((n, getattr(state, n)) for n in held)
    return ScalerState(cfg, failure=fail, **out)


def _device_inputs(
    xp: Any, state: ScalerState, found_non_finite: Any, grad_norm: Any
) -> tuple[Any, Any]:
    """``(found, x)``: the flag as a 0-d bool array of ``xp`` and the step's norm as
    :func:`_device_x` makes it (``None`` with spike skipping off), after checking that
    every device value among them and the state's fields comes from ``xp``'s library."""
    found = xp.asarray(found_non_finite, dtype=bool)
    ours = (module_library(found), "found_non_finite", found)
    for name in DATA_FIELDS:
        value = getattr(state, name)
        library = array_library(value)
        if library is not None and library != ours[0]:
            raise mixed_error(ours, (library, f"state.{name}", value))
    cfg = state.config
    return found, None if cfg.spike_threshold is None else _device_x(xp, cfg, grad_norm, ours)


def _device_x(xp: Any, cfg: ScalerConfig, grad_norm: Any, ours: tuple[str, str, Any]) -> Any:
    """The step's norm as a 0-d float32 array of ``xp``, flushed as :func:`_ftz` does.

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
    x = xp.where(x < xp.float32(0.0), xp.float32(math.nan), x)
    return _device_ftz(xp, x)


def _device_ftz(xp: Any, value: Any) -> Any:
    low, high = xp.float32(-FLT_MIN), xp.float32(FLT_MIN)
    return xp.where((value > low) & (value < high), xp.float32(0.0), value)


def _device_spike(
    xp: Any, cfg: ScalerConfig, old: dict[str, Any], found: Any, x: Any
) -> tuple[Any, Any, Any, Any]:
    """``(spike, norm_mean, norm_var, norm_count)`` after this step, as :func:`_host_spike`
    and :func:`_host_stats` compute them (every operation float32, then flushed)."""
    f32_, i32 = xp.float32, xp.int32
    mean, var, count = old["norm_mean"], old["norm_var"], old["norm_count"]
    window = xp.asarray(cfg.spike_window, dtype=i32)

    def ftz(value: Any) -> Any:
        return _device_ftz(xp, value)

    d = ftz(x - mean)
    dd = ftz(d * d)
    spike = ~found & (count >= window) & (d > f32_(0.0)) & (dd > ftz(f32_(_k2(cfg)) * var))
    usable = ~found & xp.isfinite(x) & xp.isfinite(dd)
    # Unusable steps compute on zeros, so no inf * 0 is ever formed (its result is dropped).
    d = xp.where(usable, d, f32_(0.0))
    dd = xp.where(usable, dd, f32_(0.0))
    n = xp.where(count < window, count + xp.asarray(1, dtype=i32), window)
    a = ftz(f32_(1.0) / xp.asarray(n, dtype=f32_))  # exact count: spike_window <= 2**24
    new_mean = ftz(mean + ftz(a * d))
    new_var = ftz(ftz(f32_(1.0) - a) * ftz(var + ftz(a * dd)))
    usable = usable & xp.isfinite(new_mean) & xp.isfinite(new_var)
    return (
        spike,
        xp.where(usable, new_mean, mean),
        xp.where(usable, new_var, var),
        xp.where(usable, n, count),
    )


#: The float32 just below 2**-102: a product ``p`` with ``p * 2**24`` at least this
#: rounds (ties to even) to FLT_MIN, not to a subnormal.
_BELOW_2_102 = (2.0**24 - 1) * 2.0**-126


def _product(xp: Any, value: Any, factor: float) -> Any:
    """``f32(value * factor)`` as the host rules compute it, on arrays of ``xp``.

    A factor that float32 holds exactly is multiplied in float32 (the product is
    then the correctly rounded one). Any other factor (PyTorch accepts
    ``backoff_factor=0.9``) is multiplied in float64 and rounded once to float32,
    as PyTorch's kernels and the host do.
    """
    if is_f32_exact(factor):
        return value * xp.float32(factor)
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
    f32_ = xp.float32
    backed = _product(xp, scale, factor)
    high = _product(xp, scale * f32_(2.0**24), factor)
    rounds_to_min = (backed < f32_(FLT_MIN)) & (high >= f32_(_BELOW_2_102))
    return xp.where(rounds_to_min, f32_(FLT_MIN), backed)


def _failure_error(failure: Failure, state: ScalerState, *, recorded: bool) -> ScaleCollapseError:
    cfg = state.config
    where = (
        "a device transition recorded this failure; the state kept its last valid values"
        if recorded
        else "the state was left unchanged"
    )
    scale = _one_value(state, "scale", float)
    if failure is Failure.SKIP_LIMIT:
        return SkipLimitError(
            f"consecutive_skips would exceed max_consecutive_skips={cfg.max_consecutive_skips} "
            f"(scale={scale!r}): gradients have been non-finite on every recent step; "
            f"{where}. Check the model and data for NaN sources, or raise the limit."
        )
    if failure is Failure.FLOOR_RAISE:
        return ScaleCollapseError(
            f"scale={scale!r} is already at min_scale={cfg.min_scale!r} and a backoff was "
            f"demanded with at_min_scale='raise'; {where}. Lower min_scale, use "
            f"at_min_scale='hold', or find the source of the non-finite gradients."
        )
    return ScaleCollapseError(
        f"backoff of scale={scale!r} by backoff_factor={cfg.backoff_factor!r} gives "
        f"{f32(scale * cfg.backoff_factor)!r}, not a normal float32 (0, subnormal or "
        f"non-finite); {where}. Gradients are non-finite at every scale: look for NaN "
        f"sources, or set min_scale to hold a floor."
    )
