"""The scaler state: its type, its fields, the codes of its steps and what a step does
with the rule's answer.

A :class:`ScalerState` holds a float32 ``scale``, int32 counters and, for spike
skipping, float32 window statistics of the gradient norm (:data:`FLOAT_FIELDS`,
:data:`COUNTER_FIELDS`; under JAX the config and, with spike skipping off, the
statistics are static data, the other fields leaves). Each step is one
:class:`StepKind`, and its stable code is what ``last_kind`` records; the kinds,
their codes and which of them skip or fail are one table, read by the rule, by the
loops that decide whether a step is applied (:func:`step_skipped`) and by
checkpoints.

The rule of a step, and the invariants it keeps, are :mod:`scaler_core._rule`, one
statement for the host and every device. What is left here is what each does with
its answer, failing closed on a refused step: :func:`host_update` runs the rule on
Python scalars and raises (the caller's state untouched); :func:`device_update`
runs it on 0-d arrays, where nothing can raise, and returns the state as it was but
for a nonzero ``failure`` (a :class:`Failure` code), which freezes it until the
first host-side look (:meth:`ScalerState.check`, :meth:`ScalerState.current_scale`,
serialisation) raises the error the host would have raised. :func:`host_outcome`
records a refusal on the host as a device does; :func:`classify` names the step.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any

from ._coerce import array_library, describe, mixed_error, module_library
from ._config import ScalerConfig
from ._errors import (
    InvalidArgumentError,
    InvalidStateError,
    ReplicaMismatchError,
    ScaleCollapseError,
    SkipLimitError,
)
from ._f32 import f32
from ._registration import declare, register_loaded, static_data, static_value
from ._rule import HOST, Codes, advance, device_x, host_x

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
_KIND_OF_FAILURE = {int(failure): kind for kind, failure in _FAILURE_OF_KIND.items()}
#: What the rule writes (:class:`~scaler_core._rule.Codes`): the code of each kind a
#: step can take, by its value, and of each refusal, by its name.
_CODES = Codes(
    **{kind.value: kind.code for kind in StepKind if not kind.fails},
    **{failure.name.lower(): int(failure) for failure in Failure if failure},
)

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


def _assemble(config: ScalerConfig, fields: dict[str, Any]) -> ScalerState:
    """``ScalerState(config, **fields)``, ``fields`` holding every data field.

    The same state, built in half the time: the host builds one on every step, and
    the frozen dataclass's own ``__init__`` sets each of the twelve fields through
    ``object.__setattr__``, which costs as much as the host's whole rule (a test
    holds the two constructions equal). Its fields read a few nanoseconds slower
    (CPython keeps a constructed instance's attributes inline), which the next
    step pays back many times over.
    """
    state = object.__new__(ScalerState)
    attributes = state.__dict__
    attributes["config"] = config
    attributes.update(fields)
    state.__post_init__()
    return state


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
            f"flags differ: OR them over the mapped axis (with_loss_scaling(..., axis_name=...), "
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


# ------------------------------------------------------------ the transition
def host_update(
    state: ScalerState, found_non_finite: bool, grad_norm: object = None
) -> ScalerState:
    """Apply one step on the host (:func:`scaler_core._rule.advance` on Python
    scalars); raise on a refused step.

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

    >>> host_update(init(), True).scale
    32768.0
    """
    if type(require_state(state).failure) is not int or state.failure:
        state.check()  # raises the recorded failure (a host state's 0 has none to raise)
    new = _host_step(state, found_non_finite, grad_norm)
    if new.failure:
        raise _failure_error(Failure(new.failure), state, recorded=False)
    return new


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

    >>> from scaler_core import ScalerConfig
    >>> s = init(ScalerConfig(max_consecutive_skips=0))
    >>> host_outcome(s, True).failure, step_skipped(host_outcome(s, True))
    (3, True)
    """
    if require_state(state).failure:
        return state
    new = _host_step(state, found_non_finite, grad_norm)
    return dataclasses.replace(state, failure=new.failure) if new.failure else new


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

    >>> classify(init(), True)
    <StepKind.BACKOFF: 'backoff'>
    """
    new = _host_step(state, found_non_finite, grad_norm)
    return _KIND_OF_FAILURE[new.failure] if new.failure else _KIND_OF_CODE[new.last_kind]


def _host_step(state: ScalerState, found_non_finite: bool, grad_norm: object) -> ScalerState:
    """The rule on Python scalars: the state after the step, a refusal's code in its
    ``failure`` (its other fields then meaningless)."""
    x = host_x(state.config, grad_norm)
    return _assemble(state.config, advance(HOST, state, bool(found_non_finite), x, _CODES))


def device_update(
    xp: Any, state: ScalerState, found_non_finite: Any, grad_norm: Any = None
) -> ScalerState:
    """Apply one step on the arrays of ``xp`` (:func:`scaler_core._rule.advance` on
    0-d arrays), with no host synchronisation.

    It traces once under ``jax.jit`` for both flag values and runs on CuPy with no
    host synchronisation. A failing step returns the input state with ``failure``
    set (see the module docstring); a state that has failed stays frozen.

    Args:
        xp: An array namespace with ``asarray``, ``where``, ``isfinite``,
            ``maximum``, ``float32``, ``float64`` and ``int32`` (``numpy``,
            ``jax.numpy``, ``cupy``, a backend's namespace).
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
    held = {n: getattr(state, n) for n in static_data(state)}
    old = {
        n: xp.asarray(getattr(state, n), dtype=f32_ if n in FLOAT_FIELDS else i32)
        for n in DATA_FIELDS
        if n not in held
    }
    new = advance(xp, ScalerState(cfg, **old, **held), found, x, _CODES)
    failure = old["failure"]
    fail = xp.asarray(xp.where(failure != 0, failure, new["failure"]), dtype=i32)
    keep = fail != 0
    out = {
        n: xp.asarray(xp.where(keep, old[n], new[n]), dtype=f32_ if n in FLOAT_FIELDS else i32)
        for n in old
        if n != "failure"
    }
    return ScalerState(cfg, failure=fail, **out, **held)


def _device_inputs(
    xp: Any, state: ScalerState, found_non_finite: Any, grad_norm: Any
) -> tuple[Any, Any]:
    """``(found, x)``: the flag as a 0-d bool array of ``xp`` and the step's norm as
    :func:`~scaler_core._rule.device_x` makes it (``None`` with spike skipping off),
    after checking that every device value among them and the state's fields comes
    from ``xp``'s library."""
    found = xp.asarray(found_non_finite, dtype=bool)
    ours = (module_library(found), "found_non_finite", found)
    for name in DATA_FIELDS:
        value = getattr(state, name)
        library = array_library(value)
        if library is not None and library != ours[0]:
            raise mixed_error(ours, (library, f"state.{name}", value))
    cfg = state.config
    return found, None if cfg.spike_threshold is None else device_x(xp, cfg, grad_norm, ours)


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
