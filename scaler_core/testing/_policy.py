"""Hypothesis strategies and a ready invariant suite for property-testing scale policies.

Needs the ``test`` extra (hypothesis); :mod:`scaler_core.testing` re-exports all of it.
A *policy* is any pure transition
``policy(state, found_non_finite) -> state`` over :class:`ScalerState`; the
built-in one is :func:`scaler_core.update`. Under a config with spike skipping
(``spike_threshold`` set; :func:`configs` draws those with ``spikes=True``) it is
called as ``policy(state, found_non_finite, grad_norm)``. Check your own in your own test
file (from a plain test function, not inside another ``@given``)::

    from scaler_core.testing import check_policy

    def test_my_policy():
        check_policy(my_policy)

:func:`check_policy` replays random flag sequences from random configs and,
after every step, checks bounds, purity, determinism, fail-closed behaviour and
skip accounting. A violation raises :class:`PolicyViolationError` whose message names
the broken property and the shrunk (minimal) flag sequence and config that
reproduce it. The strategies (:func:`configs`, :func:`states`,
:func:`flag_sequences`, :func:`norm_sequences`, :func:`scales`,
:func:`gradient_trees`) are there for your own properties.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .._errors import MissingDependencyError

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis.extra import numpy as hnp
except ImportError as exc:  # pragma: no cover - exercised only without hypothesis
    raise MissingDependencyError(
        "scaler_core.testing's strategies and check_policy need hypothesis: "
        "pip install 'scaler-core[test]'"
    ) from exc

from .._api import policy_name, policy_step
from .._config import ScalerConfig
from .._errors import BackendUnavailableError, PolicyViolationError, ScaleCollapseError
from .._f32 import FLT_MAX, FLT_MIN, INT32_MAX, f32
from .._state import DATA_FIELDS, LAST_KIND_CODES, ScalerState, StepKind, classify, init

__all__ = [
    "Policy",
    "PolicyViolationError",
    "check_invariants",
    "check_policy",
    "check_step",
    "configs",
    "flag_sequences",
    "gradient_trees",
    "norm_sequences",
    "scales",
    "states",
]

#: A transition: ``policy(state, found_non_finite) -> next state`` (with spike
#: skipping on: ``policy(state, found_non_finite, grad_norm)``).
Policy = Callable[..., ScalerState]

#: Factors every backend multiplies exactly (float32 values).
_GROWTH = [1.5, 2.0, 3.0, 4.0, 1.0009765625, 65536.0]
_BACKOFF = [0.5, 0.25, 0.75, 0.125, 0.9990234375, 2.0**-20]


def scales(min_value: float = FLT_MIN, max_value: float = FLT_MAX) -> st.SearchStrategy[float]:
    """Positive, normal float32 scales in ``[min_value, max_value]``."""
    return st.floats(
        min_value=min_value, max_value=max_value, width=32, allow_subnormal=False
    ).filter(lambda x: x >= FLT_MIN)


@st.composite
def configs(
    draw: st.DrawFn,
    *,
    torch_compatible: bool = False,
    max_growth_interval: int = 20,
    spikes: bool = False,
    max_spike_window: int = 8,
) -> ScalerConfig:
    """Valid :class:`ScalerConfig` values, knobs included.

    Args:
        torch_compatible: Only configs within PyTorch's semantics (no floor,
            ceiling, hysteresis, skip limit; dynamic).
        max_growth_interval: Keep intervals small so growth happens in tests.
        spikes: Turn spike skipping on: draw ``spike_threshold`` and
            ``spike_window`` too (a policy is then called with the norm). Off
            by default, so policies of two arguments keep working.
        max_spike_window: Keep windows small so detection starts in tests.
    """
    init_scale = draw(st.one_of(st.sampled_from([1.0, 2.0**16, 2.0**-120, 2.0**120]), scales()))
    kwargs: dict[str, Any] = {
        "init_scale": init_scale,
        "growth_factor": draw(st.sampled_from(_GROWTH)),
        "backoff_factor": draw(st.sampled_from(_BACKOFF)),
        "growth_interval": draw(st.integers(1, max_growth_interval)),
    }
    if torch_compatible:
        return ScalerConfig(**kwargs)
    if draw(st.booleans()):
        kwargs["min_scale"] = draw(scales(max_value=init_scale))
        kwargs["at_min_scale"] = draw(st.sampled_from(["hold", "raise"]))
    if draw(st.booleans()):
        kwargs["max_scale"] = draw(scales(min_value=init_scale))
    kwargs["at_max_scale"] = draw(st.sampled_from(["block", "clamp"]))
    kwargs["hysteresis"] = draw(st.integers(1, 4))
    kwargs["hysteresis_refill"] = draw(
        st.sampled_from(["on_growth", "on_clean_step", "on_clean_step_or_backoff"])
    )
    if draw(st.booleans()):
        kwargs["max_consecutive_skips"] = draw(st.integers(0, 30))
    kwargs["growth_delay"] = draw(st.sampled_from([0, 0, 1, 2]))
    kwargs["dynamic"] = draw(st.booleans()) or draw(st.booleans())
    if spikes:
        kwargs["spike_threshold"] = draw(
            st.one_of(st.sampled_from([0.5, 1.0, 2.0, 3.0, 6.0]), st.floats(0.01, 100.0))
        )
        kwargs["spike_window"] = draw(st.integers(2, max(2, max_spike_window)))
    return ScalerConfig(**kwargs)


@st.composite
def states(
    draw: st.DrawFn, config: ScalerConfig | st.SearchStrategy[ScalerConfig] | None = None
) -> ScalerState:
    """Host states that satisfy every invariant of :func:`check_invariants`.

    Args:
        config: A fixed config, a strategy of configs, or ``None`` for
            :func:`configs`.
    """
    if config is None:
        config = configs()
    cfg = draw(config) if isinstance(config, st.SearchStrategy) else config
    if cfg.dynamic:
        low = FLT_MIN if cfg.min_scale is None else cfg.min_scale
        high = FLT_MAX if cfg.max_scale is None else cfg.max_scale
        scale = draw(st.one_of(st.sampled_from([low, high, cfg.init_scale]), scales(low, high)))
    else:
        scale = cfg.init_scale
    steps = draw(st.one_of(st.integers(0, 10_000), st.just(INT32_MAX)))
    skipped = draw(st.integers(0, steps))
    limit = (
        skipped if cfg.max_consecutive_skips is None else min(skipped, cfg.max_consecutive_skips)
    )
    window: dict[str, Any] = {}
    if cfg.spike_threshold is not None:
        stat = st.floats(0, 1e6, width=32).map(lambda v: v if v == 0 or v >= FLT_MIN else 0.0)
        window = {
            "norm_mean": draw(stat),
            "norm_var": draw(stat),
            "norm_count": draw(st.integers(0, cfg.spike_window)),
            "last_kind": draw(st.sampled_from(sorted(LAST_KIND_CODES))),
        }
    return ScalerState(
        config=cfg,
        scale=scale,
        growth_tracker=draw(st.integers(0, cfg.growth_interval + cfg.growth_delay - 1)),
        hysteresis_tracker=draw(st.integers(1, cfg.hysteresis)),
        steps=steps,
        skipped_steps=skipped,
        consecutive_skips=draw(st.integers(0, limit)),
        **window,
    )


def flag_sequences(
    min_size: int = 0, max_size: int = 200, *, p_non_finite: float | None = None
) -> st.SearchStrategy[list[bool]]:
    """Lists of per-step found-non-finite flags.

    Mixes uniform sequences with bursty ones (long clean runs, then overflow
    spikes), which is how real training behaves.
    """
    if p_non_finite is not None:
        weighted = st.floats(0, 1).map(lambda u: u < p_non_finite)
        return st.lists(weighted, min_size=min_size, max_size=max_size)
    bursts = st.lists(
        st.tuples(st.booleans(), st.integers(1, 40)), max_size=max(1, max_size // 10)
    ).map(lambda runs: [flag for flag, n in runs for _ in range(n)])
    return st.one_of(
        st.lists(st.booleans(), min_size=min_size, max_size=max_size),
        bursts.filter(lambda xs: min_size <= len(xs) <= max_size),
    )


#: Multiples of the calm level that :func:`norm_sequences` plants as spikes.
_SPIKES = [3.0, 10.0, 1e3, 1e6]
#: Values a norm can take on a bad step: non-finite, zero, overflowing d*d, subnormal.
_ODD_NORMS = [math.nan, math.inf, 0.0, 1e30, 1e-40]


@st.composite
def norm_sequences(
    draw: st.DrawFn, min_size: int = 0, max_size: int = 200, *, odd: bool = True
) -> list[float]:
    """Lists of per-step global gradient norms, for spike skipping.

    A calm level with relative noise (none to 50 %), with planted spikes (the
    level times 3 to a million) and, with ``odd``, the odd values a real norm
    takes now and then: NaN, inf, 0, values whose square overflows float32,
    float32 subnormals.
    """
    n = draw(st.integers(min_size, max_size))
    level = draw(st.one_of(st.sampled_from([1.0, 1e-3, 3.0, 1e4]), st.floats(1e-6, 1e6)))
    noise = draw(st.sampled_from([0.1, 0.0, 0.01, 0.5]))
    out: list[float] = []
    for _ in range(n):
        pick = draw(st.integers(0, 15))
        if pick == 1:
            out.append(level * draw(st.sampled_from(_SPIKES)))
        elif pick == 2 and odd:  # noqa: PLR2004 - the second of the rare kinds
            out.append(draw(st.sampled_from(_ODD_NORMS)))
        else:
            out.append(level * (1.0 + noise * draw(st.floats(-1.0, 1.0))))
    return out


_ALL_DTYPES = ("float16", "bfloat16", "float32", "float64")
_BACKEND_MODULES = {"numpy": "numpy", "jax": "jax.numpy", "cupy": "cupy"}


def gradient_trees(
    backend: str = "numpy",
    *,
    dtypes: Sequence[str] | None = None,
    non_finite: bool = True,
    max_leaves: int = 6,
    max_side: int = 5,
) -> st.SearchStrategy[Any]:
    """Nested lists and dicts of gradient arrays of one array library.

    Leaves are 0-d to 2-d arrays (empty ones included) of the given float
    dtypes. The library is imported only when an example is drawn, so building
    a ``jax`` or ``cupy`` strategy imports nothing.

    Args:
        backend: ``"numpy"``, ``"jax"`` or ``"cupy"``.
        dtypes: Float dtype names; all four (CuPy: no ``bfloat16``) when omitted.
        non_finite: Whether leaves may hold NaN and infinities.
        max_leaves: Most arrays in one tree.
        max_side: Longest array side.

    Raises:
        BackendUnavailableError: ``backend`` is unknown or not installed.
    """
    module = _BACKEND_MODULES.get(backend)
    if module is None:
        raise BackendUnavailableError(
            f"backend={backend!r}, but gradient_trees knows only {sorted(_BACKEND_MODULES)}"
        )
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise BackendUnavailableError(
            f"backend={backend!r} needs {module.split('.')[0]}, which is not installed; "
            f"install it or use backend='numpy'"
        )
    if dtypes is None:
        dtypes = tuple(d for d in _ALL_DTYPES if not (backend == "cupy" and d == "bfloat16"))

    def leaf(dtype: str) -> st.SearchStrategy[Any]:
        np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        # Largest finite value (bfloat16 shares float32's exponent range).
        top = 3.3e38 if dtype == "bfloat16" else float(np.finfo(np_dtype).max)
        # Values in float64, then rounded into the dtype; finite draws stay below
        # its largest value so rounding cannot create an infinity.
        elements = (
            st.floats(allow_nan=True, allow_infinity=True)
            if non_finite
            else st.floats(-top / 2, top / 2)
        )
        shapes = hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=max_side)
        return hnp.arrays(np.float64, shapes, elements=elements).map(
            lambda a: _cast(a, np_dtype, backend)
        )

    leaves = st.sampled_from(list(dtypes)).flatmap(leaf)
    keys = st.text("abcdefgh", min_size=1, max_size=3)
    return st.recursive(
        leaves,
        lambda kids: (
            st.lists(kids, min_size=1, max_size=3)
            | st.dictionaries(keys, kids, min_size=1, max_size=3)
        ),
        max_leaves=max_leaves,
    )


def _cast(values: Any, dtype: Any, backend: str) -> Any:
    with np.errstate(over="ignore", invalid="ignore"):
        host = values.astype(dtype)
    if backend == "numpy":
        return host
    return importlib.import_module(_BACKEND_MODULES[backend]).asarray(host)


def check_invariants(state: ScalerState) -> None:
    """Raise :class:`PolicyViolationError` naming the broken invariant of a host state.

    Checks: the scale is a positive, finite, normal float32 within the bounds;
    the trackers are in range; the counters add up; the spike window's
    statistics are finite float32 values (the variance >= 0) and its count at
    most ``spike_window``; ``last_kind`` is a valid code.
    """
    cfg = state.config
    s = state.scale

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise PolicyViolationError(f"invariant broken: {what} (state={state!r})")

    need(int(state.failure) == 0, "failure == 0 on a host state")
    need(
        isinstance(s, float) and math.isfinite(s) and FLT_MIN <= s <= FLT_MAX,
        "scale is a finite, normal float32",
    )
    need(f32(s) == s, "scale is exactly a float32 value")
    need(cfg.min_scale is None or s >= cfg.min_scale, "scale >= min_scale")
    need(cfg.max_scale is None or s <= cfg.max_scale, "scale <= max_scale")
    need(cfg.dynamic or s == cfg.init_scale, "a static scale never changes")
    need(
        0 <= state.growth_tracker < cfg.growth_interval + cfg.growth_delay,
        "0 <= growth_tracker < growth_interval + growth_delay",
    )
    need(1 <= state.hysteresis_tracker <= cfg.hysteresis, "1 <= hysteresis_tracker <= hysteresis")
    need(
        0 <= state.consecutive_skips <= state.skipped_steps <= state.steps,
        "0 <= consecutive_skips <= skipped_steps <= steps",
    )
    limit = cfg.max_consecutive_skips
    need(limit is None or state.consecutive_skips <= limit, "consecutive_skips <= limit")
    mean, var = state.norm_mean, state.norm_var
    need(
        isinstance(mean, float) and math.isfinite(mean) and f32(mean) == mean,
        "norm_mean is a finite float32",
    )
    need(
        isinstance(var, float) and math.isfinite(var) and f32(var) == var and var >= 0,
        "norm_var is a finite float32 >= 0",
    )
    need(0 <= state.norm_count <= cfg.spike_window, "0 <= norm_count <= spike_window")
    need(state.last_kind in LAST_KIND_CODES, "last_kind is 0 or a non-failing StepKind code")


def _snapshot(state: ScalerState) -> tuple[Any, ...]:
    return (state.config, *(_plain(getattr(state, n)) for n in DATA_FIELDS))


def _plain(value: Any) -> Any:
    try:
        return value.tolist()  # arrays: copy the values, not the (mutable) object
    except AttributeError:
        return value


def _sat(n: int) -> int:
    return min(n + 1, INT32_MAX)


def check_step(
    policy: Policy, state: ScalerState, found: bool, grad_norm: float | None = None
) -> ScalerState | None:
    """Apply ``policy`` once and check every property of one step.

    Properties: the result is a :class:`ScalerState` with the same config
    (*type*); the input state is unchanged (*purity*); a second call gives an
    equal result (*determinism*); a refused step raises
    :class:`ScaleCollapseError` or :class:`SkipLimitError` and nothing else
    (*fail-closed*); the result passes :func:`check_invariants` (*bounds*);
    ``steps`` grows by one, ``skipped_steps`` by one exactly on a non-finite
    or spike step, ``consecutive_skips`` counts the current run (*skip
    accounting*); a spike step (as :func:`scaler_core.classify` decides it)
    leaves the scale, the growth and the hysteresis trackers as they were and
    records ``StepKind.SPIKE_SKIP`` (*spike skip*).

    Args:
        policy: The transition under test, called as every caller calls it:
            ``policy(state, found)``, or with spike skipping on
            ``policy(state, found, grad_norm)``; a two-argument policy there
            runs under the core's spike rule (see "Your own policy" in
            docs/policies.md).
        state: A host state that satisfies the invariants.
        found: This step's flag.
        grad_norm: This step's gradient norm (needed with spike skipping on).

    Returns:
        The next state, or ``None`` when the policy refused the step.

    Raises:
        PolicyViolationError: A property failed; the message says which.
        InvalidArgumentError: ``policy`` cannot take the arguments the state's
            config needs, or spike skipping is on and ``grad_norm`` is None.
    """
    before = _snapshot(state)

    def fail(prop: str, detail: str) -> PolicyViolationError:
        return PolicyViolationError(f"{prop}: {detail}")

    step = policy_step(policy_name(policy), state.config, policy)
    spiking = state.config.spike_threshold is not None
    spike = spiking and classify(state, found, grad_norm) is StepKind.SPIKE_SKIP
    try:
        new = step(state, found, grad_norm)
    except ScaleCollapseError:
        if _snapshot(state) != before:
            raise fail("purity", "the policy changed its input state before refusing") from None
        return None
    except Exception as exc:
        raise fail(
            "fail-closed",
            f"the policy raised {type(exc).__name__}({exc}); a refused step must raise "
            f"ScaleCollapseError or SkipLimitError",
        ) from exc
    if not isinstance(new, ScalerState):
        raise fail("type", f"the policy returned {new!r}, not a ScalerState")
    if new.config != state.config:
        raise fail("type", f"the policy changed the config to {new.config!r}")
    if _snapshot(state) != before:
        raise fail("purity", f"the policy changed its input state to {state!r}")
    try:
        again = step(state, found, grad_norm)
    except Exception as exc:
        raise fail("determinism", f"a second identical call raised {exc!r}") from exc
    if not isinstance(again, ScalerState) or _snapshot(again) != _snapshot(new):
        raise fail("determinism", f"two identical calls gave {new!r} and {again!r}")
    skipped = found or spike
    expected = (
        _sat(state.steps),
        _sat(state.skipped_steps) if skipped else state.skipped_steps,
        _sat(state.consecutive_skips) if skipped else 0,
    )
    got = (new.steps, new.skipped_steps, new.consecutive_skips)
    if got != expected:
        what = "non-finite" if found else "spike" if spike else "clean"
        raise fail(
            "skip accounting",
            f"(steps, skipped_steps, consecutive_skips) went from "
            f"{(state.steps, state.skipped_steps, state.consecutive_skips)} to {got} on a "
            f"{what} step; expected {expected}",
        )
    if spike:
        kept = ("scale", "growth_tracker", "hysteresis_tracker")
        moved = [n for n in kept if getattr(new, n) != getattr(state, n)]
        if moved or new.last_kind != StepKind.SPIKE_SKIP.code:
            raise fail(
                "spike skip",
                f"a spike step (grad_norm={grad_norm!r}) changed {moved} or recorded "
                f"last_kind={new.last_kind!r}; it must keep the scale and both trackers "
                f"and record StepKind.SPIKE_SKIP ({StepKind.SPIKE_SKIP.code})",
            )
    try:
        check_invariants(new)
    except PolicyViolationError as exc:
        raise fail("bounds", f"{exc}; a policy must refuse the step instead") from None
    return new


def check_policy(
    policy: Policy,
    *,
    config: ScalerConfig | st.SearchStrategy[ScalerConfig] | None = None,
    max_steps: int = 200,
    max_examples: int | None = None,
) -> None:
    """Property-test a policy on random configs and flag sequences.

    Every sequence starts from ``init(config)``; each step goes through
    :func:`check_step`. A config with spike skipping on (from
    ``configs(spikes=True)``) also draws a :func:`norm_sequences` of the same
    length and passes each norm as the policy's third argument (a two-argument
    policy runs under the core's spike rule, as :func:`check_step` says). Hypothesis
    shrinks a failure to a minimal config and flag sequence, and the raised
    message prints both, ready to paste.

    Args:
        policy: ``policy(state, found) -> state``, or
            ``policy(state, found, grad_norm) -> state``.
        config: A fixed config, a strategy of configs, or ``None`` for
            :func:`configs`.
        max_steps: Longest flag sequence.
        max_examples: Examples to try; the active hypothesis profile's when
            omitted.

    Raises:
        PolicyViolationError: A property failed. The message names the property,
            the step, the minimal flag sequence and the config.
        InvalidArgumentError: ``policy`` cannot take the arguments a drawn
            config needs (refused before its first step).

    >>> from scaler_core import update
    >>> check_policy(update, max_examples=5)
    """
    name = policy_name(policy)
    strategy = configs() if config is None else config
    if isinstance(strategy, ScalerConfig):
        strategy = st.just(strategy)

    @given(strategy, flag_sequences(max_size=max_steps), st.data())
    def run(cfg: ScalerConfig, flags: list[bool], data: st.DataObject) -> None:
        state: ScalerState | None = init(cfg)
        norms: list[float] | None = None
        if cfg.spike_threshold is not None:
            norms = data.draw(norm_sequences(len(flags), len(flags)), label="norms")
        for i, flag in enumerate(flags):
            assert state is not None
            prior = state
            try:
                state = check_step(policy, state, flag, None if norms is None else norms[i])
            except PolicyViolationError as exc:
                shown = "" if norms is None else f"\n  with norms={norms[: i + 1]!r}"
                # Under spike skipping check_step calls the policy as this run did (a
                # two-argument policy under the core's spike rule), so it reproduces both.
                loop, call = (
                    ("f in flags", f"{name}(state, f)")
                    if norms is None
                    else ("f, g in zip(flags, norms)", f"check_step({name}, state, f, g)")
                )
                raise PolicyViolationError(
                    f"policy {name} broke {exc}\n"
                    f"  at step {i} of flags={flags[: i + 1]!r}{shown}\n"
                    f"  from init(config) with config={cfg!r}\n"
                    f"  state before the step: {prior!r}\n"
                    f"  reproduce: state = init(config); for {loop}: state = {call}"
                ) from None
            if state is None:
                return

    overrides: dict[str, Any] = {
        "deadline": None,
        "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
    }
    if max_examples is not None:
        overrides["max_examples"] = max_examples
    settings(**overrides)(run)()
