"""Spike skipping: a step whose gradient norm is far above the recent window is skipped."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import numpy as np
import pytest
from common_checkpoints import version_1
from hypothesis import given
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core import PolicyViolationError
from scaler_core._serialize import SCHEMA_VERSION
from scaler_core._state import COUNTER_FIELDS, DATA_FIELDS, FLOAT_FIELDS, device_update
from scaler_core.testing import (
    check_invariants,
    check_policy,
    configs,
    flag_sequences,
    norm_sequences,
    states,
)

SPIKY = sc.ScalerConfig(spike_threshold=3.0, spike_window=4, growth_interval=3, hysteresis=2)
CALM = (1.0, 1.25, 0.75, 1.0, 1.125)


def _warm(cfg: sc.ScalerConfig = SPIKY, norms: tuple[float, ...] = CALM) -> sc.ScalerState:
    state = sc.init(cfg)
    for norm in norms:
        state = sc.update(state, False, grad_norm=norm)
    return state


def test_a_planted_spike_is_skipped_and_touches_only_the_skip_counters() -> None:
    # One overflow first, so the hysteresis tracker is mid-budget and could move.
    state = sc.update(_warm(), True, grad_norm=math.nan)  # the norm of non-finite gradients
    state = sc.update(state, False, grad_norm=1.0)
    assert (state.hysteresis_tracker, state.growth_tracker) == (1, 1)
    spike = sc.update(state, False, grad_norm=100.0)
    assert sc.classify(state, False, 100.0) is sc.StepKind.SPIKE_SKIP
    assert spike.last_step is sc.StepKind.SPIKE_SKIP
    assert (spike.scale, spike.growth_tracker, spike.hysteresis_tracker) == (
        state.scale,
        state.growth_tracker,
        state.hysteresis_tracker,
    )
    assert spike.steps == state.steps + 1
    assert spike.skipped_steps == state.skipped_steps + 1
    assert spike.consecutive_skips == state.consecutive_skips + 1
    # The step after it is an ordinary clean step again.
    after = sc.update(spike, False, grad_norm=1.0)
    assert after.last_step is not sc.StepKind.SPIKE_SKIP
    assert after.consecutive_skips == 0


def test_the_same_norm_is_not_a_spike_without_a_full_window_or_with_spikes_off() -> None:
    young = _warm(norms=CALM[:3])  # 3 steps seen, window of 4
    assert young.norm_count == 3
    assert sc.update(young, False, grad_norm=100.0).last_step is sc.StepKind.COUNT
    off = dataclasses.replace(SPIKY, spike_threshold=None)
    plain = sc.init(off)
    for norm in (*CALM, 100.0):
        plain = sc.update(plain, False, grad_norm=norm)
    assert plain.skipped_steps == 0
    assert (plain.norm_mean, plain.norm_var, plain.norm_count) == (0.0, 0.0, 0)
    # grad_norm is ignored: the same states as without it.
    bare = sc.init(off)
    for _ in range(len(CALM) + 1):
        bare = sc.update(bare, False)
    assert bare == plain


def test_the_window_statistics_follow_the_float32_formulas() -> None:
    state = sc.update(sc.init(SPIKY), False, grad_norm=2.0)
    assert (state.norm_mean, state.norm_var, state.norm_count) == (2.0, 0.0, 1)
    mean, var = np.float32(2.0), np.float32(0.0)
    for n, x in zip((2, 3, 4, 4, 4), (3.0, 1.0, 2.5, 2.0, 1.75), strict=True):
        state = sc.update(state, False, grad_norm=x)
        a = np.float32(1) / np.float32(n)
        d = np.float32(x) - mean
        mean = mean + a * d
        var = (np.float32(1) - a) * (var + a * (d * d))
        assert (state.norm_mean, state.norm_var, state.norm_count) == (float(mean), float(var), n)


def test_a_lasting_shift_of_the_norm_is_absorbed_instead_of_skipped_forever() -> None:
    state = _warm(dataclasses.replace(SPIKY, spike_window=8), CALM * 2)
    kinds = []
    for _ in range(40):
        state = sc.update(state, False, grad_norm=4.0)
        kinds.append(state.last_step)
    assert kinds[0] is sc.StepKind.SPIKE_SKIP
    assert sc.StepKind.SPIKE_SKIP not in kinds[-20:]


def test_non_finite_gradients_take_precedence_and_leave_the_statistics() -> None:
    state = _warm()
    after = sc.update(state, True, grad_norm=100.0)
    assert after.last_step in (sc.StepKind.HYSTERESIS, sc.StepKind.BACKOFF)
    assert (after.norm_mean, after.norm_var, after.norm_count) == (
        state.norm_mean,
        state.norm_var,
        state.norm_count,
    )


def test_an_infinite_norm_is_a_spike_and_nan_never_is() -> None:
    state = _warm()
    inf = sc.update(state, False, grad_norm=math.inf)
    assert inf.last_step is sc.StepKind.SPIKE_SKIP
    nan = sc.update(state, False, grad_norm=math.nan)
    assert nan.last_step is sc.StepKind.GROW  # an ordinary clean step (the third in a row)
    for s in (inf, nan):  # neither moves the statistics
        assert (s.norm_mean, s.norm_var, s.norm_count) == (
            state.norm_mean,
            state.norm_var,
            state.norm_count,
        )


def test_spikes_count_towards_the_skip_limit() -> None:
    state = _warm(dataclasses.replace(SPIKY, max_consecutive_skips=1))
    state = sc.update(state, False, grad_norm=100.0)
    assert sc.classify(state, False, 1000.0) is sc.StepKind.SKIP_LIMIT
    with pytest.raises(sc.SkipLimitError):
        sc.update(state, False, grad_norm=1000.0)
    dev = device_update(np, state, np.bool_(False), np.float32(1000.0))
    assert int(dev.failure) == sc.Failure.SKIP_LIMIT
    assert dev.last_kind == state.last_kind  # a failing step changes only `failure`


def test_a_missing_norm_is_refused_before_anything_changes() -> None:
    state = _warm()
    before = copy.deepcopy(state)
    for call in (
        lambda: sc.update(state, False),
        lambda: sc.classify(state, False),
        lambda: device_update(np, state, np.bool_(False)),
    ):
        with pytest.raises(sc.InvalidArgumentError, match=r"grad_norm=None.*unscale_and_norm\(\)"):
            call()
    assert state == before


@pytest.mark.parametrize(
    "bad", [True, "1.0", [1.0], 1j, np.array([1.0]), np.int32(3), np.array(True)]
)
def test_a_norm_that_is_no_real_number_is_refused(bad: Any) -> None:
    state = _warm()
    with pytest.raises(sc.GradientTypeError, match="grad_norm"):
        sc.update(state, False, grad_norm=bad)
    with pytest.raises(sc.GradientTypeError, match="grad_norm"):
        device_update(np, state, np.bool_(False), bad)


@pytest.mark.parametrize("norm", [3.0, np.float32(3.0), np.float64(3.0), np.array(3.0), 3])
def test_host_norms_of_every_kind_step_on_the_host(norm: Any) -> None:
    out = sc.update(_warm(), False, grad_norm=norm)
    assert out.on_host
    assert out == sc.update(_warm(), False, grad_norm=3.0)


@given(configs(spikes=True), st.data())
def test_device_transition_equals_host_transition_with_spikes(
    cfg: sc.ScalerConfig, data: st.DataObject
) -> None:
    flags = data.draw(flag_sequences(max_size=60))
    norms = data.draw(norm_sequences(len(flags), len(flags)))
    with np.errstate(all="ignore"):
        _agree(sc.init(cfg), flags, norms)


@given(states(configs(spikes=True)), st.data())
def test_device_equals_host_with_spikes_from_any_valid_state(
    state: sc.ScalerState, data: st.DataObject
) -> None:
    flags = data.draw(flag_sequences(max_size=30))
    norms = data.draw(norm_sequences(len(flags), len(flags)))
    with np.errstate(all="ignore"):
        _agree(state, flags, norms)


def _agree(state: sc.ScalerState, flags: list[bool], norms: list[float]) -> None:
    host, dev = state, state
    for found, norm in zip(flags, norms, strict=True):
        dev = device_update(np, dev, np.bool_(found), np.float32(norm))
        try:
            host = sc.update(host, found, grad_norm=norm)
        except sc.ScaleCollapseError:
            assert int(dev.failure) != 0
            return
        check_invariants(host)
        assert int(dev.failure) == 0
        assert dev.norm_mean.dtype == np.float32
        assert dev.to_host() == host, (dev, host)


def test_step_kind_codes_are_stable_and_invertible() -> None:
    codes = {kind: kind.code for kind in sc.StepKind}
    assert codes[sc.StepKind.COUNT] == 1
    assert codes[sc.StepKind.SPIKE_SKIP] == 12  # checkpoints store it: never renumber
    assert sorted(codes.values()) == list(range(1, len(codes) + 1))
    for kind, code in codes.items():
        assert sc.StepKind.from_code(code) is kind
    assert sc.StepKind.from_code(0) is None
    for bad in (-1, 13, True, 1.0):
        with pytest.raises(sc.InvalidArgumentError, match="code="):
            sc.StepKind.from_code(bad)  # type: ignore[arg-type]
    assert sc.StepKind.SPIKE_SKIP.skipped
    assert not sc.StepKind.SPIKE_SKIP.fails
    assert sc.init().last_step is None
    dev = device_update(np, sc.init(), np.bool_(True))
    assert dev.last_step is sc.StepKind.BACKOFF


def test_the_data_fields_split_into_float32_and_int32_fields() -> None:
    assert sorted(DATA_FIELDS) == sorted(FLOAT_FIELDS + COUNTER_FIELDS)
    assert not set(FLOAT_FIELDS) & set(COUNTER_FIELDS)
    dev = device_update(np, sc.init(SPIKY), np.bool_(False), 1.0)
    for name in DATA_FIELDS:
        want = np.float32 if name in FLOAT_FIELDS else np.int32
        assert getattr(dev, name).dtype == want, name


@pytest.mark.parametrize("found", [False, True])
def test_with_spike_skipping_off_the_device_rules_pass_the_statistics_through(found: bool) -> None:
    """Off, the statistics never change, so the device rules leave them as they are:
    the very objects given (no arithmetic, no conversion to the namespace's arrays),
    on every namespace, while the other fields become its arrays as before."""
    state = dataclasses.replace(sc.init(), norm_mean=1.5, norm_var=np.float32(0.25), norm_count=3)
    dev = device_update(np, state, np.bool_(found), grad_norm=100.0)  # the norm is ignored
    for name in ("norm_mean", "norm_var", "norm_count"):
        assert getattr(dev, name) is getattr(state, name), name
    assert dev.scale.dtype == np.float32
    assert dev.to_host() == sc.update(dataclasses.replace(state, norm_var=0.25), found)
    spiky = device_update(np, sc.init(SPIKY), np.bool_(found), 1.0)
    assert spiky.norm_count.dtype == np.int32  # on: arrays of the namespace, as every field


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("spike_threshold", 0.0, "spike_threshold=0.0, but it must be None or a finite number > 0"),
        ("spike_threshold", -2.0, "spike_threshold=-2.0"),
        ("spike_threshold", math.inf, "spike_threshold=inf"),
        ("spike_threshold", 1e30, "whose square is a normal float32"),
        ("spike_threshold", True, "spike_threshold=True"),
        ("spike_threshold", "3", "spike_threshold='3'"),
        ("spike_window", 1, "spike_window=1, but it must be an int in \\[2, 16777216\\]"),
        ("spike_window", 2**24 + 1, "spike_window=16777217"),
        ("spike_window", 8.0, "spike_window=8.0"),
    ],
)
def test_spike_fields_are_validated(field: str, value: Any, words: str) -> None:
    with pytest.raises(sc.InvalidConfigError, match=words):
        sc.ScalerConfig(**{field: value})


def test_the_defaults_keep_spike_skipping_off_and_are_serialised_last() -> None:
    cfg = sc.ScalerConfig()
    assert (cfg.spike_threshold, cfg.spike_window) == (None, 128)
    # Appended after every older field (growth_delay came later still), so positional
    # construction of older configs keeps working.
    assert list(cfg.to_dict())[-3:] == ["spike_threshold", "spike_window", "growth_delay"]


# --------------------------------------------------------------- checkpoints
def test_a_version_1_checkpoint_loads_with_spike_skipping_off_and_a_fresh_window() -> None:
    state = sc.update(sc.update(sc.init(sc.ScalerConfig(hysteresis=3)), True), False)
    old = version_1(sc.to_dict(state))
    loaded = sc.from_dict(old)
    assert loaded.config == state.config
    assert loaded.config.spike_threshold is None
    assert (loaded.norm_mean, loaded.norm_var, loaded.norm_count, loaded.last_kind) == (
        0.0,
        0.0,
        0,
        0,
    )
    assert dataclasses.replace(loaded, last_kind=state.last_kind) == state
    assert sc.to_dict(loaded)["version"] == SCHEMA_VERSION == 2
    # A version-1 checkpoint holding version 2's fields is malformed, and the reverse.
    with pytest.raises(sc.InvalidStateError, match="unknown keys"):
        sc.from_dict({**old, "state": sc.to_dict(state)["state"]})
    with pytest.raises(sc.InvalidStateError, match="missing keys"):
        sc.from_dict({**old, "version": 2})


def test_a_spike_state_round_trips_through_a_checkpoint() -> None:
    state = sc.update(_warm(), False, grad_norm=100.0)
    assert state.last_step is sc.StepKind.SPIKE_SKIP
    assert sc.from_dict(sc.to_dict(state)) == state


def _edit(key: str, value: Any) -> dict[str, Any]:
    d = sc.to_dict(_warm())
    d["state"][key] = value
    return d


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (_edit("norm_mean", math.nan), "norm_mean"),
        (_edit("norm_mean", math.inf), "norm_mean"),
        (_edit("norm_mean", 0.1), r"norm_mean.*use 0\.10000000149011612"),
        (_edit("norm_mean", 1e-40), "norm_mean"),
        (_edit("norm_mean", "1.0"), "norm_mean"),
        (_edit("norm_var", -1.0), "norm_var"),
        (_edit("norm_var", True), "norm_var"),
        (_edit("norm_count", 5), r"norm_count.*\[0, 4\]"),
        (_edit("norm_count", -1), "norm_count"),
        (_edit("norm_count", 1.0), "norm_count"),
        (_edit("last_kind", 9), "last_kind"),  # COLLAPSE: a failing step is never recorded
        (_edit("last_kind", 99), "last_kind"),
        (_edit("last_kind", True), "last_kind"),
        (_edit("last_kind", [1]), "last_kind"),
    ],
)
def test_malformed_window_fields_are_refused_by_key(data: dict[str, Any], words: str) -> None:
    before = copy.deepcopy(data)
    with pytest.raises(sc.InvalidStateError, match=words):
        sc.from_dict(data)
    assert data == before


# ------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", sorted(sc.PRESETS))
def test_every_preset_takes_the_spike_knob(name: str) -> None:
    plain = sc.preset(name)
    assert (plain.spike_threshold, plain.spike_window) == (None, 128)
    spiky = sc.preset(name, spike_threshold=6.0, spike_window=32)
    assert (spiky.spike_threshold, spiky.spike_window) == (6.0, 32)
    assert dataclasses.replace(spiky, spike_threshold=None, spike_window=128) == plain
    with pytest.raises(sc.InvalidConfigError, match="spike_threshold=-1"):
        sc.preset(name, spike_threshold=-1)


# ---------------------------------------------------------------- testing kit
def test_the_kit_passes_update_on_spike_configs() -> None:
    check_policy(sc.update, config=configs(spikes=True), max_examples=60)


def test_the_kit_catches_a_policy_that_backs_off_on_a_spike() -> None:
    def backs_off_on_spikes(state: sc.ScalerState, found: Any, norm: Any) -> sc.ScalerState:
        new = sc.update(state, found, norm)
        if new.last_step is sc.StepKind.SPIKE_SKIP:
            return dataclasses.replace(new, scale=max(new.scale / 2, state.config.init_scale / 2))
        return new

    cfg = sc.ScalerConfig(spike_threshold=1.0, spike_window=2, min_scale=1.0)
    with pytest.raises(PolicyViolationError, match="spike skip"):
        check_policy(backs_off_on_spikes, config=cfg, max_examples=200)


def test_the_kit_catches_a_policy_that_ignores_spikes() -> None:
    def ignores_spikes(state: sc.ScalerState, found: Any, norm: Any) -> sc.ScalerState:
        return sc.update(state, found)

    cfg = sc.ScalerConfig(spike_threshold=1.0, spike_window=2)
    with pytest.raises(PolicyViolationError):
        check_policy(ignores_spikes, config=cfg, max_examples=50)


@given(
    config=configs(spikes=True),
    flags=flag_sequences(min_size=1, max_size=40),
    data=st.data(),
)
def test_step_skipped_is_one_rule_on_the_host_and_on_arrays(
    config: sc.ScalerConfig, flags: list[bool], data: st.DataObject
) -> None:
    """step_skipped over the state after a step: the host outcome, the device
    transition on NumPy arrays and the host classification agree on every step,
    the refused one included, and every step after a refusal is skipped."""
    from scaler_core._state import SKIPPED_CODES, host_outcome

    assert tuple(sorted(k.code for k in sc.StepKind if k.skipped)) == SKIPPED_CODES
    norms = data.draw(norm_sequences(min_size=len(flags), max_size=len(flags)), label="norms")
    host = dev = sc.init(config)
    failed = False
    for found, norm in zip(flags, norms, strict=True):
        kind = None if failed else sc.classify(host, found, norm)
        host = host_outcome(host, found, norm)
        with np.errstate(all="ignore"):  # a growth past float32 max is formed, then blocked
            dev = device_update(np, dev, np.bool_(found), np.float32(norm))
        skipped = sc.step_skipped(host)
        assert skipped is bool(sc.step_skipped(dev, np))
        assert skipped is (failed or kind is None or kind.skipped)
        failed = failed or int(host.failure) != 0
        assert skipped or not failed
