"""State in and out: JSON-safe, versioned, validated on load like construction."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core._serialize import SCHEMA_VERSION
from scaler_core.testing import configs, flag_sequences, states


def run(cfg: sc.ScalerConfig, flags: list[bool]) -> sc.ScalerState:
    state = sc.init(cfg)
    for found in flags:
        try:
            state = sc.update(state, found)
        except sc.ScaleCollapseError:
            continue
    return state


@given(configs(), flag_sequences(max_size=60))
def test_round_trip_through_json_keeps_every_field(cfg: sc.ScalerConfig, flags: list[bool]) -> None:
    state = run(cfg, flags)
    text = json.dumps(sc.to_dict(state), allow_nan=False)
    assert sc.from_dict(json.loads(text)) == state


def good() -> dict[str, Any]:
    return sc.to_dict(run(sc.ScalerConfig(growth_interval=4, hysteresis=2), [True, False]))


def edit(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    d = good()
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


def drop(path: tuple[str, ...]) -> dict[str, Any]:
    d = good()
    node = d
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return d


MALFORMED = {
    "empty": ({}, "non-empty"),
    "not a dict": ([1, 2], "a dict"),
    "none": (None, "a dict"),
    "other schema": (edit(("schema",), "torch"), "schema"),
    "future version": (edit(("version",), SCHEMA_VERSION + 1), "upgrade"),
    "bool version": (edit(("version",), True), "version"),
    "unknown key": ({**good(), "extra": 1}, "unknown keys"),
    "missing state": (drop(("state",)), "missing keys"),
    "partial state": (drop(("state", "steps")), "missing keys"),
    "partial config": (drop(("config", "growth_interval")), "missing keys"),
    "nan scale": (edit(("state", "scale"), float("nan")), "scale"),
    "zero scale": (edit(("state", "scale"), 0.0), "scale"),
    "subnormal scale": (edit(("state", "scale"), 1e-40), "scale"),
    "huge int scale": (edit(("state", "scale"), 10**400), "scale"),
    "string scale": (edit(("state", "scale"), "65536"), "scale"),
    # At or past growth_interval is reachable (PyTorch's set_growth_interval), past
    # int32 is not.
    "tracker too big": (edit(("state", "growth_tracker"), 2**31), "growth_tracker"),
    "negative tracker": (edit(("state", "growth_tracker"), -1), "growth_tracker"),
    "float tracker": (edit(("state", "growth_tracker"), 1.0), "growth_tracker"),
    "bool tracker": (edit(("state", "growth_tracker"), True), "growth_tracker"),
    "hysteresis 0": (edit(("state", "hysteresis_tracker"), 0), "hysteresis_tracker"),
    "skips > steps": (edit(("state", "skipped_steps"), 99), "skipped_steps"),
    "bad config": (edit(("config", "growth_factor"), 0.5), "growth_factor"),
    "config not dict": (edit(("config",), "torch"), "a dict"),
    "scale below floor": (
        {**good(), "config": {**good()["config"], "min_scale": 2.0**20, "init_scale": 2.0**20}},
        "scale",
    ),
}


@pytest.mark.parametrize(("data", "words"), MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_checkpoints_get_a_clear_error(data: Any, words: str) -> None:
    before = copy.deepcopy(data)
    with pytest.raises(sc.InvalidStateError, match=words):
        sc.from_dict(data)
    assert data == before, "from_dict modified its input"
    assert isinstance(sc.InvalidStateError("x"), ValueError)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=12,
    )
)
def test_hostile_input_only_ever_raises_invalid_state(data: Any) -> None:
    for candidate in (data, {**good(), "state": data}, {**good(), "config": data}):
        with contextlib.suppress(sc.InvalidStateError):  # anything else fails the test
            sc.from_dict(candidate)


def test_failed_load_leaves_the_scaler_as_it_was() -> None:
    scaler = sc.LossScaler()
    before = scaler.state
    with pytest.raises(sc.InvalidStateError):
        scaler.load_state_dict(edit(("state", "steps"), -5))
    assert scaler.state is before


TORCH_BAD = {
    "disabled scaler saves {}": ({}, "non-empty"),
    "missing tracker": (
        {"scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 10},
        "missing keys",
    ),
    "negative scale": (
        {
            "scale": -1.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 10,
            "_growth_tracker": 0,
        },
        r"state_dict\['scale'\]",
    ),
    "tracker past int32": (
        {
            "scale": 1.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 10,
            "_growth_tracker": 2**31,
        },
        "_growth_tracker",
    ),
}


@pytest.mark.parametrize(("data", "words"), TORCH_BAD.values(), ids=TORCH_BAD.keys())
def test_malformed_torch_state_dicts(data: dict[str, Any], words: str) -> None:
    with pytest.raises(sc.InvalidStateError, match=words):
        sc.from_dict(data)


def test_torch_format_round_trip_without_torch() -> None:
    state = run(sc.ScalerConfig(growth_interval=9, min_scale=4.0), [False, False, True, False])
    exported = sc.to_dict(state, format="torch")
    assert exported == {
        "scale": 32768.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 9,
        "_growth_tracker": 1,
    }
    back = sc.from_dict(exported, sc.ScalerConfig(min_scale=4.0))
    assert (back.scale, back.growth_tracker, back.config.min_scale) == (32768.0, 1, 4.0)


# ------------------------------------------------ messages name the right thing
@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        ("config", "at_min_scale", np.array(["hold", "raise"])),
        ("config", "hysteresis_refill", np.array(["on_growth", "x"])),
        ("config", "at_max_scale", np.array(["block"])),
        ("state", "scale", np.array([65536.0, 1.0])),
        ("state", "steps", np.array([3])),
    ],
)
def test_array_values_in_a_checkpoint_are_refused_by_key(where: str, key: str, value: Any) -> None:
    data = sc.to_dict(sc.init())
    bad = {**data, where: {**data[where], key: value}}
    with pytest.raises(sc.InvalidStateError, match=key):
        sc.from_dict(bad)


@pytest.mark.parametrize(
    ("key", "value"),
    [("schema", np.array(["scaler_core.state"])), ("version", np.array([1])), ("version", 1.0)],
)
def test_schema_and_version_must_be_exactly_what_to_dict_writes(key: str, value: Any) -> None:
    with pytest.raises(sc.InvalidStateError, match=rf"checkpoint\['{key}'\]"):
        sc.from_dict({**sc.to_dict(sc.init()), key: value})


def test_one_pair_of_functions_reads_and_writes_both_formats() -> None:
    """to_dict writes either format, from_dict tells them apart by their keys; a config is
    for PyTorch's format only (scaler-core's carries its own), and an unknown format is
    refused before anything is read."""
    state = run(sc.ScalerConfig(min_scale=4.0), [False, True])
    assert sc.from_dict(sc.to_dict(state)) == state
    back = sc.from_dict(sc.to_dict(state, format="torch"), sc.ScalerConfig(min_scale=4.0))
    assert (back.scale, back.growth_tracker, back.config.min_scale) == (32768.0, 0, 4.0)
    assert back.config.init_scale == back.scale  # the saved scale starts the new run
    with pytest.raises(sc.InvalidStateError, match=r"config=.*carries its own config"):
        sc.from_dict(sc.to_dict(state), sc.ScalerConfig())
    with pytest.raises(sc.InvalidArgumentError, match=r"format='pytorch'.*'torch'"):
        sc.to_dict(state, format="pytorch")


def test_a_torch_state_dict_error_names_its_own_key() -> None:
    data = sc.to_dict(sc.init(), format="torch")
    with pytest.raises(sc.InvalidStateError, match=r"state_dict\['scale'\]=-1\.0") as info:
        sc.from_dict({**data, "scale": -1.0})
    assert "init_scale" not in str(info.value)
    with pytest.raises(sc.InvalidStateError, match=r"state_dict\['backoff_factor'\]"):
        sc.from_dict({**data, "backoff_factor": 1.5})


@pytest.mark.parametrize("scale", [65536.3, 0.1])
def test_a_scale_that_is_not_a_float32_is_refused_like_a_factor(scale: float) -> None:
    """One rule for every number the float32 state holds: exactly a float32, or refused
    with the float32 to use (no silent rounding of a scale, as none of a factor)."""
    nearest = float(np.float32(scale))
    data = sc.to_dict(sc.init())
    with pytest.raises(sc.InvalidStateError, match=rf"use {nearest!r}"):
        sc.from_dict({**data, "state": {**data["state"], "scale": scale}})
    with pytest.raises(sc.InvalidConfigError, match=rf"use {nearest!r}"):
        sc.ScalerConfig(init_scale=scale)
    with pytest.raises(sc.InvalidStateError, match=rf"use {nearest!r}"):
        sc.from_dict({**sc.to_dict(sc.init(), format="torch"), "scale": scale})


# ------------------------------------------- every state to_dict writes, from_dict reads
def _megatron_like(tracker: int) -> sc.ScalerState:
    """A state carrying Megatron's own hysteresis tracker (``DynamicGradScaler`` counts it
    0, -1, -2 ... on consecutive overflows), as a conversion of its state builds it."""
    return sc.ScalerState(sc.preset("megatron"), 2.0**20, 0, tracker)


def _unchecked(state: sc.ScalerState) -> dict[str, Any]:
    """What ``to_dict`` would write for ``state`` without checking it."""
    data = sc.to_dict(sc.init(state.config))
    data["state"] = {k: getattr(state, k) for k in data["state"]}
    return data


@pytest.mark.parametrize("tracker", [0, -1, -2, 3])
def test_a_state_from_dict_would_refuse_is_refused_by_to_dict_with_its_message(
    tracker: int,
) -> None:
    """A run that saves must resume: a hysteresis tracker outside [1, hysteresis] (which
    ``update`` carries on with: its decisions are those of 1) is refused when saved, with
    from_dict's own message, and nothing is written."""
    state = sc.update(_megatron_like(tracker), False)  # the transition takes it
    if tracker < 1:
        state = sc.update(state, True)  # and keeps it, as Megatron backs off
    assert state.hysteresis_tracker == tracker
    with pytest.raises(sc.InvalidStateError) as at_load:
        sc.from_dict(_unchecked(state))
    with pytest.raises(sc.InvalidStateError) as at_save:
        sc.to_dict(state)
    assert str(at_save.value) == str(at_load.value)
    assert "hysteresis_tracker" in str(at_save.value)
    assert f"={tracker}, but it must be an int in [1, 2] (" in str(at_save.value)
    assert "max(1, its tracker)" in str(at_save.value)
    scaler = sc.LossScaler(state=state)
    with pytest.raises(sc.InvalidStateError, match="hysteresis_tracker"):
        scaler.state_dict()


@given(states())
def test_every_state_to_dict_writes_from_dict_reads(state: sc.ScalerState) -> None:
    assert sc.from_dict(sc.to_dict(state)) == state
    torch_format = sc.to_dict(state, format="torch")
    back = sc.from_dict(torch_format, state.config)
    assert (back.scale, back.growth_tracker) == (state.scale, state.growth_tracker)


@given(
    states(),
    st.sampled_from(
        [
            "scale",
            "growth_tracker",
            "hysteresis_tracker",
            "steps",
            "skipped_steps",
            "consecutive_skips",
            "norm_mean",
            "norm_var",
            "norm_count",
            "last_kind",
        ]
    ),
    st.one_of(
        st.integers(-3, 3),
        st.integers(),
        st.sampled_from([2**31, -(2**31) - 1, 0.5, -1.0, 1e-40, float("inf"), float("nan")]),
    ),
)
def test_a_state_to_dict_writes_is_one_from_dict_reads_or_it_is_refused_alike(
    state: sc.ScalerState, field: str, value: Any
) -> None:
    """Any field of a state built by hand (``ScalerState`` checks nothing, so it works
    under ``jax.jit``): ``to_dict`` writes it only if ``from_dict`` reads it back, and
    otherwise refuses it with from_dict's message, in either format."""
    bad = dataclasses.replace(state, **{field: value})
    saved = _outcome(lambda: sc.to_dict(bad))
    if saved[0] == "refused":
        assert _outcome(lambda: sc.from_dict(_unchecked(bad.to_host()))) == saved
    else:
        assert sc.from_dict(saved[1]) == bad.to_host()
    saved = _outcome(lambda: sc.to_dict(bad, format="torch"))
    if saved[0] == "refused":
        loaded = _outcome(lambda: sc.from_dict(_unchecked_torch(bad.to_host()), bad.config))
        assert loaded == saved
    else:
        sc.from_dict(saved[1], bad.config)


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", result)``, or ``("refused", message)`` for an ``InvalidStateError``."""
    try:
        return "ok", call()
    except sc.InvalidStateError as exc:
        return "refused", str(exc)


def _unchecked_torch(state: sc.ScalerState) -> dict[str, Any]:
    cfg = state.config
    return {
        "scale": state.scale,
        "growth_factor": cfg.growth_factor,
        "backoff_factor": cfg.backoff_factor,
        "growth_interval": cfg.growth_interval,
        "_growth_tracker": state.growth_tracker,
    }
