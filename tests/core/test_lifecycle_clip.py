"""The facade's clipping, norm and per-step hooks."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scaler_core as sc


def test_unscale_and_clip_clips_a_taken_step_and_reports_it() -> None:
    reports: list[sc.StepReport] = []
    scaler = sc.LossScaler(on_step=reports.append)
    grads = {"w": np.array([6.0, 8.0], np.float32) * 65536}
    scaler.unscale_and_clip(grads, 1.0)
    assert float(scaler.grad_norm) == 10.0
    assert np.allclose(grads["w"], [0.6, 0.8])
    assert scaler.phase is sc.StepPhase.DECIDED
    assert scaler.step(lambda: "stepped") == "stepped"
    scaler.update()
    assert len(reports) == 1
    assert reports[0].kind is sc.StepKind.COUNT
    assert float(reports[0].grad_norm) == 10.0
    assert reports[0].scale == 65536.0
    assert scaler.last_report is reports[0]


def test_a_skipped_step_is_not_touched_and_the_leaf_is_named() -> None:
    reports: list[sc.StepReport] = []
    scaler = sc.LossScaler(on_step=reports.append, report_leaves=True)
    grads = {"ok": np.ones(4, np.float32), "layer3": {"w": np.array([np.inf, 1.0], np.float32)}}
    before = {"ok": grads["ok"].copy(), "w": grads["layer3"]["w"].copy()}
    scaler.unscale_and_clip(grads, 1.0)
    assert np.array_equal(grads["ok"], before["ok"])
    assert np.array_equal(grads["layer3"]["w"], before["w"])
    assert scaler.step(lambda: "stepped") is None
    scaler.update()
    (report,) = reports
    assert report.kind is sc.StepKind.BACKOFF
    assert [str(leaf) for leaf in report.leaves] == ["grads['layer3']['w']: 1 inf, 0 nan"]


def test_an_earlier_group_s_overflow_skips_the_clipped_group_too() -> None:
    scaler = sc.LossScaler()
    scaler.unscale([np.array([np.nan], np.float32)], group="first")
    second = [np.full(3, 8.0, np.float32)]
    scaler.unscale_and_clip(second, 1.0, group="second")
    assert np.all(second[0] == 8.0)  # not written: the step is skipped
    assert scaler.should_skip_step()


def test_the_reduced_flag_decides_the_write() -> None:
    scaler = sc.LossScaler(reduce_found=lambda found: np.bool_(True))
    grads = [np.full(3, 8.0, np.float32)]
    scaler.unscale_and_clip(grads, 1.0)
    assert np.all(grads[0] == 8.0)


def test_unscale_and_norm_and_refusals() -> None:
    scaler = sc.LossScaler()
    grads = [np.array([3.0, 4.0], np.float32) * 65536]
    scaler.unscale_and_norm(grads)
    assert float(scaler.grad_norm) == 5.0
    assert grads[0].tolist() == [3.0, 4.0]
    with pytest.raises(sc.LifecycleError, match="already been called"):
        scaler.unscale_and_clip(grads, 1.0)
    scaler.update()
    with pytest.raises(sc.InvalidArgumentError, match="max_norm=-1"):
        scaler.unscale_and_clip(grads, -1)
    assert scaler.phase is sc.StepPhase.READY
    assert grads[0].tolist() == [3.0, 4.0]
    with pytest.raises(sc.InvalidArgumentError, match="on_step="):
        sc.LossScaler(on_step=3)  # type: ignore[arg-type]


def test_two_groups_norms_combine_as_one_vector() -> None:
    scaler = sc.LossScaler(sc.ScalerConfig(init_scale=1.0))
    scaler.unscale_and_norm([np.array([3.0], np.float32)], group="a")
    scaler.unscale_and_norm([np.array([4.0], np.float32)], group="b")
    assert float(scaler.grad_norm) == pytest.approx(5.0)


def test_a_spike_skips_the_optimizer_step_and_keeps_the_scale() -> None:
    config = sc.ScalerConfig(spike_threshold=3.0, spike_window=8)
    scaler = sc.LossScaler(config)
    rng = np.random.default_rng(0)
    stepped = []
    for i in range(12):
        size = 100.0 if i == 10 else 1.0
        grads = [rng.standard_normal(64).astype(np.float32) * size * scaler.current_scale()]
        scaler.unscale_and_norm(grads)
        stepped.append(scaler.step(lambda: True) is not None)
        scaler.update()
    assert stepped == [True] * 10 + [False, True]
    assert scaler.state.skipped_steps == 1
    assert scaler.current_scale() == 65536.0


def test_spike_skipping_without_a_norm_is_refused_with_the_fix() -> None:
    scaler = sc.LossScaler(sc.ScalerConfig(spike_threshold=3.0))
    scaler.unscale([np.ones(3, np.float32)])
    with pytest.raises(sc.InvalidArgumentError, match="unscale_and_norm"):
        scaler.should_skip_step()


# Group norms whose squares overflow or underflow float32, next to ordinary ones.
EXTREMES = [
    (3e19, 3e19),
    (1e-23, 1e-23),
    (3e38, 3e38),
    (3e38, 1e-38),
    (1e-45, 1e-45),
    (3.0, 4.0),
    (0.0, 0.0),
    (0.0, 2e-30),
    (1.0, 2.0, 3e19, 1e-23),
    (math.inf, 1.0),
    (math.nan, 1.0),
]


def _arrays(library: str) -> Callable[[float], Any]:
    if library == "torch":
        torch = pytest.importorskip("torch")
        return lambda x: torch.tensor([x], dtype=torch.float32)
    if library == "jax":
        pytest.importorskip("jax")
        import jax.numpy as jnp

        return lambda x: jnp.asarray([x], jnp.float32)
    return lambda x: np.array([x], np.float32)


def _reference(norms: list[float]) -> np.float32:
    """The norm of the groups' norms as one vector: exact in math, rounded once."""
    if any(math.isnan(n) for n in norms):
        return np.float32(math.nan)
    with np.errstate(over="ignore"):  # above float32's largest: inf, as for one vector
        return np.float32(math.hypot(*norms))


@pytest.mark.parametrize("library", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("planted", EXTREMES, ids=repr)
def test_group_norms_combine_as_one_vector_even_at_the_extremes(
    library: str, planted: tuple[float, ...]
) -> None:
    array = _arrays(library)
    scaler = sc.LossScaler(sc.ScalerConfig(init_scale=1.0))
    groups = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or underflow warning either
        for i, value in enumerate(planted):
            scaler.unscale_and_norm([array(value)], group=i)
            groups.append(float(scaler._norms[i]))
        total = np.float32(float(scaler.grad_norm))
    if library != "jax":  # JAX without float64 sums each group in float32 (stated)
        assert np.array_equal(groups, np.float32(planted), equal_nan=True)
    expected = _reference(groups)
    assert total.tobytes() == expected.tobytes() or (np.isnan(total) and np.isnan(expected)), (
        planted,
        total,
        expected,
    )


@settings(max_examples=60)
@given(
    st.lists(
        st.floats(0.0, 3.3999999521443642e38, width=32, allow_subnormal=True)
        | st.sampled_from([3e19, 1e-23]),
        min_size=2,
        max_size=5,
    )
)
def test_group_norms_combine_within_one_ulp_of_the_exact_norm(norms: list[float]) -> None:
    scaler = sc.LossScaler(sc.ScalerConfig(init_scale=1.0))
    for i, value in enumerate(norms):
        scaler.unscale_and_norm([np.array([value], np.float32)], group=i)
    total = np.float32(scaler.grad_norm)
    expected = _reference([float(np.float32(v)) for v in norms])
    assert abs(int(total.view(np.int32)) - int(expected.view(np.int32))) <= 1, (norms, total)
