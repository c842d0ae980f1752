"""The step's arguments (flag, norm, state) are coerced once, the same way on every path.

``update``, ``classify``, ``device_update``, each backend's ``update`` and ``simulate``
take a ``grad_norm``; each refuses the same bad norms with the same error, before
anything is computed: not a real number or a 0-d float array, negative, or an array
of another library than the flag's and the state's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core._state import device_update
from scaler_core.simulate import Trace, simulate

SPIKY = sc.ScalerConfig(spike_threshold=3.0, spike_window=4)


def _warm(state: sc.ScalerState | None = None) -> sc.ScalerState:
    state = sc.init(SPIKY) if state is None else state
    for norm in (1.0, 1.25, 0.75, 1.0, 1.125):
        state = sc.update(state, False, grad_norm=norm)
    return state


def _torch() -> Any:
    return pytest.importorskip("torch")


def _jnp() -> Any:
    pytest.importorskip("jax")
    import jax.numpy as jnp

    return jnp


# ------------------------------------------------------------------ mixed libraries
def _jax_state() -> sc.ScalerState:
    jnp = _jnp()
    return sc.update(_warm(), jnp.asarray(False), grad_norm=jnp.float32(1.0))


def _torch_state() -> sc.ScalerState:
    torch = _torch()
    return sc.update(_warm(), torch.tensor(False), grad_norm=torch.tensor(1.0))


# (name, state, flag, norm, the words the message must hold): each pairs two libraries.
MIXES: dict[str, Callable[[], tuple[sc.ScalerState, Any, Any]]] = {
    "jax state, torch norm": lambda: (_jax_state(), False, _torch().tensor(1.0)),
    "jax state and flag, torch norm": lambda: (
        _jax_state(),
        _jnp().asarray(False),
        _torch().tensor(1.0),
    ),
    "torch flag, jax norm": lambda: (_warm(), _torch().tensor(False), _jnp().float32(1.0)),
    "jax flag, torch norm": lambda: (_warm(), _jnp().asarray(False), _torch().tensor(1.0)),
    "torch state, jax flag": lambda: (_torch_state(), _jnp().asarray(False), 1.0),
    "jax state, torch flag": lambda: (_jax_state(), _torch().tensor(False), 1.0),
    "torch state, jax norm": lambda: (_torch_state(), False, _jnp().float32(1.0)),
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mixed_libraries_are_refused_naming_both_arguments(mix: str) -> None:
    state, flag, norm = MIXES[mix]()
    before = copy.deepcopy(state)
    with pytest.raises(sc.GradientTypeError) as err:
        sc.update(state, flag, grad_norm=norm)
    message = str(err.value)
    assert "jax" in message
    assert "torch" in message
    assert sum(w in message for w in ("found_non_finite", "grad_norm", "state")) == 2, message
    assert "one library" in message, message
    assert state == before


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_backend_refuses_a_norm_of_another_library(backend: str) -> None:
    torch, jnp = _torch(), _jnp()
    other = jnp.float32(1.0) if backend == "torch" else torch.tensor(1.0)
    flag = torch.tensor(False) if backend == "torch" else jnp.asarray(False)
    with pytest.raises(sc.GradientTypeError, match=r"grad_norm.*one library"):
        sc.get_backend(backend).update(_warm(), flag, other)


def test_device_update_refuses_a_norm_of_another_library_than_its_namespace() -> None:
    torch = _torch()
    with pytest.raises(sc.GradientTypeError, match=r"grad_norm.*torch.*one library"):
        device_update(np, _warm(), np.bool_(False), torch.tensor(1.0))


def test_host_values_go_with_any_library() -> None:
    torch, jnp = _torch(), _jnp()
    for flag, norm in [
        (np.bool_(False), torch.tensor(1.0)),
        (False, jnp.float32(1.0)),
        (torch.tensor(False), np.float32(1.0)),
        (jnp.asarray(False), 1.0),
    ]:
        out = sc.update(_warm(), flag, grad_norm=norm)
        assert out.to_host() == sc.update(_warm(), False, grad_norm=1.0)


# ------------------------------------------------------------------- negative norms
NEGATIVE = [-1.0, -math.inf, np.float32(-2.5), np.float64(-1e-30), np.array(-3.0), -1]


@pytest.mark.parametrize("bad", NEGATIVE, ids=repr)
def test_a_negative_norm_is_refused_on_every_host_path(bad: Any) -> None:
    state = _warm()
    before = copy.deepcopy(state)
    calls = [
        lambda: sc.update(state, False, grad_norm=bad),
        lambda: sc.classify(state, False, bad),
        lambda: device_update(np, state, np.bool_(False), bad),
        lambda: sc.get_backend("numpy").update(state, False, bad),
    ]
    for call in calls:
        with pytest.raises(sc.GradientValueError, match=r"grad_norm=.*-.*but a norm is >= 0"):
            call()
    assert state == before


@pytest.mark.parametrize("value", [-0.0, 0.0, 1e-45, 1.0, math.inf, math.nan])
def test_norms_that_are_no_error_step(value: float) -> None:
    sc.update(_warm(), False, grad_norm=value)


@pytest.mark.parametrize(
    "value", [-1.0, -math.inf, -1e-45, -0.0, 0.0, 1e-45, 2.0, math.inf, math.nan]
)
def test_update_and_the_simulator_take_and_refuse_the_same_norms(value: float) -> None:
    def by_update() -> object:
        return sc.update(_warm(), False, grad_norm=value)

    def by_simulate() -> object:
        trace = Trace(found=(False,) * 6, grad_norm=(1.0, 1.25, 0.75, 1.0, 1.125, value))
        return simulate(trace, {"spiky": SPIKY})

    outcomes = []
    for call in (by_update, by_simulate):
        try:
            call()
        except ValueError:
            outcomes.append(False)
        else:
            outcomes.append(True)
    assert outcomes[0] == outcomes[1], (value, outcomes)


@pytest.mark.parametrize("library", ["torch", "jax"])
def test_a_negative_device_norm_counts_as_nan(library: str) -> None:
    # A device norm is never read back (that would be a host synchronisation), so a
    # negative one cannot raise; it moves nothing, as a NaN norm does.
    norm = _torch().tensor(-1.0) if library == "torch" else _jnp().float32(-1.0)
    out = sc.update(_warm(), False, grad_norm=norm).to_host()
    assert out == sc.update(_warm(), False, grad_norm=math.nan)


def test_a_bfloat16_numpy_scalar_is_a_host_norm() -> None:
    import ml_dtypes

    norm = np.array(1.5, dtype=ml_dtypes.bfloat16)[()]
    out = sc.update(_warm(), False, grad_norm=norm)
    assert out.on_host
    assert out == sc.update(_warm(), False, grad_norm=1.5)


# ------------------------------------------------- numbers no float holds
#: Ints beyond the largest float (``float()`` raises ``OverflowError``), and one beyond
#: the digits ``repr`` prints (it raises ``ValueError``): each a clear refusal, the int
#: described by its size.
HUGE = [10**400, -(10**400), 10**5000]


def _huge_id(value: int) -> str:
    return f"{'-' if value < 0 else ''}int of {value.bit_length()} bits"


def _shown(value: int) -> str:
    return f"{'a negative' if value < 0 else 'an'} int of {value.bit_length()} bits"


@pytest.mark.parametrize("huge", HUGE, ids=_huge_id)
def test_a_norm_no_float_holds_is_refused_on_every_host_path(huge: int) -> None:
    """Refused before anything changes, as a GradientValueError naming the value: too
    large for a float (pass math.inf), or negative (a norm is >= 0)."""
    state = _warm()
    before = copy.deepcopy(state)
    calls = [
        lambda: sc.update(state, False, grad_norm=huge),
        lambda: sc.classify(state, False, huge),
        lambda: device_update(np, state, np.bool_(False), huge),
        lambda: sc.get_backend("numpy").update(state, False, huge),
    ]
    why = "a norm is >= 0" if huge < 0 else r"it is too large for a float.*pass math\.inf"
    for call in calls:
        with pytest.raises(sc.GradientValueError, match=rf"grad_norm={_shown(huge)}, but {why}"):
            call()
    assert state == before


@pytest.mark.parametrize("huge", HUGE, ids=_huge_id)
@pytest.mark.parametrize(
    "field", ["init_scale", "growth_factor", "min_scale", "spike_threshold", "growth_interval"]
)
def test_a_config_number_no_float_holds_is_refused_naming_the_field(field: str, huge: int) -> None:
    with pytest.raises(sc.InvalidConfigError, match=rf"^{field}={_shown(huge)}, but it must"):
        sc.ScalerConfig(**{field: huge})


@pytest.mark.parametrize("huge", HUGE, ids=_huge_id)
@pytest.mark.parametrize("key", ["scale", "growth_tracker", "steps"])
def test_a_checkpoint_number_no_float_holds_is_refused_naming_the_key(key: str, huge: int) -> None:
    data = sc.to_dict(sc.init())
    bad = {**data, "state": {**data["state"], key: huge}}
    with pytest.raises(
        sc.InvalidStateError, match=rf"^checkpoint\['state'\]\['{key}'\]={_shown(huge)}, but"
    ):
        sc.from_dict(bad)
