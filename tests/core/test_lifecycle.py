"""The GradScaler facade enforces the order of one training step (SPEC section 6)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import scaler_core as sc


def grads_with(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, value, np.float32), "b": np.full(2, 2.0**16, np.float32)}


def test_a_clean_step_then_a_skipped_step() -> None:
    scaler = sc.GradScaler(sc.ScalerConfig(growth_interval=1))
    loss = scaler.scale_loss(np.float32(0.25))
    assert loss == 2.0**14
    g = scaler.unscale(grads_with(2.0**17))
    assert g["w"].tolist() == [2.0] * 3
    calls: list[int] = []
    assert scaler.step(calls.append, 1) is None
    assert calls == [1]
    assert scaler.update().scale == 2.0**17
    scaler.unscale(grads_with(np.inf))
    assert scaler.should_skip_step()
    scaler.step(calls.append, 2)
    assert calls == [1], "a skipped step must not call the optimizer"
    state = scaler.update()
    assert (state.scale, state.steps, state.skipped_steps) == (2.0**16, 2, 1)


def test_groups_and_micro_batches_are_ored() -> None:
    scaler = sc.GradScaler()
    scaler.detect(grads_with(1.0), group="encoder")  # micro-batch 1: clean
    scaler.detect(grads_with(np.nan), group="encoder")  # micro-batch 2: NaN
    scaler.unscale(grads_with(1.0), group="decoder")
    assert scaler.should_skip_step()
    assert scaler.update().skipped_steps == 1
    scaler.unscale(grads_with(1.0), group="encoder")
    scaler.unscale(grads_with(1.0), group="decoder")
    assert not scaler.should_skip_step()


def test_unscaling_a_group_twice_is_an_error_that_says_what_to_do() -> None:
    scaler = sc.GradScaler()
    g = grads_with(4.0)
    scaler.unscale(g, group="opt")
    with pytest.raises(
        sc.LifecycleError, match=r"already been called on group 'opt'.*once per step"
    ):
        scaler.unscale(g, group="opt")
    assert g["w"].tolist() == [4.0 / 2**16] * 3, "the refused call unscaled again"
    assert isinstance(sc.LifecycleError("x"), RuntimeError)


@pytest.mark.parametrize("call", ["update", "should_skip_step"])
def test_deciding_with_no_check_recorded(call: str) -> None:
    scaler = sc.GradScaler()
    with pytest.raises(sc.LifecycleError, match="No inf checks were recorded prior to"):
        getattr(scaler, call)()
    assert scaler.state == sc.init()


def test_step_twice_and_checking_after_the_decision() -> None:
    scaler = sc.GradScaler()
    scaler.unscale(grads_with(1.0))
    scaler.step(lambda: None)
    with pytest.raises(sc.LifecycleError, match=r"step\(\) has already been called"):
        scaler.step(lambda: None)
    with pytest.raises(sc.LifecycleError, match="after the skip decision"):
        scaler.detect(grads_with(1.0), group="late")
    scaler.update()
    scaler.unscale(grads_with(1.0))  # a new step starts clean
    scaler.step(lambda: None)


def test_collapse_keeps_the_previous_state() -> None:
    scaler = sc.GradScaler(sc.ScalerConfig(init_scale=2.0**-126))
    before = scaler.state
    scaler.detect(grads_with(np.inf))
    with pytest.raises(sc.ScaleCollapseError):
        scaler.update()
    assert scaler.state is before
    assert scaler.scale == 2.0**-126


def test_reduce_found_is_applied_once_per_step() -> None:
    seen: list[bool] = []

    def everyone_saw_nan(found: Any) -> np.bool_:
        seen.append(bool(found))
        return np.bool_(True)

    scaler = sc.GradScaler(reduce_found=everyone_saw_nan)
    scaler.unscale(grads_with(1.0))
    assert scaler.should_skip_step()  # another replica overflowed
    assert scaler.update().skipped_steps == 1
    assert seen == [False]
    with pytest.raises(sc.InvalidArgumentError, match="reduce_found"):
        sc.GradScaler(reduce_found=42)  # type: ignore[arg-type]


def test_state_dict_round_trip_and_mid_step_guard() -> None:
    scaler = sc.GradScaler(sc.ScalerConfig(growth_interval=5, min_scale=1.0))
    for v in (1.0, np.inf, 1.0):
        scaler.unscale(grads_with(v))
        scaler.update()
    saved = scaler.state_dict()
    resumed = sc.GradScaler()
    resumed.load_state_dict(saved)
    assert resumed.state == scaler.state
    scaler.unscale(grads_with(1.0))
    with pytest.raises(sc.LifecycleError, match="middle of a step"):
        scaler.state_dict()
    with pytest.raises(sc.LifecycleError, match="middle of a step"):
        scaler.load_state_dict(saved)


def test_resume_from_state_and_conflicting_config() -> None:
    state = sc.update(sc.init(), True)
    assert sc.GradScaler(state=state).scale == 2.0**15
    with pytest.raises(sc.InvalidStateError, match=r"differs from state\.config"):
        sc.GradScaler(sc.ScalerConfig(growth_interval=3), state=state)
    with pytest.raises(sc.InvalidStateError, match="must be a ScalerState"):
        sc.GradScaler(state={"scale": 1.0})  # type: ignore[arg-type]
    assert "GradScaler(state=ScalerState(" in repr(sc.GradScaler())


def test_static_no_op_mode_still_skips() -> None:
    scaler = sc.GradScaler(sc.ScalerConfig.static())
    g = grads_with(3.0)
    scaler.unscale(g)
    assert g["w"].tolist() == [3.0] * 3  # scale 1: nothing multiplied
    scaler.detect({"x": np.array([np.nan], np.float32)})
    assert scaler.should_skip_step()
    assert scaler.update().scale == 1.0
