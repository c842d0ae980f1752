"""Random call sequences on ``scaler_core.torch.GradScaler`` and ``torch.amp.GradScaler``.

A hypothesis state machine drives both scalers, each with its own copy of one
model and optimizer, through the same calls in the same order: scale and
backward (with inf or NaN injected at random), ``unscale_``, ``step``, ``update``
(with and without a new scale), ``state_dict``, ``load_state_dict`` and a pickle
round trip, legal or not. Every call must give the same result on both, or an
error of the same class with the same message; after every call the parameters
and the scale must be equal, to the bit.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is the oracle for these tests")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

from scaler_core.torch import GradScaler  # noqa: E402

pytestmark = pytest.mark.torch
INJECT = st.sampled_from([None, None, None, float("inf"), float("-inf"), float("nan")])


def _outcome(fn: Any) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:  # the class and message are what is compared
        return type(exc).__name__, str(exc)


def _plain(saved: Any) -> Any:
    """A state dict without scaler-core's extra key (PyTorch's five entries)."""
    if isinstance(saved, dict):
        return {k: v for k, v in saved.items() if k != "scaler_core"}
    return saved


class SideBySide(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sides = []
        for cls in (torch.amp.GradScaler, GradScaler):
            torch.manual_seed(0)
            model = torch.nn.Linear(3, 2)
            opt = torch.optim.Adam(model.parameters(), lr=0.1)
            self.sides.append(
                {
                    "scaler": cls("cpu", init_scale=2.0**4, growth_interval=3),
                    "model": model,
                    "opt": opt,
                }
            )
        self.saved: list[dict[str, Any]] = []

    def _both(self, call: Any) -> tuple[str, Any]:
        theirs, ours = (_outcome(lambda side=side: call(side)) for side in self.sides)
        assert ours[0] == theirs[0], (theirs, ours)
        assert _plain(ours[1]) == _plain(theirs[1]), (theirs, ours)
        return theirs

    @rule(inject=INJECT, x=st.floats(-4, 4, width=32))
    def scale_and_backward(self, inject: float | None, x: float) -> None:
        def call(side: dict[str, Any]) -> None:
            loss = side["model"](torch.full((2, 3), x)).pow(2).sum()
            side["scaler"].scale(loss).backward()
            if inject is not None:
                side["model"].bias.grad[0] = inject

        self._both(call)

    @rule()
    def zero_grad(self) -> None:
        self._both(lambda side: side["opt"].zero_grad())

    @rule()
    def unscale_(self) -> None:
        self._both(lambda side: side["scaler"].unscale_(side["opt"]))

    @rule()
    def step(self) -> None:
        self._both(lambda side: side["scaler"].step(side["opt"]))

    @rule()
    def update(self) -> None:
        self._both(lambda side: side["scaler"].update())

    @rule(new=st.sampled_from([2.0**-4, 1.0, 3.0, 2.0**20]))
    def update_to(self, new: float) -> None:
        self._both(lambda side: side["scaler"].update(new))

    @rule()
    def state_dict(self) -> None:
        kind, saved = self._both(lambda side: side["scaler"].state_dict())
        if kind == "ok":
            self.saved.append(saved)

    @rule(data=st.data())
    def load_state_dict(self, data: st.DataObject) -> None:
        if self.saved:
            saved = data.draw(st.sampled_from(self.saved))
            self._both(lambda side: side["scaler"].load_state_dict(dict(saved)))

    @rule()
    def pickle_round_trip(self) -> None:
        def call(side: dict[str, Any]) -> None:
            side["scaler"] = pickle.loads(pickle.dumps(side["scaler"]))

        self._both(call)

    @invariant()
    def same_parameters_and_scale(self) -> None:
        theirs, ours = self.sides
        for a, b in zip(theirs["model"].parameters(), ours["model"].parameters(), strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert _outcome(theirs["scaler"].get_scale) == _outcome(ours["scaler"].get_scale)


SideBySide.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_ours_and_pytorchs_agree_on_every_call_sequence = SideBySide.TestCase
