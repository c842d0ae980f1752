"""scaler_core.testing used on itself: built-in policies pass, planted bugs are caught."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings

import scaler_core as sc
from scaler_core import PolicyViolationError
from scaler_core.testing import (
    check_invariants,
    check_policy,
    check_step,
    configs,
    gradient_trees,
    states,
)


def test_the_builtin_policy_passes_on_random_configs() -> None:
    check_policy(sc.update, max_examples=60)


@pytest.mark.parametrize("name", sorted(sc.PRESETS))
def test_every_preset_passes(name: str) -> None:
    config = sc.preset(name, **_fast(name))
    check_policy(sc.update, config=config, max_examples=25)


def _fast(name: str) -> dict[str, Any]:
    """Small intervals so the suite reaches growth in a short sequence."""
    key = {
        "torch": "growth_interval",
        "megatron": "growth_interval",
        "deepspeed": "scale_window",
        "jmp": "period",
        "flax": "growth_interval",
        "keras": "dynamic_growth_steps",
        "paddle": "incr_every_n_steps",
        "paddle_static": "incr_every_n_steps",
        "apex": "scale_window",
    }[name]
    return {key: 3}


def grows_to_infinity(state: sc.ScalerState, found: Any) -> sc.ScalerState:
    """Planted bug: doubles on every clean step with no bound at all."""
    new = sc.update(state, found)
    return new if found else dataclasses.replace(new, scale=state.scale * 2.0)


def test_a_policy_that_grows_to_infinity_is_caught_with_a_minimal_example() -> None:
    with pytest.raises(PolicyViolationError) as info:
        check_policy(grows_to_infinity, max_examples=200)
    message = str(info.value)
    assert message.startswith("policy grows_to_infinity broke bounds:")
    assert "flags=[" in message
    assert "config=ScalerConfig(" in message
    assert "reproduce: state = init(config)" in message
    # Shrinking leaves a short all-clean sequence that reaches the overflow.
    flags = eval(message.split("flags=")[1].split("\n", maxsplit=1)[0])
    assert flags
    assert not any(flags)
    assert len(flags) <= 3


def forgets_skips(state: sc.ScalerState, found: Any) -> sc.ScalerState:
    new = sc.update(state, found)
    return dataclasses.replace(new, skipped_steps=state.skipped_steps)


def test_a_policy_that_loses_skip_accounting_is_caught() -> None:
    with pytest.raises(PolicyViolationError, match=r"skip accounting.*non-finite step"):
        check_policy(forgets_skips, max_examples=50)


def test_a_policy_that_is_not_deterministic_is_caught() -> None:
    calls = [0]

    def flaky(state: sc.ScalerState, found: Any) -> sc.ScalerState:
        calls[0] += 1
        new = sc.update(state, found)
        return dataclasses.replace(new, growth_tracker=0) if calls[0] % 2 else new

    with pytest.raises(PolicyViolationError, match="determinism"):
        check_policy(flaky, config=sc.ScalerConfig(growth_interval=5), max_examples=20)


def test_a_policy_that_fails_open_is_caught() -> None:
    def crashes(state: sc.ScalerState, found: Any) -> sc.ScalerState:
        if found:
            raise ValueError("no idea what to do")
        return sc.update(state, found)

    with pytest.raises(PolicyViolationError, match=r"fail-closed: the policy raised ValueError"):
        check_policy(crashes, config=sc.ScalerConfig(), max_examples=30)


def plain_rule(state: sc.ScalerState, found: Any) -> sc.ScalerState:
    """A two-argument policy: the built-in rule, which it calls without a norm."""
    return sc.update(state, found)


def test_a_two_argument_policy_is_checked_under_spike_skipping() -> None:
    # Spikes are the core's decision; the policy sees the rest, with spike skipping off.
    check_policy(plain_rule, config=configs(spikes=True), max_examples=40)
    with pytest.raises(PolicyViolationError, match=r"^policy grows_to_infinity broke bounds") as e:
        check_policy(grows_to_infinity, config=configs(spikes=True), max_examples=200)
    assert "state = check_step(grows_to_infinity, state, f, g)" in str(e.value)


def test_a_policy_that_cannot_take_its_arguments_is_refused_before_any_step() -> None:
    with pytest.raises(sc.InvalidArgumentError, match=r"policy \S*<lambda> takes \(state\), but"):
        check_policy(lambda state: state, max_examples=5)


def test_refusing_a_step_is_allowed() -> None:
    config = sc.ScalerConfig(init_scale=1.0, min_scale=1.0, at_min_scale="raise")
    assert check_step(sc.update, sc.init(config), True) is None


@given(states())
def test_states_satisfy_the_invariants_and_load_back(state: sc.ScalerState) -> None:
    check_invariants(state)
    assert sc.from_dict(sc.to_dict(state)) == state


@given(gradient_trees(non_finite=False))
def test_finite_gradient_trees_hold_only_finite_float_arrays(tree: Any) -> None:
    leaves = _leaves(tree)
    assert leaves
    assert all(isinstance(a, np.ndarray) for a in leaves)
    assert {a.dtype.name for a in leaves} <= {"float16", "bfloat16", "float32", "float64"}
    assert not bool(sc.find_non_finite(tree))


@given(gradient_trees(dtypes=["float32"]))
def test_gradient_trees_agree_with_find_non_finite(tree: Any) -> None:
    expected = any(not np.isfinite(a).all() for a in _leaves(tree))
    assert bool(sc.find_non_finite(tree)) == expected


def test_jax_gradient_trees_are_jax_arrays() -> None:
    jax = pytest.importorskip("jax", reason="JAX is optional")

    @given(gradient_trees("jax", dtypes=["bfloat16", "float16"]))
    @settings(max_examples=10)
    def check(tree: Any) -> None:
        leaves = jax.tree_util.tree_leaves(tree)
        assert leaves
        assert all(isinstance(a, jax.Array) for a in leaves)
        assert {a.dtype.name for a in leaves} <= {"bfloat16", "float16"}

    check()


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(sc.BackendUnavailableError, match="backend='torch'"):
        gradient_trees("torch")


def test_the_kit_imports_no_array_library_until_drawn() -> None:
    pytest.importorskip("jax", reason="a JAX strategy can be built only where JAX is installed")
    code = (
        "import sys, scaler_core.testing as t; t.gradient_trees('jax'); "
        "bad = {'jax', 'cupy', 'torch'} & set(sys.modules); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in _leaves(v)]
    if isinstance(tree, list):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [tree]


@given(configs())
def test_configs_cover_the_new_knobs(config: sc.ScalerConfig) -> None:
    assert config.at_max_scale in ("block", "clamp")
