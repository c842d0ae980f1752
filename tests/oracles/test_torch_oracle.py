"""PyTorch 2.13.0 as an oracle: trajectories, unscale results and state_dict.

Skipped cleanly when torch is not installed (it is an optional test extra).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core.testing import configs, flag_sequences

torch = pytest.importorskip("torch", reason="PyTorch is the oracle for these tests")
pytestmark = pytest.mark.torch


def torch_trajectory(cfg: sc.ScalerConfig, flags: list[bool]) -> list[tuple[float, int]]:
    """``(scale, growth_tracker)`` after every step, from PyTorch's own kernel."""
    scale = torch.full((), cfg.init_scale, dtype=torch.float32)
    tracker = torch.zeros((), dtype=torch.int32)
    out = []
    for found in flags:
        found_inf = torch.full((), float(found), dtype=torch.float32)
        torch._amp_update_scale_(
            scale, tracker, found_inf, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval
        )
        out.append((scale.item(), int(tracker.item())))
    return out


def ours(cfg: sc.ScalerConfig, flags: list[bool]) -> list[tuple[float, int]] | int:
    """Our trajectory, or the index of the step we refused (fail-closed)."""
    state = sc.init(cfg)
    out = []
    for i, found in enumerate(flags):
        try:
            state = sc.update(state, found)
        except sc.ScaleCollapseError:
            return i
        out.append((state.scale, state.growth_tracker))
    return out


def assert_matches_torch(cfg: sc.ScalerConfig, flags: list[bool]) -> None:
    expected = torch_trajectory(cfg, flags)
    got = ours(cfg, flags)
    if isinstance(got, int):
        # We refuse exactly the step where PyTorch's scale becomes 0 or subnormal,
        # and agree with it on every step before.
        bad = expected[got][0]
        assert bad < 2.0**-126, (got, bad)
        assert ours(cfg, flags[:got]) == expected[:got]
        return
    assert got == expected


@given(configs(torch_compatible=True), flag_sequences(max_size=300))
def test_trajectory_equals_torch_amp_update_scale(cfg: sc.ScalerConfig, flags: list[bool]) -> None:
    assert_matches_torch(cfg, flags)


def test_thousands_of_random_sequences_equal_torch() -> None:
    rng = np.random.default_rng(20261130)
    growth = [1.5, 2.0, 4.0, 1.0009765625]
    backoff = [0.5, 0.25, 0.75, 0.9990234375]
    for _ in range(2000):
        cfg = sc.ScalerConfig(
            init_scale=float(np.float32(2.0 ** rng.uniform(-100, 127))),
            growth_factor=growth[rng.integers(len(growth))],
            backoff_factor=backoff[rng.integers(len(backoff))],
            growth_interval=int(rng.integers(1, 30)),
        )
        p = rng.uniform(0.0, 0.6)
        flags = (rng.random(int(rng.integers(1, 120))) < p).tolist()
        assert_matches_torch(cfg, flags)


def test_factors_float32_cannot_hold_equal_torch_on_host_and_device() -> None:
    """PyTorch takes backoff_factor=0.9 and multiplies in float64: so do we, host and device."""
    rng = np.random.default_rng(20261201)
    for _ in range(500):
        cfg = sc.ScalerConfig(
            init_scale=float(np.float32(2.0 ** rng.uniform(-60, 100))),
            growth_factor=float(rng.choice([1.1, 1.3, 2.5, 3.0])),
            backoff_factor=float(rng.choice([0.9, 0.1, 1 / 3, 0.7])),
            growth_interval=int(rng.integers(1, 5)),
        )
        flags = (rng.random(int(rng.integers(1, 80))) < 0.4).tolist()
        assert_matches_torch(cfg, flags)
        dev = sc.init(cfg)
        with np.errstate(all="ignore"):
            for i, found in enumerate(flags):
                dev = sc.device_update(np, dev, np.bool_(found))
                if int(dev.failure):
                    assert ours(cfg, flags) == i
                    break
                host_then = torch_trajectory(cfg, flags[: i + 1])[-1]
                assert (float(dev.scale), int(dev.growth_tracker)) == host_then


def test_collapse_is_refused_where_torch_goes_subnormal() -> None:
    cfg = sc.ScalerConfig(init_scale=2.0**-120)
    flags = [True] * 10
    expected = torch_trajectory(cfg, flags)
    assert expected[6][0] < 2.0**-126  # torch silently goes subnormal
    assert ours(cfg, flags) == 6


def torch_unscale(arrays: list[np.ndarray], inv_scale: float) -> tuple[list[np.ndarray], bool]:
    tensors = [torch.from_numpy(a.copy()) for a in arrays]
    found = torch.zeros((), dtype=torch.float32)
    inv = torch.full((), inv_scale, dtype=torch.float32)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv)
    return [t.numpy() for t in tensors], bool(found.item())


@st.composite
def gradient_lists(draw: st.DrawFn) -> list[np.ndarray]:
    n = draw(st.integers(1, 6))
    out = []
    for _ in range(n):
        dtype = draw(st.sampled_from([np.float32, np.float64]))
        size = draw(st.integers(0, 300))
        seed = draw(st.integers(0, 2**32 - 1))
        a = np.random.default_rng(seed).standard_normal(size).astype(dtype) * dtype(1000)
        if size and draw(st.booleans()):
            for _ in range(draw(st.integers(1, 3))):
                pos = draw(st.integers(0, size - 1))
                a[pos] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        out.append(a)
    return out


@given(gradient_lists(), st.sampled_from([2.0**16, 2.0**24, 1024.0, 3.0, 65536.0 * 3]))
def test_unscale_equals_torch_foreach_kernel(arrays: list[np.ndarray], scale: float) -> None:
    inv = float(np.float32(1.0 / np.float64(np.float32(scale))))
    expected, expected_found = torch_unscale(arrays, inv)
    grads = [a.copy() for a in arrays]
    _, found = sc.unscale(grads, scale)
    assert bool(found) == expected_found
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(g, e)  # NaN positions equal, values bit-equal
        assert g.tobytes() == e.tobytes() or np.isnan(g).any()


def test_intended_difference_overflow_created_by_unscale() -> None:
    """With a scale below 1 the unscale multiplies by > 1 and can overflow.

    PyTorch checks the input (finite) and misses it; we check the stored output.
    """
    big = np.array([3.0e38], dtype=np.float32)
    _, torch_found = torch_unscale([big], 1.0 / 0.5)
    assert torch_found is False
    grads = [big.copy()]
    _, found = sc.unscale(grads, 0.5)
    assert bool(found) is True
    assert np.isinf(grads[0][0])


def test_state_dict_round_trips_with_torch_gradscaler() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    for found in [False, False, True, False]:
        opt.zero_grad()
        loss = (param * (float("inf") if found else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    exported = scaler.state_dict()
    state = sc.from_dict(exported)
    assert state.scale == exported["scale"] == 512.0
    assert state.growth_tracker == exported["_growth_tracker"] == 1
    assert state.config.growth_interval == 7
    # ...and back into a fresh torch scaler, which then continues identically.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(sc.to_dict(state, format="torch"))
    assert fresh.state_dict() == exported
    ours_next = sc.update(state, False)
    assert sc.to_dict(ours_next, format="torch")["_growth_tracker"] == 2
