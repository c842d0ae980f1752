"""Presets whose package is impractical here, against their published behaviour.

DeepSpeed, Megatron-LM, Paddle and apex need CUDA builds, so each preset is
checked two ways: against the examples of the anchor's own test suite (cited
per test, expected values as published), and step by step against a short
re-statement of the anchor's update rule (cited source file) on random flag
sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core._f32 import FLT_MIN, f32
from scaler_core.testing import flag_sequences


def _run(config: sc.ScalerConfig, flags: list[bool]) -> list[float]:
    state = sc.init(config)
    out = []
    for flag in flags:
        state = sc.update(state, flag)
        out.append(state.scale)
    return out


# --------------------------------------------------------------------- DeepSpeed
# deepspeedai/DeepSpeed tests/unit/runtime/half_precision/test_dynamic_loss_scale.py


def test_deepspeed_all_overflow_fused_example() -> None:
    # TestFused.test_all_overflow: initial_scale_power 4, loss_scale_window 2,
    # default min_loss_scale 1; after each of 8 overflows the scale is max(s / 2, 1).
    config = sc.preset(
        "deepspeed",
        init_scale=2.0**4,
        scale_window=2,
        delayed_shift=1,
        raise_error_at_min_scale=False,
    )
    assert _run(config, [True] * 8) == [8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def test_deepspeed_all_overflow_unfused_example() -> None:
    # TestUnfused.test_all_overflow: the same with min_loss_scale 0.25.
    config = sc.preset(
        "deepspeed",
        init_scale=2.0**4,
        scale_window=2,
        min_scale=0.25,
        delayed_shift=1,
        raise_error_at_min_scale=False,
    )
    assert _run(config, [True] * 8) == [8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.25, 0.25]


def test_deepspeed_some_overflow_example() -> None:
    # TestFused.test_some_overflow: from 2**8, two overflows give 2**6, then
    # scale_window + 1 = 3 clean steps give one growth (2**7), then one overflow
    # gives 2**6 again.
    config = sc.preset("deepspeed", init_scale=2.0**8, scale_window=2, delayed_shift=1)
    scales = _run(config, [True, True, False, False, False, True])
    assert scales[1] == 2.0**6
    assert scales[4] == 2.0**7
    assert scales[5] == 2.0**6


def test_deepspeed_raises_at_the_floor_like_raise_error_at_min_scale() -> None:
    # deepspeed/runtime/fp16/loss_scaler.py: with raise_error_at_min_scale=True an
    # overflow that needs a backoff while cur_scale == min_scale raises.
    config = sc.preset("deepspeed", init_scale=4.0, scale_window=2, delayed_shift=2)
    state = sc.init(config)
    for _ in range(3):  # hysteresis 2 absorbs the first: 4 -> 4 -> 2 -> 1
        state = sc.update(state, True)
    assert state.scale == 1.0
    with pytest.raises(sc.ScaleCollapseError, match="at_min_scale='raise'"):
        sc.update(state, True)


@dataclass
class DeepSpeedRule:
    """deepspeed/runtime/fp16/loss_scaler.py DynamicLossScaler.update_scale, restated."""

    scale: float
    window: int
    floor: float
    shift: int
    consecutive: bool
    raise_at_floor: bool
    it: int = 0
    last_overflow: int = -1
    hyst: int = field(init=False)

    def __post_init__(self) -> None:
        self.hyst = self.shift

    def step(self, overflow: bool) -> None:
        if overflow:
            if self.shift == 1 or self.hyst == 1:
                if self.scale == self.floor and self.raise_at_floor:
                    raise RuntimeError("at minimum")
                self.scale = max(self.scale / 2.0, self.floor)
            else:
                self.hyst -= 1
            self.last_overflow = self.it
        else:
            if self.consecutive:
                self.hyst = self.shift
            if (self.it - self.last_overflow) % self.window == 0:
                if not self.consecutive:
                    self.hyst = self.shift
                self.scale *= 2.0
        self.it += 1


_POW2 = st.integers(-20, 40).map(lambda e: 2.0**e)


@given(
    _POW2,
    st.integers(1, 6),
    st.integers(1, 4),
    st.tuples(st.booleans(), st.booleans()),
    flag_sequences(max_size=150),
)
def test_deepspeed_preset_follows_its_update_scale(
    init: float, window: int, shift: int, options: tuple[bool, bool], flags: list[bool]
) -> None:
    consecutive, raise_ = options
    floor = min(1.0, init)
    ref = DeepSpeedRule(init, window, floor, shift, consecutive, raise_)
    config = sc.preset(
        "deepspeed",
        init_scale=init,
        scale_window=window,
        min_scale=floor,
        delayed_shift=shift,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=raise_,
    )
    state = sc.init(config)
    for flag in flags:
        try:
            ref.step(flag)
        except RuntimeError:
            with pytest.raises(sc.ScaleCollapseError):
                sc.update(state, flag)
            return
        state = sc.update(state, flag)
        assert state.scale == ref.scale


# ---------------------------------------------------------------------- Megatron
# NVIDIA/Megatron-LM megatron/core/optimizer/grad_scaler.py DynamicGradScaler.update.
# Megatron-LM ships no unit test of this class that we could find, so the preset
# is checked against the rule itself.


@dataclass
class MegatronRule:
    scale: float
    floor: float
    interval: int
    hysteresis: int
    growth: int = 0
    hyst: int = field(init=False)

    def __post_init__(self) -> None:
        self.hyst = self.hysteresis

    def step(self, found_inf: bool) -> None:
        if found_inf:
            self.growth = 0
            self.hyst -= 1
            if self.hyst <= 0:
                self.scale = max(f32(self.scale * 0.5), self.floor)
        else:
            self.growth += 1
            if self.growth == self.interval:
                self.growth = 0
                self.hyst = self.hysteresis
                self.scale = f32(self.scale * 2.0)


@given(_POW2, st.integers(1, 6), st.integers(1, 4), flag_sequences(max_size=150))
def test_megatron_preset_follows_dynamic_grad_scaler(
    init: float, interval: int, hysteresis: int, flags: list[bool]
) -> None:
    floor = min(1.0, init)
    ref = MegatronRule(init, floor, interval, hysteresis)
    config = sc.preset(
        "megatron",
        initial_scale=init,
        min_scale=floor,
        growth_interval=interval,
        hysteresis=hysteresis,
    )
    state = sc.init(config)
    for flag in flags:
        ref.step(flag)
        state = sc.update(state, flag)
        assert state.scale == ref.scale
        assert state.growth_tracker == ref.growth


# ------------------------------------------------------------------------ Paddle
# PaddlePaddle/Paddle test/legacy_test/test_update_loss_scaling_op.py


def _paddle_state(good: int, bad: int) -> sc.ScalerState:
    # TestUpdateLossScalingOp.init: prev_loss_scaling 2048, num_good_steps 999,
    # num_bad_steps 1, incr_every_n_steps 1000, decr_every_n_nan_or_inf 2,
    # incr_ratio 2.0, decr_ratio 0.8. Paddle's bad-step count is our hysteresis
    # budget spent: hysteresis_tracker = decr_every_n_nan_or_inf - num_bad_steps.
    config = sc.preset(
        "paddle",
        init_loss_scaling=2048.0,
        incr_ratio=2.0,
        decr_ratio=0.8,
        incr_every_n_steps=1000,
        decr_every_n_nan_or_inf=2,
    )
    return sc.ScalerState(config, scale=2048.0, growth_tracker=good, hysteresis_tracker=2 - bad)


def test_paddle_update_loss_scaling_good_step_example() -> None:
    # Expected: LossScaling = prev * incr_ratio, OutGoodSteps = OutBadSteps = 0.
    state = sc.update(_paddle_state(999, 1), False)
    assert state.scale == 2048.0 * 2.0
    assert (state.growth_tracker, 2 - state.hysteresis_tracker) == (0, 0)


def test_paddle_update_loss_scaling_bad_step_example() -> None:
    # TestUpdateLossScalingOpBad: LossScaling = prev * decr_ratio (float32 math,
    # decr_ratio a float32 attribute), OutGoodSteps = OutBadSteps = 0.
    state = sc.update(_paddle_state(999, 1), True)
    assert state.scale == f32(2048.0 * f32(0.8))
    assert (state.growth_tracker, 2 - state.hysteresis_tracker) == (0, 0)


@dataclass
class PaddleRule:
    """The update_loss_scaling kernel (paddle/phi/kernels/impl/amp_kernel_impl.h)."""

    scale: float
    incr_every: int
    decr_every: int
    incr: float
    decr: float
    good: int = 0
    bad: int = 0

    def step(self, found_inf: bool) -> None:
        if found_inf:
            self.good = 0
            self.bad += 1
            if self.bad == self.decr_every:
                new = f32(self.scale * self.decr)
                self.scale = 1.0 if new < 1.0 else new
                self.bad = 0
        else:
            self.bad = 0
            self.good += 1
            if self.good == self.incr_every:
                new = f32(self.scale * self.incr)
                self.scale = new if math.isfinite(new) else self.scale
                self.good = 0


@given(
    st.one_of(_POW2.filter(lambda x: x >= 1.0), st.floats(1.0, 2.0**100, width=32)),
    st.integers(1, 6),
    st.integers(1, 4),
    st.sampled_from([(2.0, 0.5), (2.0, 0.8), (3.0, 0.25), (1.5, 0.9)]),
    flag_sequences(max_size=150),
)
def test_paddle_preset_follows_update_loss_scaling(
    init: float,
    incr_every: int,
    decr_every: int,
    ratios: tuple[float, float],
    flags: list[bool],
) -> None:
    incr, decr = ratios
    ref = PaddleRule(init, incr_every, decr_every, f32(incr), f32(decr))
    config = sc.preset(
        "paddle",
        init_loss_scaling=init,
        incr_ratio=incr,
        decr_ratio=decr,
        incr_every_n_steps=incr_every,
        decr_every_n_nan_or_inf=decr_every,
    )
    state = sc.init(config)
    for flag in flags:
        ref.step(flag)
        state = sc.update(state, flag)
        assert state.scale == ref.scale
        assert (state.growth_tracker, decr_every - state.hysteresis_tracker) == (ref.good, ref.bad)


# -------------------------------------------------------------------------- apex
# NVIDIA/apex tests/L0/run_amp/test_update_scale_hysteresis.py, the test of apex's
# fused hysteresis kernel (amp_C.update_scale_hysteresis): hysteresis refills on
# every clean step, which is hysteresis_refill="on_clean_step" (DeepSpeed's
# consecutive_hysteresis). The test draws extra_iters at random; these are fixed
# values where no backoff underflows (the kernel then writes 0; we refuse).


@pytest.mark.parametrize("init", [1.0, 1024.0, 65536.0])
@pytest.mark.parametrize("factors", [(2.0, 0.5), (2.0, 0.25), (4.0, 0.5)])
@pytest.mark.parametrize("interval", [10, 100])
@pytest.mark.parametrize("hysteresis", [10, 100])
@pytest.mark.parametrize("extra", [0, 7, 23])
def test_apex_update_scale_hysteresis_example(
    init: float, factors: tuple[float, float], interval: int, hysteresis: int, extra: int
) -> None:
    growth, backoff = factors
    config = sc.ScalerConfig(
        init_scale=init,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        hysteresis=hysteresis,
        hysteresis_refill="on_clean_step",
    )
    state = sc.init(config)
    for _ in range(hysteresis - 1):  # hysteresis - 1 infs: scale unchanged
        state = sc.update(state, True)
    assert state.scale == init
    for _ in range(interval - 1):  # growth_interval - 1 clean steps: unchanged
        state = sc.update(state, False)
    assert state.scale == init
    ref = state.scale
    for _ in range(hysteresis + extra):  # then backed off on 1 + extra of them
        state = sc.update(state, True)
    for _ in range(1 + extra):
        ref *= backoff
    assert state.scale == ref
    ref = state.scale
    for _ in range(interval + extra):  # grown 1 + floor(extra / interval) times
        state = sc.update(state, False)
    for _ in range(1 + extra // interval):
        ref *= growth
    assert state.scale == ref


@dataclass
class ApexRule:
    """apex/amp/scaler.py LossScaler.update_scale, restated (float64 Python floats)."""

    scale: float
    window: int
    floor: float | None
    ceiling: float
    unskipped: int = 0

    def step(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.floor, self.scale / 2.0) if self.floor else self.scale / 2.0
            self.unskipped = 0
        else:
            self.unskipped += 1
        if self.unskipped == self.window:
            self.scale = min(self.ceiling, self.scale * 2.0)
            self.unskipped = 0


@given(
    st.one_of(_POW2, st.floats(2.0**-20, 2.0**24, width=32)),
    st.integers(1, 6),
    st.sampled_from([None, 2.0**-10, 1.0]),
    st.sampled_from([2.0**24, 2.0**30]),
    flag_sequences(max_size=150),
)
def test_apex_preset_follows_loss_scaler(
    init: float, window: int, floor: float | None, ceiling: float, flags: list[bool]
) -> None:
    init = min(init, ceiling)  # apex would let a growth lower a scale above the ceiling
    if floor is not None:
        floor = min(floor, init)
    ref = ApexRule(init, window, floor, ceiling)
    config = sc.preset(
        "apex",
        init_scale=init,
        scale_window=window,
        min_loss_scale=floor,
        max_loss_scale=ceiling,
    )
    state = sc.init(config)
    for flag in flags:
        ref.step(flag)
        if ref.scale < FLT_MIN:  # apex carries on towards 0; we refuse instead
            with pytest.raises(sc.ScaleCollapseError):
                sc.update(state, flag)
            return
        state = sc.update(state, flag)
        assert state.scale == ref.scale
