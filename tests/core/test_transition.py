"""The transition, property-tested against a small independent reference model.

The model below is written separately from ``scaler_core._rule`` (NumPy float32
arithmetic instead of struct rounding, plain branches instead of StepKind), so a
shared mistake is unlikely. A ``RuleBasedStateMachine`` steps both with random
flags and checks the invariants after every step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import scaler_core as sc
from scaler_core._f32 import INT32_MAX
from scaler_core._state import DATA_FIELDS, ScalerState, _assemble, host_outcome
from scaler_core.testing import check_invariants, configs, flag_sequences, states

F32_TINY = float(np.finfo(np.float32).tiny)


class RefusedError(Exception):
    """The model's way of saying 'this step fails closed'."""


@dataclasses.dataclass
class Model:
    """An independent statement of the transition rules (the theory of operation of _rule.py)."""

    cfg: sc.ScalerConfig
    scale: np.float32
    growth: int = 0
    hyst: int = 1
    steps: int = 0
    skipped: int = 0
    consec: int = 0

    @classmethod
    def start(cls, cfg: sc.ScalerConfig) -> Model:
        return cls(cfg, np.float32(cfg.init_scale), hyst=cfg.hysteresis)

    def mul(self, factor: float) -> np.float32:
        with np.errstate(over="ignore", under="ignore"):
            return np.float32(np.float64(self.scale) * np.float64(factor))

    def step(self, found: bool) -> None:
        cfg = self.cfg
        if found:
            if cfg.max_consecutive_skips is not None and self.consec >= cfg.max_consecutive_skips:
                raise RefusedError("skip limit")
            if cfg.dynamic:
                self.growth = 0
                if self.hyst >= 2:
                    self.hyst -= 1
                elif cfg.min_scale is not None and self.scale == np.float32(cfg.min_scale):
                    if cfg.at_min_scale == "raise":
                        raise RefusedError("floor")
                    if cfg.hysteresis_refill == "on_clean_step_or_backoff":
                        self.hyst = cfg.hysteresis
                else:
                    new = self.mul(cfg.backoff_factor)
                    if cfg.min_scale is not None:
                        new = max(new, np.float32(cfg.min_scale))
                    if not (np.isfinite(new) and new >= F32_TINY):
                        raise RefusedError("collapse")
                    self.scale = new
                    if cfg.hysteresis_refill == "on_clean_step_or_backoff":
                        self.hyst = cfg.hysteresis
            self.skipped += 1
            self.consec += 1
        else:
            if cfg.dynamic:
                self.growth += 1
                if self.growth == cfg.growth_interval + cfg.growth_delay:
                    # The first growth_delay clean steps after a skip are never counted
                    # again: after a growth the count restarts past them.
                    self.growth = cfg.growth_delay
                    grown = self.mul(cfg.growth_factor)
                    ok = np.isfinite(grown)
                    if cfg.max_scale is not None:
                        ok = ok and grown <= np.float32(cfg.max_scale)
                    if ok:
                        self.scale = grown
                    elif cfg.at_max_scale == "clamp":
                        top = np.finfo(np.float32).max if cfg.max_scale is None else cfg.max_scale
                        self.scale = np.float32(top)
                    self.hyst = cfg.hysteresis
                if cfg.hysteresis_refill in ("on_clean_step", "on_clean_step_or_backoff"):
                    self.hyst = cfg.hysteresis
            self.consec = 0
        self.steps += 1

    def matches(self, state: sc.ScalerState) -> bool:
        return (
            state.scale == float(self.scale)
            and state.growth_tracker == self.growth
            and state.hysteresis_tracker == self.hyst
            and (state.steps, state.skipped_steps, state.consecutive_skips)
            == (self.steps, self.skipped, self.consec)
        )


class ScalerMachine(RuleBasedStateMachine):
    """Steps ``update`` and the model side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.state: sc.ScalerState
        self.model: Model
        self.clean_run = 0
        self.grown_since_found = False

    @initialize(cfg=configs())
    def start(self, cfg: sc.ScalerConfig) -> None:
        self.state = sc.init(cfg)
        self.model = Model.start(cfg)

    @rule(found=st.booleans())
    def step(self, found: bool) -> None:
        before = self.state
        snapshot = dataclasses.astuple(before)
        kind = sc.classify(before, found)
        saved = dataclasses.replace(self.model)
        try:
            self.model.step(found)
        except RefusedError as why:
            self.model = saved  # a refused step changes nothing; training may go on
            note(f"model refuses: {why}")
            with pytest.raises(sc.ScaleCollapseError):
                sc.update(before, found)
            assert kind.fails
            # Fail-closed leaves the caller's state exactly as it was (h11-style check).
            assert dataclasses.astuple(before) == snapshot
            return
        after = sc.update(before, found)
        assert not kind.fails
        assert kind.skipped == found
        assert dataclasses.astuple(before) == snapshot, "update mutated its input"
        assert self.model.matches(after), (after, self.model)
        cfg = before.config
        if cfg.dynamic and after.scale > before.scale:
            # Growth only after exactly growth_interval clean steps (growth_interval +
            # growth_delay since the last non-finite step or the start).
            assert kind is sc.StepKind.GROW
            delay = 0 if self.grown_since_found else cfg.growth_delay
            assert self.clean_run + 1 == cfg.growth_interval + delay
        if found and cfg.dynamic:
            assert after.growth_tracker == 0, "a non-finite step resets the growth tracker"
        due = kind in (sc.StepKind.GROW, sc.StepKind.GROWTH_BLOCKED)
        self.clean_run = 0 if (found or due) else self.clean_run + 1
        if cfg.dynamic and (found or due):
            self.grown_since_found = due
        self.state = after

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "state"):
            check_invariants(self.state)


TestScalerMachine = ScalerMachine.TestCase


@given(configs(), flag_sequences())
def test_device_transition_equals_host_transition(cfg: sc.ScalerConfig, flags: list[bool]) -> None:
    """The branch-free device rules (run here on NumPy 0-d arrays) equal the host rules."""
    host = sc.init(cfg)
    dev: Any = sc.init(cfg)
    with np.errstate(all="ignore"):  # float32 overflow is part of the rules on a device
        _compare_device_and_host(dev, host, flags)


def _compare_device_and_host(dev: Any, host: sc.ScalerState, flags: list[bool]) -> None:
    for found in flags:
        dev = sc.device_update(np, dev, np.bool_(found))
        try:
            host = sc.update(host, found)
        except sc.ScaleCollapseError as err:
            assert int(dev.failure) != 0
            with pytest.raises(type(err)):
                dev.check()
            # The device state keeps the last valid values and stays frozen.
            frozen = sc.device_update(np, dev, np.bool_(False))
            assert all(getattr(frozen, n) == getattr(dev, n) for n in DATA_FIELDS)
            assert float(dev.scale) == host.scale
            return
        assert int(dev.failure) == 0
        assert dev.scale.dtype == np.float32
        assert dev.to_host() == host


def test_defaults_match_pytorch() -> None:
    cfg = sc.ScalerConfig()
    assert (cfg.init_scale, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval) == (
        2.0**16,
        2.0,
        0.5,
        2000,
    )


def test_growth_needs_exactly_interval_clean_steps() -> None:
    state = sc.init(sc.ScalerConfig(growth_interval=3))
    for _ in range(2):
        state = sc.update(state, False)
    assert state.scale == 2.0**16
    state = sc.update(state, True)  # the overflow restarts the count
    for _ in range(2):
        state = sc.update(state, False)
    assert state.scale == 2.0**15
    state = sc.update(state, False)
    assert state.scale == 2.0**16
    assert state.growth_tracker == 0


def test_growth_stops_below_float32_max() -> None:
    cfg = sc.ScalerConfig(init_scale=2.0**127, growth_interval=1)
    state = sc.update(sc.init(cfg), False)
    assert state.scale == 2.0**127
    assert sc.classify(state, False) is sc.StepKind.GROWTH_BLOCKED


def test_backoff_to_subnormal_fails_closed_and_leaves_state() -> None:
    state = sc.init(sc.ScalerConfig(init_scale=2.0**-126))
    with pytest.raises(sc.ScaleCollapseError, match="not a normal float32"):
        sc.update(state, True)
    assert state == sc.init(sc.ScalerConfig(init_scale=2.0**-126))


def test_floor_holds_or_raises() -> None:
    hold = sc.init(sc.ScalerConfig(init_scale=4.0, min_scale=2.0))
    hold = sc.update(sc.update(hold, True), True)
    assert hold.scale == 2.0
    assert sc.classify(hold, True) is sc.StepKind.HOLD_AT_FLOOR
    strict = sc.init(sc.ScalerConfig(init_scale=4.0, min_scale=2.0, at_min_scale="raise"))
    strict = sc.update(strict, True)  # 4 -> 2: reaching the floor is fine (DeepSpeed)
    with pytest.raises(sc.ScaleCollapseError, match="min_scale"):
        sc.update(strict, True)


def test_hysteresis_megatron_refill_on_growth() -> None:
    cfg = sc.ScalerConfig(init_scale=64.0, hysteresis=3, growth_interval=2)
    s = sc.init(cfg)
    s = sc.update(s, True)
    s = sc.update(s, True)
    assert s.scale == 64.0  # two overflows absorbed
    s = sc.update(s, True)
    assert s.scale == 32.0
    s = sc.update(s, False)  # a clean step does not refill (Megatron)
    s = sc.update(s, True)
    assert s.scale == 16.0
    s = sc.update(sc.update(s, False), False)  # growth refills
    assert (s.scale, s.hysteresis_tracker) == (32.0, 3)


def test_hysteresis_deepspeed_consecutive_refills_on_clean_step() -> None:
    cfg = sc.ScalerConfig(init_scale=64.0, hysteresis=2, hysteresis_refill="on_clean_step")
    s = sc.init(cfg)
    for _ in range(5):  # alternating overflow / clean never backs off
        s = sc.update(sc.update(s, True), False)
    assert s.scale == 64.0
    s = sc.update(sc.update(s, True), True)
    assert s.scale == 32.0


def test_skip_limit_fails_closed() -> None:
    s = sc.init(sc.ScalerConfig(max_consecutive_skips=2, min_scale=1.0))
    s = sc.update(sc.update(s, True), True)
    with pytest.raises(sc.SkipLimitError, match="max_consecutive_skips=2"):
        sc.update(s, True)
    s = sc.update(s, False)
    assert s.consecutive_skips == 0


def test_static_mode_detects_but_never_changes_scale() -> None:
    s = sc.init(sc.ScalerConfig.static(8.0))
    for found in [True, False] * 50:
        s = sc.update(s, found)
    assert (s.scale, s.steps, s.skipped_steps) == (8.0, 100, 50)


def test_counters_saturate_instead_of_wrapping() -> None:
    s = dataclasses.replace(
        sc.init(), steps=INT32_MAX, skipped_steps=INT32_MAX, consecutive_skips=INT32_MAX
    )
    s = sc.update(s, True)
    assert (s.steps, s.skipped_steps, s.consecutive_skips) == (INT32_MAX,) * 3
    dev = sc.device_update(np, dataclasses.replace(s, scale=2.0**16), np.bool_(True))
    assert int(dev.steps) == INT32_MAX
    assert int(dev.consecutive_skips) == INT32_MAX


def test_update_rejects_non_bool_flags() -> None:
    state = sc.init()
    for bad in (1, 0.0, None, "yes", np.float32(1.0), np.array([True])):
        with pytest.raises(sc.GradientTypeError, match="found_non_finite"):
            sc.update(state, bad)


def test_device_collapse_is_recorded_and_raised_at_first_host_look() -> None:
    state = sc.init(sc.ScalerConfig(init_scale=2.0**-125))
    dev = sc.device_update(np, state, np.bool_(True))
    assert float(dev.scale) == 2.0**-126
    dev = sc.device_update(np, dev, np.bool_(True))
    assert int(dev.failure) == sc.Failure.COLLAPSE
    assert float(dev.scale) == 2.0**-126, "the device state keeps the last valid scale"
    for look in (dev.check, dev.current_scale, dev.to_host, lambda: sc.to_dict(dev)):
        with pytest.raises(sc.ScaleCollapseError, match="recorded"):
            look()
    with pytest.raises(sc.ScaleCollapseError):
        sc.update(dev, False)


@given(states(), flag_sequences(max_size=30))
def test_device_equals_host_from_any_valid_state(state: sc.ScalerState, flags: list[bool]) -> None:
    """From any state a checkpoint may hold (not only init), as from_dict accepts them."""
    with np.errstate(all="ignore"):
        _compare_device_and_host(state, state, flags)


_NORMS = st.one_of(
    st.floats(0, 1e6, width=32), st.sampled_from([0.0, 1.0, 2.0**-130, math.inf, math.nan])
)


@given(st.one_of(states(), states(configs(spikes=True))), st.booleans(), _NORMS)
def test_the_host_and_a_device_read_one_rule(
    state: sc.ScalerState, found: bool, norm: float
) -> None:
    """One step of the rule on Python scalars (the host) and on NumPy 0-d arrays (a
    device) gives the same fields, bit for bit, a refused step's failure code included:
    the host's outcome records it as the device does."""
    host = host_outcome(state, found, norm)
    with np.errstate(all="ignore"):  # float32 overflow is part of the rules on a device
        dev = sc.device_update(np, state, np.bool_(found), np.float32(norm))
    for name in DATA_FIELDS:
        want, got = getattr(host, name), getattr(dev, name)
        assert type(want) is (float if isinstance(want, float) else int), name
        assert np.asarray(got).tobytes() == np.asarray(want, np.asarray(got).dtype).tobytes(), name


@given(states())
def test_assemble_builds_the_state_the_constructor_builds(state: sc.ScalerState) -> None:
    built = _assemble(state.config, {n: getattr(state, n) for n in DATA_FIELDS})
    assert type(built) is ScalerState
    assert built == state
    assert vars(built) == vars(state)
    assert repr(built) == repr(state)
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.scale = 1.0  # type: ignore[misc]


def test_a_static_scale_never_touches_the_trackers() -> None:
    cfg = sc.ScalerConfig(dynamic=False, hysteresis=3, hysteresis_refill="on_clean_step")
    loaded = sc.from_dict(
        {
            **sc.to_dict(sc.init(cfg)),
            "state": {
                **sc.to_dict(sc.init(cfg))["state"],
                "hysteresis_tracker": 1,
                "growth_tracker": 0,
            },
        }
    )
    for found in (False, True):
        host = sc.update(loaded, found)
        dev = sc.device_update(np, loaded, np.bool_(found))
        assert host.hysteresis_tracker == 1
        assert dev.to_host() == host


def test_a_backoff_that_rounds_up_to_the_smallest_normal_is_one_on_every_path() -> None:
    """FLT_MIN * (1 - 2**-24) is a tie that rounds to FLT_MIN itself; a device that
    flushes subnormals (XLA) must not see a collapse there either."""
    factor = 1 - 2.0**-24
    for scale in (F32_TINY, float(np.nextafter(np.float32(F32_TINY), np.float32(1)))):
        state = sc.init(sc.ScalerConfig(init_scale=scale, backoff_factor=factor))
        host = sc.update(state, True)
        dev = sc.device_update(np, state, np.bool_(True))
        assert dev.to_host() == host


# ------------------------------------------------------------ spike skipping
def _flush(value: np.float32) -> np.float32:
    """XLA's flush of float32 subnormals, which every path of the rule applies."""
    return np.float32(0.0) if abs(float(value)) < F32_TINY else np.float32(value)


@dataclasses.dataclass
class SpikeModel:
    """An independent statement of the spike rule (docs/policies.md, "Spike skipping")."""

    k2: np.float32
    window: int
    mean: np.float32 = dataclasses.field(default_factory=lambda: np.float32(0.0))
    var: np.float32 = dataclasses.field(default_factory=lambda: np.float32(0.0))
    count: int = 0

    def is_spike(self, x: np.float32) -> bool:
        with np.errstate(all="ignore"):
            d = _flush(x - self.mean)
            return bool(
                self.count >= self.window and d > 0 and _flush(d * d) > _flush(self.k2 * self.var)
            )

    def absorb(self, x: np.float32) -> None:
        with np.errstate(all="ignore"):
            if not np.isfinite(x):
                return
            d = _flush(x - self.mean)
            dd = _flush(d * d)
            n = min(self.count + 1, self.window)
            a = _flush(np.float32(1.0) / np.float32(n))
            mean = _flush(self.mean + _flush(a * d))
            var = _flush(_flush(np.float32(1.0) - a) * _flush(self.var + _flush(a * dd)))
        if np.isfinite(dd) and np.isfinite(mean) and np.isfinite(var):
            self.mean, self.var, self.count = mean, var, n


NORMS = st.one_of(
    st.sampled_from([1.0, 1.1, 0.9, 1.0, 50.0, 0.0, math.nan, math.inf, 1e30, 1e-40]),
    st.floats(0.0, 10.0),
)


class SpikeMachine(RuleBasedStateMachine):
    """``update`` with spike skipping against the scaler model plus the spike model."""

    def __init__(self) -> None:
        super().__init__()
        self.state: sc.ScalerState
        self.model: Model
        self.spikes: SpikeModel

    @initialize(cfg=configs(spikes=True, max_spike_window=4))
    def start(self, cfg: sc.ScalerConfig) -> None:
        assert cfg.spike_threshold is not None
        self.state = sc.init(cfg)
        self.model = Model.start(cfg)
        k = cfg.spike_threshold
        self.spikes = SpikeModel(np.float32(np.float64(k) * np.float64(k)), cfg.spike_window)

    @rule(found=st.booleans(), norm=NORMS)
    def step(self, found: bool, norm: float) -> None:
        before = self.state
        snapshot = dataclasses.astuple(before)
        x = _flush(np.float32(norm))
        spike = not found and self.spikes.is_spike(x)
        saved_model, saved_spikes = (
            dataclasses.replace(self.model),
            dataclasses.replace(self.spikes),
        )
        try:
            if spike:
                cfg = before.config
                limit = cfg.max_consecutive_skips
                if limit is not None and self.model.consec >= limit:
                    raise RefusedError("skip limit")
                self.model.steps += 1
                self.model.skipped += 1
                self.model.consec += 1
            else:
                self.model.step(found)
        except RefusedError as why:
            self.model, self.spikes = saved_model, saved_spikes
            note(f"model refuses: {why}")
            with pytest.raises(sc.ScaleCollapseError):
                sc.update(before, found, grad_norm=norm)
            assert dataclasses.astuple(before) == snapshot
            return
        if not found:
            self.spikes.absorb(x)
        after = sc.update(before, found, grad_norm=norm)
        assert dataclasses.astuple(before) == snapshot, "update mutated its input"
        assert self.model.matches(after), (after, self.model)
        assert (after.last_step is sc.StepKind.SPIKE_SKIP) == spike
        if spike:
            assert (after.scale, after.growth_tracker, after.hysteresis_tracker) == (
                before.scale,
                before.growth_tracker,
                before.hysteresis_tracker,
            )
        assert (after.norm_mean, after.norm_var, after.norm_count) == (
            float(self.spikes.mean),
            float(self.spikes.var),
            self.spikes.count,
        )
        with np.errstate(all="ignore"):  # float32 overflow is part of the rules on a device
            dev = sc.device_update(np, before, np.bool_(found), np.float32(norm))
        assert dev.to_host() == after
        self.state = after

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "state"):
            check_invariants(self.state)


TestSpikeMachine = SpikeMachine.TestCase


def test_the_spike_model_catches_a_mutant_rule() -> None:
    """The model is not vacuous: a rule that also skips downward outliers disagrees with it."""
    model = SpikeModel(np.float32(1.0), 2, np.float32(10.0), np.float32(1.0), 2)
    assert model.is_spike(np.float32(12.0))
    assert not model.is_spike(np.float32(8.0))  # below the mean: never a spike
    state = dataclasses.replace(
        sc.init(sc.ScalerConfig(spike_threshold=1.0, spike_window=2)),
        norm_mean=10.0,
        norm_var=1.0,
        norm_count=2,
    )
    assert sc.classify(state, False, 8.0) is not sc.StepKind.SPIKE_SKIP
    assert sc.classify(state, False, 12.0) is sc.StepKind.SPIKE_SKIP
