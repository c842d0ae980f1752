"""The optax wrapper: a skipped step is bit-identical; the scaler advances; one trace."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the optax wrapper needs jax")
jnp = pytest.importorskip("jax.numpy", reason="the optax wrapper needs jax")
optax = pytest.importorskip("optax", reason="the optax wrapper needs optax")

import scaler_core as sc  # noqa: E402
from scaler_core.optax import LossScaledState, loss_scale, loss_scaled  # noqa: E402


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


def _loss(params: Any, x: Any, y: Any) -> Any:
    pred = x @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2)


@pytest.mark.parametrize(
    "inner",
    [optax.adamw(1e-2, weight_decay=0.1), optax.sgd(0.1, momentum=0.9)],
    ids=["adamw", "sgd-momentum"],
)
def test_skipped_step_is_bit_identical_and_scaler_advances(inner: Any) -> None:
    tx = loss_scaled(inner, sc.ScalerConfig(init_scale=1024.0, growth_interval=3))
    params = {"w": jnp.asarray([[1.0], [-0.0]]), "b": jnp.asarray([-0.0])}
    opt_state = tx.init(params)
    traces = []

    @jax.jit
    def step(params: Any, opt_state: LossScaledState, x: Any, y: Any) -> Any:
        traces.append(1)
        scale = loss_scale(opt_state)
        grads = jax.grad(lambda p: _loss(p, x, y) * scale)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
    params, opt_state = step(params, opt_state, x, y)  # a real step moves the moments
    before = (_bits(params), _bits(opt_state.inner))
    bad_x = x.at[0, 0].set(jnp.nan)
    jax.block_until_ready((params, opt_state, bad_x, y))
    with jax.transfer_guard("disallow"):
        after_params, after_state = step(params, opt_state, bad_x, y)
        jax.block_until_ready((after_params, after_state))
    assert (_bits(after_params), _bits(after_state.inner)) == before
    assert bool(after_state.found)
    assert after_state.scaler.current_scale() == 512.0
    assert int(after_state.scaler.skipped_steps) == 1
    assert int(after_state.scaler.steps) == 2
    stepped_params, stepped_state = step(after_params, after_state, x, y)
    assert _bits(stepped_params) != before[0]
    assert not bool(stepped_state.found)
    assert len(traces) == 1


def test_wrapped_step_equals_inner_step_on_unscaled_grads() -> None:
    inner = optax.adam(1e-3)
    tx = loss_scaled(inner, sc.ScalerConfig(init_scale=2.0**10))
    params = {"w": jnp.asarray([0.5, -1.5, 2.0])}
    grads = {"w": jnp.asarray([3.0, -1.0, 0.25])}
    ref_updates, _ = inner.update(grads, inner.init(params), params)
    scaled = jax.tree_util.tree_map(lambda g: g * 2.0**10, grads)
    updates, state = tx.update(scaled, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(ref_updates["w"]))
    assert int(state.scaler.steps) == 1


def test_state_and_config_arguments_are_checked() -> None:
    start = sc.init(sc.ScalerConfig(init_scale=8.0))
    tx = loss_scaled(optax.sgd(1.0), state=start)
    assert float(loss_scale(tx.init({"w": jnp.ones(1)}))) == 8.0
    with pytest.raises(sc.InvalidStateError, match="differs"):
        loss_scaled(optax.sgd(1.0), sc.ScalerConfig(), state=start)
    with pytest.raises(sc.InvalidStateError, match="state="):
        loss_scaled(optax.sgd(1.0), state={"scale": 1.0})  # type: ignore[arg-type]
