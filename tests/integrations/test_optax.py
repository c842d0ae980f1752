"""The optax wrapper: a skipped step is bit-identical; the scaler advances; one trace."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax", reason="the optax wrapper needs jax")
jnp = pytest.importorskip("jax.numpy", reason="the optax wrapper needs jax")
optax = pytest.importorskip("optax", reason="the optax wrapper needs optax")

import scaler_core as sc  # noqa: E402
from scaler_core.optax import (  # noqa: E402
    LossScaledState,
    current_scale,
    scale_loss,
    with_loss_scaling,
)


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
    tx = with_loss_scaling(inner, sc.ScalerConfig(init_scale=1024.0, growth_interval=3))
    params = {"w": jnp.asarray([[1.0], [-0.0]]), "b": jnp.asarray([-0.0])}
    opt_state = tx.init(params)
    traces = []

    @jax.jit
    def step(params: Any, opt_state: LossScaledState, x: Any, y: Any) -> Any:
        traces.append(1)
        grads = jax.grad(lambda p: scale_loss(_loss(p, x, y), opt_state))(params)
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
    assert bool(after_state.skipped)
    assert after_state.scaler.current_scale() == 512.0
    assert int(after_state.scaler.skipped_steps) == 1
    assert int(after_state.scaler.steps) == 2
    stepped_params, stepped_state = step(after_params, after_state, x, y)
    assert _bits(stepped_params) != before[0]
    assert not bool(stepped_state.skipped)
    assert len(traces) == 1


def test_wrapped_step_equals_inner_step_on_unscaled_grads() -> None:
    inner = optax.adam(1e-3)
    tx = with_loss_scaling(inner, sc.ScalerConfig(init_scale=2.0**10))
    params = {"w": jnp.asarray([0.5, -1.5, 2.0])}
    grads = {"w": jnp.asarray([3.0, -1.0, 0.25])}
    ref_updates, _ = inner.update(grads, inner.init(params), params)
    scaled = jax.tree_util.tree_map(lambda g: g * 2.0**10, grads)
    updates, state = tx.update(scaled, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), np.asarray(ref_updates["w"]))
    assert int(state.scaler.steps) == 1


def test_state_and_config_arguments_are_checked() -> None:
    start = sc.init(sc.ScalerConfig(init_scale=8.0))
    tx = with_loss_scaling(optax.sgd(1.0), state=start)
    assert float(current_scale(tx.init({"w": jnp.ones(1)}))) == 8.0
    with pytest.raises(sc.InvalidStateError, match="differs"):
        with_loss_scaling(optax.sgd(1.0), sc.ScalerConfig(), state=start)
    with pytest.raises(sc.InvalidStateError, match="state="):
        with_loss_scaling(optax.sgd(1.0), state={"scale": 1.0})  # type: ignore[arg-type]


def test_multisteps_inside_with_loss_scaling_skips_only_the_bad_micro_batch() -> None:
    """with_loss_scaling(MultiSteps(inner)): each micro-batch is checked before it is
    accumulated, so an overflow skips that micro-batch alone and backs off once."""
    tx = with_loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), sc.ScalerConfig())
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    for i in range(12):
        grads = {"w": jnp.full(3, jnp.inf if i == 3 else 65536.0)}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert int(state.scaler.skipped_steps) == 1
    assert float(state.scaler.scale) == 32768.0
    assert bool(jnp.all(jnp.isfinite(params["w"])))


def test_with_loss_scaling_inside_multisteps_is_refused_with_the_working_order() -> None:
    """MultiSteps(with_loss_scaling(inner)) accumulates scaled gradients before they are
    checked; MultiSteps' reset multiplies an inf by 0, so one overflow made every later
    window NaN, skipped and backed off (5 of 6 steps, scale 2**16 -> 2**11, silently)."""
    tx = optax.MultiSteps(with_loss_scaling(optax.sgd(0.1)), every_k_schedule=2)
    with pytest.raises(sc.InvalidArgumentError, match=r"with_loss_scaling\(optax\.MultiSteps\("):
        tx.init({"w": jnp.ones(3)})


def _nested(depth: int, tx: Any) -> Any:
    for _ in range(depth):
        tx = optax.chain(tx)
    return tx


_LABELS = {"a": "scaled", "b": "plain"}
_NESTINGS: dict[str, Any] = {
    "chain-chain": lambda ls: optax.chain(optax.chain(ls)),
    "chain-partition": lambda ls: optax.chain(
        optax.partition({"scaled": ls, "plain": optax.sgd(0.1)}, _LABELS)
    ),
    "multi_transform": lambda ls: optax.multi_transform(
        {"scaled": ls, "plain": optax.sgd(0.1)}, _LABELS
    ),
    "named_chain": lambda ls: optax.named_chain(("clip", optax.clip(1.0)), ("scaled", ls)),
    "masked": lambda ls: optax.chain(optax.masked(ls, {"a": True, "b": False})),
    "six-chains": lambda ls: _nested(6, ls),
    "gradient_transformation": lambda ls: optax.chain(
        optax.MultiSteps(_nested(2, ls), every_k_schedule=2).gradient_transformation()
    ),
}


@pytest.mark.parametrize("wrap", list(_NESTINGS.values()), ids=list(_NESTINGS))
def test_with_loss_scaling_nested_at_any_depth_inside_multisteps_is_refused(wrap: Any) -> None:
    """However deep the wrapper sits inside MultiSteps (chains, partition, masked,
    named_chain), MultiSteps still accumulates its scaled gradients unchecked: after
    one overflow no update was ever applied again and the scale halved every window.
    (The check looked a fixed number of frames up the stack, and missed these.)"""
    tx = optax.MultiSteps(wrap(with_loss_scaling(optax.sgd(0.1))), every_k_schedule=2)
    params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    with pytest.raises(sc.InvalidArgumentError, match=r"with_loss_scaling\(optax\.MultiSteps\("):
        tx.init(params)
    with pytest.raises(sc.InvalidArgumentError, match=r"with_loss_scaling\(optax\.MultiSteps\("):
        jax.eval_shape(tx.init, params)  # under tracing too


def test_a_with_loss_scaling_that_multisteps_does_not_hold_is_not_refused() -> None:
    """Only a MultiSteps that holds the wrapper refuses it: one initialised inside a
    MultiSteps' init for some other purpose, or on its own, is accepted."""
    seen = []

    def init(params: Any) -> Any:  # an inner optimizer that inits a scaler of its own
        seen.append(current_scale(with_loss_scaling(optax.sgd(0.1)).init(params)))
        return optax.sgd(0.1).init(params)

    probe = optax.GradientTransformation(init, optax.sgd(0.1).update)
    params = {"w": jnp.ones(3)}
    optax.MultiSteps(probe, every_k_schedule=2).init(params)
    assert [float(s) for s in seen] == [65536.0]
    held = with_loss_scaling(optax.sgd(0.1))
    optax.MultiSteps(optax.chain(held), every_k_schedule=2)  # built, never initialised
    assert float(current_scale(held.init(params))) == 65536.0


def test_multisteps_nested_inside_the_wrapper_is_accepted_and_checks_each_micro_batch() -> None:
    tx = with_loss_scaling(optax.chain(optax.chain(optax.MultiSteps(optax.sgd(0.1), 2))))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    for i in range(12):  # unscaled gradients of 1.0, one overflow: 11 micro-batches kept
        grads = {"w": jnp.full(3, jnp.inf if i == 3 else 1.0) * current_scale(state)}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert int(state.scaler.skipped_steps) == 1
    assert float(state.scaler.scale) == 32768.0
    assert float(params["w"][0]) == pytest.approx(1.0 - 5 * 0.1)  # five whole windows


def test_flax_serialization_round_trips_the_optimizer_state() -> None:
    serialization = pytest.importorskip("flax.serialization", reason="flax is optional")
    tx = with_loss_scaling(optax.adam(1e-2), sc.ScalerConfig(min_scale=1.0, growth_interval=3))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    for bad in (False, True, False):
        grads = {"w": jnp.full(3, jnp.inf if bad else 65536.0)}
        _, state = tx.update(grads, state, params)
    data = serialization.to_bytes(state)
    restored = serialization.from_bytes(tx.init(params), data)
    assert restored.scaler.config == state.scaler.config  # from the target: min_scale kept
    assert restored.scaler.to_host() == state.scaler.to_host()
    assert float(current_scale(restored)) == float(current_scale(state)) == 32768.0


def test_current_scale_reads_an_nnx_optimizers_state() -> None:
    nnx = pytest.importorskip("flax.nnx", reason="flax NNX is optional")
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    tx = with_loss_scaling(optax.sgd(0.1))
    try:
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    except TypeError:  # flax before 0.11 takes no wrt
        optimizer = nnx.Optimizer(model, tx)
    scale = current_scale(optimizer.opt_state)
    assert isinstance(scale, jax.Array)
    assert float(scale) == 65536.0
    with pytest.raises(sc.InvalidArgumentError, match="LossScaledState"):
        current_scale({"scaler": None})  # type: ignore[arg-type]


def test_a_spike_is_skipped_inside_jit_like_an_overflow() -> None:
    config = sc.ScalerConfig(spike_threshold=3.0, spike_window=8)
    tx = with_loss_scaling(optax.sgd(0.1), config)
    params = {"w": jnp.zeros(16)}
    opt_state = tx.init(params)
    rng = np.random.default_rng(0)

    @jax.jit
    def step(params: Any, opt_state: Any, g: Any) -> Any:
        grads = jax.tree_util.tree_map(lambda x: x * current_scale(opt_state), g)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for i in range(12):
        size = 100.0 if i == 10 else 1.0
        before = params
        g = {"w": jnp.asarray(rng.standard_normal(16).astype(np.float32) * size)}
        params, opt_state = step(params, opt_state, g)
        moved = not bool(jnp.array_equal(before["w"], params["w"]))
        assert moved is (i != 10), i
        assert bool(opt_state.skipped) is (i == 10)
    assert opt_state.scaler.last_step is sc.StepKind.COUNT
    assert int(opt_state.scaler.skipped_steps) == 1
    assert float(current_scale(opt_state)) == 65536.0


_SKIP_CONFIGS: dict[tuple[int, int], Any] = {}


def _spiky_step(window: int, limit: int) -> Any:
    """A jitted with_loss_scaling(sgd(1)) step on one weight, fed ``v * scale`` (``v``: the
    unscaled gradient, inf for an overflow); one compile per config."""
    key = (window, limit)
    if key not in _SKIP_CONFIGS:
        config = sc.ScalerConfig(
            init_scale=2.0**10,
            growth_interval=3,
            spike_threshold=2.0,
            spike_window=window,
            max_consecutive_skips=limit,
        )
        tx = with_loss_scaling(optax.sgd(1.0), config)

        @jax.jit
        def step(params: Any, opt_state: Any, v: Any) -> Any:
            grads = {"w": jnp.reshape(v, (1,)) * current_scale(opt_state)}
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        _SKIP_CONFIGS[key] = (config, tx, step)
    return _SKIP_CONFIGS[key]


def _optax_applied(window: int, limit: int, values: list[float]) -> list[bool]:
    _, tx, step = _spiky_step(window, limit)
    params = {"w": jnp.zeros(1)}
    opt_state = tx.init(params)
    applied = []
    for v in values:
        before = np.asarray(params["w"]).tobytes()
        params, opt_state = step(params, opt_state, jnp.float32(v))
        applied.append(np.asarray(params["w"]).tobytes() != before)
    return applied


def test_the_step_that_records_skip_limit_is_not_applied() -> None:
    """An overflow, then a spike with max_consecutive_skips=1: the spike records
    SKIP_LIMIT, and neither it nor any later step may move the parameters. (The
    wrapper read the previous step's kind, BACKOFF, and applied the spike.)"""
    values = [1.0, 1.5, 1.0, 1.5, float("inf"), 1000.0, 1.0, 1.0]
    applied = _optax_applied(2, 1, values)
    assert applied == [True, True, True, True, False, False, False, False]


_NORMS = st.sampled_from([1.0, 1.5, 2.0, 1000.0, float("inf")])


@given(
    window=st.sampled_from([2, 3]),
    limit=st.sampled_from([1, 2, 3]),
    values=st.lists(_NORMS, min_size=1, max_size=14),
)
@settings(max_examples=60, deadline=None)
def test_optax_facade_and_host_transition_skip_the_same_steps(
    window: int, limit: int, values: list[float]
) -> None:
    """The optax wrapper applies exactly the steps the facade lets through and the
    host transition classifies as not skipped; from a refused step on, nothing."""
    config, _, _ = _spiky_step(window, limit)
    optax_applied = _optax_applied(window, limit, values)
    host, facade = [], []
    state = sc.init(config)
    scaler = sc.LossScaler(config, backend="numpy")
    refused = None
    for i, v in enumerate(values):
        found = v == float("inf")
        host.append(not sc.classify(state, found, v).skipped)
        grads = [np.asarray([v * scaler.current_scale()], np.float32)]
        scaler.unscale_and_norm(grads)
        facade.append(not scaler.should_skip_step())
        try:
            state = sc.update(state, found, grad_norm=v)
            scaler.update()
        except sc.SkipLimitError:
            refused = i
            break
    n = len(host)
    assert optax_applied[:n] == host == facade, (values, optax_applied)
    if refused is not None:
        assert not any(optax_applied[refused:]), (values, optax_applied)
