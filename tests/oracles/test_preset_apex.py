"""The apex preset, against a re-statement of apex's rule: the one anchor that cannot run here.

NVIDIA apex builds its ``amp_C`` CUDA extension at install and ``LossScaler`` makes a
``torch.cuda.IntTensor`` when built, so apex does not install nor run on a CPU. Every
other preset is checked against its real library (``test_presets_anchors.py``). The
re-statement below follows ``apex/amp/scaler.py`` (``LossScaler.update_scale``) at
NVIDIA/apex commit b82c6bd7613ffb9c4ea68e7306fa83aabe9fa9b5, and the examples follow
``tests/L0/run_amp/test_update_scale_hysteresis.py`` at commit
6a7787201b0f8f93198d6647325b425b84a64048.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core._f32 import FLT_MIN
from scaler_core.testing import flag_sequences

_POW2 = st.integers(-20, 40).map(lambda e: 2.0**e)


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
    _compare(ref, config, flags)


def _compare(ref: ApexRule, config: sc.ScalerConfig, flags: list[bool]) -> int:
    """Step both; the steps found equal (up to apex's backoff towards 0, refused here)."""
    state = sc.init(config)
    for i, flag in enumerate(flags):
        ref.step(flag)
        if ref.scale < FLT_MIN:  # apex carries on towards 0; we refuse instead
            with pytest.raises(sc.ScaleCollapseError):
                sc.update(state, flag)
            return i
        state = sc.update(state, flag)
        assert state.scale == ref.scale
    return len(flags)


def test_apex_preset_follows_loss_scaler_over_seeded_runs(oracle_tally: dict[str, Any]) -> None:
    """Bursty runs at small windows and apex's defaults over thousands of steps, counted."""
    rng = random.Random("apex/22")
    steps = 0
    runs = 0
    for n in range(30):
        window = 2000 if n == 0 else rng.randint(1, 6)
        init = 2.0**16 if n == 0 else rng.choice([2.0**-120, 1.0, 2.0**16, 2.0**24])
        floor = None if n == 0 else rng.choice([None, min(2.0**-10, init), min(1.0, init)])
        flags: list[bool] = []
        while len(flags) < (4500 if n == 0 else 150):
            flags += [False] * rng.choice([1, 3, 40, 2100] if n == 0 else [1, 2, 5, 12])
            flags += [True] * rng.randint(1, 3)
        config = sc.preset("apex", init_scale=init, scale_window=window, min_loss_scale=floor)
        steps += _compare(ApexRule(init, window, floor, 2.0**24), config, flags)
        runs += 1
    oracle_tally["apex"] = {
        "against": "apex LossScaler re-statement",
        "sequences": runs,
        "steps": steps,
        "differences": {},
    }
    assert steps >= 2000
