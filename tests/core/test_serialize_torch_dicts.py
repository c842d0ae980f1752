"""The core reads every dict a PyTorch scaler writes: PyTorch's own and the drop-in's.

``torch.amp.GradScaler.state_dict()`` (five entries) and
``scaler_core.torch.GradScaler.state_dict()`` (those five and the ``"scaler_core"``
payload) are made here by the real classes, then loaded by the core's
``from_dict`` and the facade's ``load_state_dict``; the drop-in loads the facade's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core._serialize import TORCH_STATE_KEY

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch", reason="PyTorch writes the state dicts read here")


def _theirs(**kwargs: Any) -> dict[str, Any]:
    """What ``torch.amp.GradScaler`` saves (on the CPU, where it is enabled)."""
    return torch.amp.GradScaler("cpu", **kwargs).state_dict()  # type: ignore[no-any-return]


def _dropin(config: sc.ScalerConfig, flags: list[bool]) -> Any:
    """A drop-in ``scaler_core.torch.GradScaler`` after one update per flag."""
    from scaler_core.torch import GradScaler

    scaler = GradScaler("cpu", config=config)
    for found in flags:
        param = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([param], lr=0.1)
        scaler.scale(torch.ones(()))
        param.grad = torch.full((2,), float("inf") if found else 1.0)
        scaler.step(opt)
        scaler.update()
    return scaler


def _overflow(scaler: sc.LossScaler) -> None:
    scaler.unscale({"w": np.array([np.inf], np.float32)})
    scaler.update()


# ------------------------------------------- PyTorch's dict keeps the facade's policy
def test_the_facade_loading_pytorchs_dict_keeps_its_own_policy() -> None:
    """PyTorch's dict carries four numbers and a tracker; every other knob (Megatron's
    floor of 1 and hysteresis of 2) stays the facade's, as the drop-in keeps its own."""
    config = sc.preset("megatron")
    scaler = sc.LossScaler(config)
    scaler.load_state_dict(_theirs(init_scale=4.0, growth_interval=7))
    assert scaler.config == sc.ScalerConfig(
        init_scale=4.0,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=7,
        hysteresis=2,
    )
    assert (scaler.state.scale, scaler.state.hysteresis_tracker) == (4.0, 2)
    for _ in range(8):
        _overflow(scaler)
    assert scaler.current_scale() == 1.0, "the floor of the megatron preset was lost"


def test_the_facade_and_the_dropin_load_pytorchs_dict_alike() -> None:
    from scaler_core.torch import GradScaler

    config = sc.preset("megatron")
    saved = _theirs(init_scale=2.0**10, growth_interval=3)
    facade, dropin = sc.LossScaler(config), GradScaler("cpu", config=config)
    facade.load_state_dict(saved)
    dropin.load_state_dict(saved)
    assert facade.state == dropin.state
    assert facade.state == sc.from_dict(saved, config)


def test_a_pytorch_dict_the_facades_bounds_refuse_changes_nothing() -> None:
    scaler = sc.LossScaler(sc.preset("megatron"))
    before = scaler.state
    with pytest.raises(sc.InvalidStateError, match=r"state_dict\['scale'\]=0\.5"):
        scaler.load_state_dict(_theirs(init_scale=0.5))
    assert scaler.state is before


# --------------------------------------------- the drop-in's dict, read by the core
def _dropin_dict() -> tuple[Any, dict[str, Any]]:
    config = sc.ScalerConfig(growth_interval=3, hysteresis=2, min_scale=1.0)
    scaler = _dropin(config, [False, True, False, False, True, True])
    return scaler, scaler.state_dict()


def test_from_dict_reads_the_dropins_state_dict() -> None:
    scaler, saved = _dropin_dict()
    assert TORCH_STATE_KEY in saved
    assert sc.from_dict(saved) == scaler.state


def test_the_facade_loads_the_dropins_state_dict() -> None:
    scaler, saved = _dropin_dict()
    facade = sc.LossScaler()
    facade.load_state_dict(saved)
    assert facade.state == scaler.state
    assert facade.config == scaler.config


def test_pytorchs_entries_win_over_the_payload_as_the_dropin_loads_them() -> None:
    """An edited entry takes effect in the core as in the drop-in (``with_torch_entries``)."""
    from scaler_core.torch import GradScaler

    _, saved = _dropin_dict()
    edited = {**saved, "scale": 2.0**20, "growth_interval": 11}
    dropin = GradScaler("cpu")
    dropin.load_state_dict(edited)
    core = sc.from_dict(edited)
    assert core == dropin.state
    assert (core.scale, core.config.growth_interval, core.config.hysteresis) == (2.0**20, 11, 2)


def test_a_dropin_dict_carries_its_own_config() -> None:
    _, saved = _dropin_dict()
    with pytest.raises(sc.InvalidStateError, match=r"config=.*carries its own config"):
        sc.from_dict(saved, sc.ScalerConfig())


def test_a_bad_payload_in_a_dropin_dict_is_named_by_its_key() -> None:
    _, saved = _dropin_dict()
    bad = {**saved, TORCH_STATE_KEY: {**saved[TORCH_STATE_KEY], "version": 99}}
    with pytest.raises(sc.InvalidStateError, match=r"state_dict\['scaler_core'\]\['version'\]"):
        sc.from_dict(bad)
    scaler = sc.LossScaler()
    before = scaler.state
    with pytest.raises(sc.InvalidStateError, match="version"):
        scaler.load_state_dict(bad)
    assert scaler.state is before


# --------------------------------------------- the facade's dict, read by the drop-in
def test_the_dropin_loads_the_facades_state_dict() -> None:
    from scaler_core.torch import GradScaler

    facade = sc.LossScaler(sc.ScalerConfig(growth_interval=3, hysteresis=2, min_scale=1.0))
    for value in (1.0, np.inf, 1.0):
        facade.unscale({"w": np.array([value], np.float32)})
        facade.update()
    dropin = GradScaler("cpu")
    dropin.load_state_dict(facade.state_dict())
    assert dropin.state == facade.state
