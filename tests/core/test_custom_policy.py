"""A user's own transition plugs into GradScaler like the built-in one."""

from __future__ import annotations

import dataclasses
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
    scaler = sc.GradScaler(policy=halve_twice)
    scaler.unscale([np.array([np.inf], np.float32)])
    scaler.update()
    assert scaler.scale == 2.0**16 / 4
    scaler.unscale([np.array([1.0], np.float32)])
    scaler.update()
    assert scaler.scale == 2.0**14
    assert scaler.state.steps == 2


def test_a_policy_that_returns_something_else_is_refused_by_name() -> None:
    scaler = sc.GradScaler(policy=lambda state, found: 1.0)  # type: ignore[arg-type,return-value]
    scaler.unscale([np.array([1.0], np.float32)])
    before = scaler.state
    with pytest.raises(sc.InvalidStateError, match="must return a ScalerState"):
        scaler.update()
    assert scaler.state is before


def test_a_non_callable_policy_is_refused() -> None:
    with pytest.raises(sc.InvalidArgumentError, match="policy=3"):
        sc.GradScaler(policy=3)  # type: ignore[arg-type]
