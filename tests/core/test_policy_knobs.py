"""The knobs the presets need: growth at the ceiling (block/clamp), Paddle's refill and
DeepSpeed's uncounted first clean step (growth_delay)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given

from scaler_core import InvalidConfigError, ScaleCollapseError, ScalerConfig, init, update
from scaler_core._f32 import FLT_MAX
from scaler_core._state import DATA_FIELDS, StepKind, classify, device_update
from scaler_core.testing import check_invariants, configs, flag_sequences


def _fields(state: object) -> tuple[object, ...]:
    return tuple(float(getattr(state, n)) for n in DATA_FIELDS)


@given(configs(), flag_sequences(max_size=120))
def test_host_and_device_agree_on_every_knob(config: ScalerConfig, flags: list[bool]) -> None:
    host = init(config)
    dev = init(config)
    with np.errstate(over="ignore", under="ignore"):
        _agree(host, dev, flags)


def _agree(host: Any, dev: Any, flags: list[bool]) -> None:
    for flag in flags:
        try:
            host = update(host, flag)
        except ScaleCollapseError:
            dev = device_update(np, dev, np.bool_(flag))
            assert int(dev.failure) != 0
            return
        dev = device_update(np, dev, np.bool_(flag))
        check_invariants(host)
        assert _fields(host) == _fields(dev)


def test_clamp_grows_to_max_scale_where_block_keeps_the_scale() -> None:
    base = ScalerConfig(init_scale=3 * 2.0**22, growth_interval=1, max_scale=2.0**24)
    assert update(init(base), False).scale == 3 * 2.0**22
    clamp = dataclasses.replace(base, at_max_scale="clamp")
    state = update(init(clamp), False)
    assert state.scale == 2.0**24
    assert classify(state, False) is StepKind.GROWTH_BLOCKED
    assert update(state, False).scale == 2.0**24


def test_clamp_without_max_scale_stops_at_the_largest_float32() -> None:
    config = ScalerConfig(init_scale=2.0**127, growth_interval=1, at_max_scale="clamp")
    state = update(init(config), False)
    assert state.scale == FLT_MAX
    assert update(state, False).scale == FLT_MAX
    blocked = update(init(dataclasses.replace(config, at_max_scale="block")), False)
    assert blocked.scale == 2.0**127


def test_refill_on_backoff_needs_a_full_budget_again() -> None:
    config = ScalerConfig(
        init_scale=1024.0, hysteresis=2, hysteresis_refill="on_clean_step_or_backoff"
    )
    state = init(config)
    scales = []
    for _ in range(4):
        state = update(state, True)
        scales.append(state.scale)
    # Paddle's decr_every_n_nan_or_inf=2: every second overflow backs off.
    assert scales == [1024.0, 512.0, 512.0, 256.0]
    on_clean = dataclasses.replace(config, hysteresis_refill="on_clean_step")
    state = init(on_clean)
    for _ in range(3):
        state = update(state, True)
    assert state.scale == 256.0


@pytest.mark.parametrize(
    ("field", "value"), [("at_max_scale", "cap"), ("hysteresis_refill", "on_backoff")]
)
def test_unknown_knob_values_are_refused_by_name(field: str, value: str) -> None:
    with pytest.raises(InvalidConfigError, match=f"{field}={value!r}"):
        ScalerConfig(**{field: value})


# ------------------------------------------------------------------ growth_delay
def _scales(config: ScalerConfig, flags: list[bool]) -> list[float]:
    state, out = init(config), []
    for flag in flags:
        state = update(state, flag)
        out.append(state.scale)
    return out


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_growth_delay_postpones_only_the_first_growth_after_a_skip(delay: int) -> None:
    config = ScalerConfig(init_scale=64.0, growth_interval=2, growth_delay=delay)
    flags = [False] * (2 + delay + 4) + [True] + [False] * (2 + delay)
    scales = _scales(config, flags)
    first = 2 + delay  # clean steps before the first growth
    assert scales[first - 2] == 64.0
    assert scales[first - 1] == 128.0
    assert scales[first + 1] == 256.0  # then every growth_interval clean steps
    assert scales[first + 3] == 512.0
    after = first + 4  # the skipped step
    assert scales[after] == 256.0
    assert scales[after + first - 1] == 256.0
    assert scales[after + first] == 512.0


@pytest.mark.parametrize("bad", [-1, 1.5, True, 2**31 - 2, None])
def test_growth_delay_is_validated_with_its_name(bad: Any) -> None:
    with pytest.raises(InvalidConfigError, match=r"growth_delay=.*int in \[0, 2147483645\]"):
        ScalerConfig(growth_interval=2, growth_delay=bad)


def test_growth_delay_is_in_a_checkpoint_only_when_set() -> None:
    from scaler_core import from_dict, to_dict

    plain = to_dict(init())
    assert "growth_delay" not in plain["config"]  # as written before the knob existed
    state = update(init(ScalerConfig(growth_interval=3, growth_delay=1)), False)
    saved = to_dict(state)
    assert saved["config"]["growth_delay"] == 1
    assert from_dict(saved) == state
    assert from_dict(plain) == init()
