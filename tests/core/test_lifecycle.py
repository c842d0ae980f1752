"""The LossScaler facade enforces the order of one training step.

Its rules are one table (``scaler_core._lifecycle.TRANSITIONS``); the tests below check
the table is complete, that the facade follows it call by call (a hypothesis state
machine drives random call sequences against the table as the model), that every
refusal's message comes from it, and that a refused call changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import scaler_core as sc
from scaler_core._lifecycle import TRANSITIONS, Call


def grads_with(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(3, value, np.float32), "b": np.full(2, 2.0**16, np.float32)}


def test_a_clean_step_then_a_skipped_step() -> None:
    scaler = sc.LossScaler(sc.ScalerConfig(growth_interval=1))
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
    scaler = sc.LossScaler()
    scaler.find_non_finite(grads_with(1.0), group="encoder")  # micro-batch 1: clean
    scaler.find_non_finite(grads_with(np.nan), group="encoder")  # micro-batch 2: NaN
    scaler.unscale(grads_with(1.0), group="decoder")
    assert scaler.should_skip_step()
    assert scaler.update().skipped_steps == 1
    scaler.unscale(grads_with(1.0), group="encoder")
    scaler.unscale(grads_with(1.0), group="decoder")
    assert not scaler.should_skip_step()


def test_unscaling_a_group_twice_is_an_error_that_says_what_to_do() -> None:
    scaler = sc.LossScaler()
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
    scaler = sc.LossScaler()
    with pytest.raises(sc.LifecycleError, match="No inf checks were recorded prior to"):
        getattr(scaler, call)()
    assert scaler.state == sc.init()


def test_step_twice_and_checking_after_the_decision() -> None:
    scaler = sc.LossScaler()
    scaler.unscale(grads_with(1.0))
    scaler.step(lambda: None)
    with pytest.raises(sc.LifecycleError, match=r"step\(\) has already been called"):
        scaler.step(lambda: None)
    with pytest.raises(sc.LifecycleError, match="after the skip decision"):
        scaler.find_non_finite(grads_with(1.0), group="late")
    scaler.update()
    scaler.unscale(grads_with(1.0))  # a new step starts clean
    scaler.step(lambda: None)


def test_collapse_keeps_the_previous_state() -> None:
    scaler = sc.LossScaler(sc.ScalerConfig(init_scale=2.0**-126))
    before = scaler.state
    scaler.find_non_finite(grads_with(np.inf))
    with pytest.raises(sc.ScaleCollapseError):
        scaler.update()
    assert scaler.state is before
    assert scaler.current_scale() == 2.0**-126


def test_reduce_found_is_applied_once_per_step() -> None:
    seen: list[bool] = []

    def everyone_saw_nan(found: Any) -> np.bool_:
        seen.append(bool(found))
        return np.bool_(True)

    scaler = sc.LossScaler(reduce_found=everyone_saw_nan)
    scaler.unscale(grads_with(1.0))
    assert scaler.should_skip_step()  # another replica overflowed
    assert scaler.update().skipped_steps == 1
    assert seen == [False]
    with pytest.raises(sc.InvalidArgumentError, match="reduce_found"):
        sc.LossScaler(reduce_found=42)  # type: ignore[arg-type]


def test_state_dict_round_trip_and_mid_step_guard() -> None:
    scaler = sc.LossScaler(sc.ScalerConfig(growth_interval=5, min_scale=1.0))
    for v in (1.0, np.inf, 1.0):
        scaler.unscale(grads_with(v))
        scaler.update()
    saved = scaler.state_dict()
    resumed = sc.LossScaler()
    resumed.load_state_dict(saved)
    assert resumed.state == scaler.state
    scaler.unscale(grads_with(1.0))
    with pytest.raises(sc.LifecycleError, match="middle of a step"):
        scaler.state_dict()
    with pytest.raises(sc.LifecycleError, match="middle of a step"):
        scaler.load_state_dict(saved)


def test_resume_from_state_and_conflicting_config() -> None:
    state = sc.update(sc.init(), True)
    assert sc.LossScaler(state=state).current_scale() == 2.0**15
    with pytest.raises(sc.InvalidStateError, match=r"differs from state\.config"):
        sc.LossScaler(sc.ScalerConfig(growth_interval=3), state=state)
    with pytest.raises(sc.InvalidStateError, match="must be a ScalerState"):
        sc.LossScaler(state={"scale": 1.0})  # type: ignore[arg-type]
    assert "LossScaler(state=ScalerState(" in repr(sc.LossScaler())


def test_static_no_op_mode_still_skips() -> None:
    scaler = sc.LossScaler(sc.ScalerConfig.static())
    g = grads_with(3.0)
    scaler.unscale(g)
    assert g["w"].tolist() == [3.0] * 3  # scale 1: nothing multiplied
    scaler.find_non_finite({"x": np.array([np.nan], np.float32)})
    assert scaler.should_skip_step()
    assert scaler.update().scale == 1.0


# ------------------------------------------------------------- the phase table
def test_the_table_names_every_call_in_every_phase() -> None:
    assert set(TRANSITIONS) == set(sc.StepPhase)
    for phase, row in TRANSITIONS.items():
        assert set(row) == set(Call), phase
        for outcome in row.values():
            assert isinstance(outcome, (sc.StepPhase, str))
    # Once gradients are checked, update() ends the step from every phase.
    for phase in (sc.StepPhase.CHECKING, sc.StepPhase.DECIDED, sc.StepPhase.STEPPED):
        assert TRANSITIONS[phase][Call.UPDATE] is sc.StepPhase.READY


def _make_call(scaler: sc.LossScaler, call: Call, group: str) -> Callable[[], Any]:
    grads = grads_with(2.0**16)
    return {
        Call.SCALE_LOSS: lambda: scaler.scale_loss(np.float32(1.0)),
        Call.UNSCALE: lambda: scaler.unscale(grads, group=group),
        Call.UNSCALE_AGAIN: lambda: scaler.unscale(grads, group=group),
        Call.FIND_NON_FINITE: lambda: scaler.find_non_finite(grads, group=group),
        Call.SHOULD_SKIP_STEP: scaler.should_skip_step,
        Call.STEP: lambda: scaler.step(lambda: None),
        Call.UPDATE: scaler.update,
        Call.STATE_DICT: scaler.state_dict,
        Call.LOAD_STATE_DICT: lambda: scaler.load_state_dict(sc.to_dict(scaler.state)),
        Call.ABANDON_STEP: scaler.abandon_step,
    }[call]


class FacadeFollowsTheTable(RuleBasedStateMachine):
    """Random call sequences: each call does what the table says, or changes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.scaler = sc.LossScaler()
        self.phase = sc.StepPhase.READY
        self.unscaled: set[str] = set()

    @rule(
        call=st.sampled_from([c for c in Call if c is not Call.UNSCALE_AGAIN]),
        group=st.sampled_from(["a", "b"]),
    )
    def do(self, call: Call, group: str) -> None:
        if call is Call.UNSCALE and group in self.unscaled:
            call = Call.UNSCALE_AGAIN
        outcome = TRANSITIONS[self.phase][call]
        state, flags = self.scaler.state, dict(self.scaler._flags)
        if isinstance(outcome, str):
            message = outcome.format(call=call.value, group=group)
            with pytest.raises(sc.LifecycleError) as info:
                _make_call(self.scaler, call, group)()
            assert str(info.value) == message
            assert self.scaler.state is state, "a refused call changed the state"
            assert self.scaler._flags == flags, "a refused call recorded a flag"
            return
        _make_call(self.scaler, call, group)()
        self.phase = outcome
        if call is Call.UNSCALE:
            self.unscaled.add(group)
        if call in (Call.UPDATE, Call.ABANDON_STEP):
            self.unscaled.clear()

    @invariant()
    def phase_matches(self) -> None:
        assert self.scaler.phase is self.phase


test_the_facade_follows_the_table = FacadeFollowsTheTable.TestCase


def test_unscale_after_the_decision_unscales_nothing() -> None:
    """A refusal comes before any work: the late group is not unscaled (nor marked)."""
    scaler = sc.LossScaler()
    scaler.unscale(grads_with(1.0), group="a")
    assert not scaler.should_skip_step()
    late = grads_with(2.0**16)
    with pytest.raises(sc.LifecycleError, match="after the skip decision"):
        scaler.unscale(late, group="b")
    assert late["b"].tolist() == [2.0**16] * 2, "the refused unscale modified the gradients"
    assert scaler.phase is sc.StepPhase.DECIDED
    scaler.update()
    scaler.unscale(late, group="b")  # not marked as unscaled by the refused call
    assert late["b"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    ("config", "error"),
    [
        (sc.ScalerConfig(init_scale=2.0**-126), sc.ScaleCollapseError),
        (sc.ScalerConfig(max_consecutive_skips=1), sc.SkipLimitError),
        (sc.ScalerConfig(min_scale=2.0**16, at_min_scale="raise"), sc.ScaleCollapseError),
    ],
    ids=["collapse", "skip-limit", "floor-raise"],
)
def test_a_refused_update_leaves_a_way_out(config: sc.ScalerConfig, error: type) -> None:
    """After a fail-closed refusal the step can be abandoned: the state is as before the
    step, and the scaler takes a checkpoint or a new step again."""
    scaler = sc.LossScaler(config)
    saved = scaler.state_dict()
    refusal = None
    for _ in range(3):  # the skip limit needs a second overflow
        scaler.unscale(grads_with(np.inf))
        try:
            scaler.update()
        except error as exc:
            refusal = exc
            break
    assert refusal is not None
    before = scaler.state
    with pytest.raises(error):
        scaler.update()  # the same step's flags: refused again
    with pytest.raises(sc.LifecycleError, match=r"abandon_step\(\)"):
        scaler.load_state_dict(saved)
    with pytest.raises(sc.LifecycleError, match=r"abandon_step\(\)"):
        scaler.unscale(grads_with(1.0))
    scaler.abandon_step()
    assert scaler.phase is sc.StepPhase.READY
    assert scaler.state is before, "abandoning a step changes no state"
    assert scaler.found_non_finite is None
    scaler.load_state_dict(saved)  # resume from a checkpoint ...
    assert scaler.state == sc.from_dict(saved)
    scaler.unscale({"w": np.full(3, scaler.current_scale(), np.float32)})  # ... and train on
    assert not scaler.should_skip_step()
    assert scaler.update().steps == 1


def test_messages_name_the_loss_and_the_flag_not_the_gradients() -> None:
    with pytest.raises(sc.GradientTypeError, match=r"^loss is a builtins\.float") as info:
        sc.LossScaler().scale_loss(1.0)
    assert "grads" not in str(info.value)
    for bad in ([True], (np.bool_(True),), {"found": True}):
        with pytest.raises(sc.GradientTypeError, match=r"^found_non_finite=") as err:
            sc.update(sc.init(), bad)
        assert "grads" not in str(err.value)
