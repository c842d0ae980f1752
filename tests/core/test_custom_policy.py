"""A user's own transition plugs into LossScaler like the built-in one."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

import scaler_core as sc


def halve_twice(state: sc.ScalerState, found: Any) -> sc.ScalerState:
    """Back off by 4x on overflow, otherwise the built-in rule."""
    if bool(found):
        new = sc.update(state, found)
        return dataclasses.replace(new, scale=max(new.scale * 0.5, 1.0))
    return sc.update(state, found)


def test_grad_scaler_uses_the_given_policy() -> None:
    scaler = sc.LossScaler(policy=halve_twice)
    scaler.unscale([np.array([np.inf], np.float32)])
    scaler.update()
    assert scaler.current_scale() == 2.0**16 / 4
    scaler.unscale([np.array([1.0], np.float32)])
    scaler.update()
    assert scaler.current_scale() == 2.0**14
    assert scaler.state.steps == 2


def test_a_policy_that_returns_something_else_is_refused_by_name() -> None:
    scaler = sc.LossScaler(policy=lambda state, found: 1.0)  # type: ignore[arg-type,return-value]
    scaler.unscale([np.array([1.0], np.float32)])
    before = scaler.state
    with pytest.raises(sc.InvalidStateError, match="must return a ScalerState"):
        scaler.update()
    assert scaler.state is before


def test_a_non_callable_policy_is_refused() -> None:
    with pytest.raises(sc.InvalidArgumentError, match="policy=3"):
        sc.LossScaler(policy=3)  # type: ignore[arg-type]


_SPIKY = sc.ScalerConfig(spike_threshold=3.0, spike_window=4)
#: Calm norms, then a spike, then an overflow: one step of each kind the window meets.
_NORMS = (1.0, 1.25, 0.75, 1.0, 50.0, np.inf, 1.0)


def _step(scaler: sc.LossScaler, norm: float) -> sc.ScalerState:
    """One step whose unscaled gradient has norm ``norm``."""
    scaler.unscale_and_norm([np.array([norm * scaler.current_scale()], np.float32)])
    return scaler.update()


def test_a_two_argument_policy_runs_under_spike_skipping_with_the_core_deciding_spikes() -> None:
    seen: list[sc.ScalerConfig] = []

    def watched(state: sc.ScalerState, found: Any) -> sc.ScalerState:
        seen.append(state.config)
        return halve_twice(state, found)  # calls sc.update(state, found): no norm to give

    mine, builtin = sc.LossScaler(_SPIKY, policy=watched), sc.LossScaler(_SPIKY)
    for norm in _NORMS:
        new, ref = _step(mine, norm), _step(builtin, norm)
        if np.isfinite(norm):  # the spike included: the core's own step
            assert new == ref
        else:  # the overflow is the policy's: twice the backoff, the core's window
            assert new == dataclasses.replace(ref, scale=ref.scale / 2)
            mine = sc.LossScaler(state=ref, policy=watched)
    assert (builtin.state.skipped_steps, builtin.state.norm_count) == (2, 4)
    # Called on every step but the spike, with a config it can hand to update().
    assert len(seen) == len(_NORMS) - 1
    assert all(c == dataclasses.replace(_SPIKY, spike_threshold=None) for c in seen)


def test_a_three_argument_policy_gets_the_norm_of_the_step() -> None:
    norms: list[float] = []

    def capped(state: sc.ScalerState, found: Any, grad_norm: Any) -> sc.ScalerState:
        norms.append(float(grad_norm))
        new = sc.update(state, found, grad_norm=grad_norm)
        return dataclasses.replace(new, scale=min(new.scale, 2.0**15))

    mine, builtin = sc.LossScaler(_SPIKY, policy=capped), sc.LossScaler(_SPIKY)
    for norm in _NORMS:
        new, ref = _step(mine, norm), _step(builtin, norm)
        assert new == dataclasses.replace(ref, scale=min(ref.scale, 2.0**15))
        mine = sc.LossScaler(state=ref, policy=capped)
    assert norms == list(_NORMS)


@pytest.mark.parametrize(
    ("policy", "config", "says"),
    [
        (
            lambda state: state,
            sc.ScalerConfig(),
            "takes (state), but its config has spike "
            "skipping off, so it is called as policy(state, found): take (state, found)",
        ),
        (
            lambda state: state,
            _SPIKY,
            "takes (state), but its config has spike skipping on, "
            "so it is called as policy(state, found, grad_norm)",
        ),
        (lambda state, found, grad_norm: state, sc.ScalerConfig(), "give grad_norm a default"),
    ],
)
def test_a_policy_that_cannot_take_its_arguments_is_refused_at_construction(
    policy: Any, config: sc.ScalerConfig, says: str
) -> None:
    with pytest.raises(sc.InvalidArgumentError) as err:
        sc.LossScaler(config, policy=policy)
    message = str(err.value)
    assert re.search(r"^policy \S*<lambda> takes", message)
    assert says in message


def test_a_checkpoint_that_turns_spike_skipping_off_is_refused_for_a_norm_policy() -> None:
    def needs_norm(state: sc.ScalerState, found: Any, grad_norm: Any) -> sc.ScalerState:
        return sc.update(state, found, grad_norm=grad_norm)

    scaler = sc.LossScaler(_SPIKY, policy=needs_norm)
    before = scaler.state
    with pytest.raises(sc.InvalidArgumentError, match="give grad_norm a default"):
        scaler.load_state_dict(sc.to_dict(sc.init(sc.ScalerConfig())))
    assert scaler.state is before
    _step(scaler, 1.0)  # still called with the norm
