"""The state as a JAX pytree, and the device transition against the host one."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax", reason="the JAX backend needs jax")
jnp = pytest.importorskip("jax.numpy", reason="the JAX backend needs jax")
jax_core = pytest.importorskip("jax.extend.core", reason="the JAX backend needs jax")

from common_transitions import host_run  # noqa: E402

import scaler_core as sc  # noqa: E402
from scaler_core._state import DATA_FIELDS, device_update, host_update  # noqa: E402
from scaler_core.jax import to_device  # noqa: E402
from scaler_core.testing import configs, flag_sequences, norm_sequences  # noqa: E402

FLAGS_LEN = 64  # fixed length: one compile per config, not per sequence length


#: The window statistics: static (not leaves) while spike skipping is off.
STATS = ("norm_mean", "norm_var", "norm_count")


def _fields(state: sc.ScalerState) -> tuple[Any, ...]:
    """Every data field as a Python value (a static one is one already)."""
    return tuple(np.asarray(getattr(state, n)).item() for n in DATA_FIELDS)


def _host_fields(state: sc.ScalerState) -> tuple[Any, ...]:
    return tuple(getattr(state, n) for n in DATA_FIELDS)


def _declared_leaves(state: sc.ScalerState) -> tuple[str, ...]:
    """The leaves the field declaration gives ``state``: the data fields less those
    whose ``static_when`` holds for it."""
    return tuple(
        f.name
        for f in dataclasses.fields(sc.ScalerState)
        if not f.metadata["static"] and not f.metadata.get("static_when", lambda s: False)(state)
    )


@pytest.mark.parametrize("spikes", [False, True], ids=["spikes_off", "spikes_on"])
def test_pytree_split_comes_from_the_declaration(spikes: bool) -> None:
    config = sc.ScalerConfig(
        min_scale=4.0, max_scale=2.0**20, spike_threshold=3.0 if spikes else None
    )
    state = to_device(sc.init(config))
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = _declared_leaves(state)
    assert [jax.tree_util.keystr(path) for path, _ in with_paths] == [f".{n}" for n in leaves]
    assert leaves == (DATA_FIELDS if spikes else tuple(n for n in DATA_FIELDS if n not in STATS))
    assert all(isinstance(x, jax.Array) for _, x in with_paths)
    assert state.scale.dtype == jnp.float32
    assert state.steps.dtype == jnp.int32
    for name in STATS:  # off: Python numbers, held beside the config in the treedef
        assert isinstance(getattr(state, name), jax.Array) is spikes
    back = jax.tree_util.tree_unflatten(treedef, [x for _, x in with_paths])
    assert back.config == config
    assert back.to_host() == state.to_host()


def _run(code: str, cwd: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=str(cwd),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_state_built_once_jax_is_loaded_registers_the_class_without_the_backend(
    tmp_path: Path,
) -> None:
    """Registration follows the user's imports: nothing before ``import jax``, the class
    (every state, the earlier ones too) at the first construction after it."""
    out = _run(
        """
        import sys
        import scaler_core as sc
        before = sc.init()
        assert "jax" not in sys.modules
        import jax
        assert len(jax.tree_util.tree_leaves(before)) == 1  # not registered yet: one leaf
        after = sc.init()
        assert "scaler_core.backends._jax" not in sys.modules
        print(len(jax.tree_util.tree_leaves(before)), len(jax.tree_util.tree_leaves(after)))
        """,
        tmp_path,
    )
    leaves = len(DATA_FIELDS) - len(STATS)  # spike skipping is off by default
    assert out == f"{leaves} {leaves}"


def test_a_stub_jax_module_is_left_alone(tmp_path: Path) -> None:
    out = _run(
        """
        import sys, types
        sys.modules["jax"] = types.ModuleType("jax")  # no tree_util: nothing to register with
        import scaler_core as sc
        print(sc.update(sc.init(), True).scale)
        """,
        tmp_path,
    )
    assert out == "32768.0"


def test_flax_restores_a_state_into_its_target_and_fills_the_spike_fields_of_an_old_one() -> None:
    serialization = pytest.importorskip("flax.serialization", reason="flax is optional")
    config = sc.ScalerConfig(min_scale=1.0, spike_threshold=3.0, spike_window=4)
    state = to_device(sc.update(sc.update(sc.init(config), True, 1.0), False, grad_norm=2.0))
    target = to_device(sc.init(config))
    restored = serialization.from_bytes(target, serialization.to_bytes(state))
    assert restored.config == config
    assert restored.to_host() == state.to_host()
    old = serialization.to_state_dict(state)
    for name in ("norm_mean", "norm_var", "norm_count", "last_kind"):  # before spike skipping
        del old[name]
    restored = serialization.from_state_dict(target, old)
    assert restored.to_host() == dataclasses.replace(
        state.to_host(), norm_mean=0.0, norm_var=0.0, norm_count=0, last_kind=0
    )
    del old["scale"]
    with pytest.raises(sc.InvalidStateError, match=r"lacks the ScalerState fields \['scale'\]"):
        serialization.from_state_dict(target, old)


def test_flax_restores_the_static_statistics_of_a_state_with_spike_skipping_off() -> None:
    """Saved with the other fields; restored as Python numbers, also from a checkpoint
    that holds them as arrays (as one saved before they were static does)."""
    serialization = pytest.importorskip("flax.serialization", reason="flax is optional")
    host = _loaded(norm_mean=1.5, norm_var=0.25, norm_count=7)
    state = jax.jit(sc.update)(to_device(host), jnp.asarray(True))
    target = to_device(sc.init(host.config))
    restored = serialization.from_bytes(target, serialization.to_bytes(state))
    assert restored.to_host() == sc.update(host, True)
    saved = serialization.to_state_dict(state)
    saved.update(norm_mean=np.float32(1.5), norm_var=np.float32(0.25), norm_count=np.int32(7))
    restored = serialization.from_state_dict(target, saved)
    assert (restored.norm_mean, restored.norm_var, restored.norm_count) == (1.5, 0.25, 7)
    assert [type(getattr(restored, n)) for n in STATS] == [float, float, int]
    assert jax.jit(sc.update)(restored, jnp.asarray(False)).to_host() == sc.update(
        sc.update(host, True), False
    )


def _loaded(**stats: Any) -> sc.ScalerState:
    """A host state with spike skipping off and the given window statistics, loaded
    from a checkpoint (as a run that had spike skipping on and turned it off would)."""
    data = sc.to_dict(sc.init(sc.ScalerConfig(init_scale=2.0**10, growth_interval=3)))
    data["state"].update(stats)
    return sc.from_dict(data)


def test_with_spike_skipping_off_a_jitted_update_neither_takes_nor_returns_the_statistics() -> None:
    """What makes the statistics free when they are not used: they are not in the
    traced program at all (no input, no output, no arithmetic); with spike skipping
    on they are, and the window's update (its 1/n) is computed."""
    flag = jnp.asarray(False)
    off = to_device(sc.init(sc.preset("jmp")))
    on = to_device(sc.init(sc.preset("jmp", spike_threshold=6.0)))
    jaxpr_off = jax.make_jaxpr(sc.update)(off, flag)
    jaxpr_on = jax.make_jaxpr(sc.update)(on, flag, jnp.float32(1.0))
    live = len(DATA_FIELDS) - len(STATS)
    assert (len(jaxpr_off.in_avals), len(jaxpr_off.out_avals)) == (live + 1, live)
    assert (len(jaxpr_on.in_avals), len(jaxpr_on.out_avals)) == (
        len(DATA_FIELDS) + 2,
        len(DATA_FIELDS),
    )
    assert "div" not in _primitives(jaxpr_off.jaxpr)
    assert "div" in _primitives(jaxpr_on.jaxpr)
    assert len(jax.tree_util.tree_leaves(off)) == live


def _primitives(jaxpr: Any) -> set[str]:
    """Every primitive in ``jaxpr``, inner jaxprs (jit, where's) included."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            out |= _primitives(sub)
    return out


def test_with_spike_skipping_off_the_statistics_survive_jit_scan_cond_vmap_and_checkpoints() -> (
    None
):
    """Static statistics keep their values (loaded, not the defaults) through every way
    a state travels, and every path gives the host's answer."""
    host = _loaded(norm_mean=1.5, norm_var=0.25, norm_count=7)
    state = to_device(host)
    assert [getattr(state, n) for n in STATS] == [1.5, 0.25, 7]
    assert [type(getattr(state, n)) for n in STATS] == [float, float, int]
    flags = [False, True, False, False, False, True]
    expected = [host]
    for flag in flags:
        expected.append(host_update(expected[-1], flag))
    step = jax.jit(sc.update)
    stepped = state
    for flag, want in zip(flags, expected[1:], strict=True):
        stepped = step(stepped, jnp.asarray(flag))
        assert stepped.to_host() == want
        assert jax.tree_util.tree_structure(stepped) == jax.tree_util.tree_structure(state)
    on_numpy = device_update(np, host, np.bool_(True))  # the device rules on the host
    assert on_numpy.to_host() == host_update(host, True)
    scanned = jax.jit(
        lambda s, fs: jax.lax.scan(lambda c, f: (sc.update(c, f), c.steps), s, fs)[0]
    )(state, jnp.asarray(flags))
    assert scanned.to_host() == expected[-1]
    pick = jax.jit(
        lambda s, p: jax.lax.cond(p, lambda t: sc.update(t, jnp.asarray(True)), lambda t: t, s)
    )
    assert pick(state, jnp.asarray(True)).to_host() == host_update(host, True)
    assert pick(state, jnp.asarray(False)).to_host() == host
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), state, state)
    both = jax.vmap(sc.update)(stacked, jnp.asarray([False, True]))
    for i, flag in enumerate((False, True)):
        one = jax.tree_util.tree_map(lambda x, i=i: x[i], both)
        assert one.to_host() == host_update(host, flag)
    assert sc.from_dict(sc.to_dict(stepped)) == expected[-1]
    assert sc.to_dict(stepped)["state"]["norm_mean"] == 1.5


def test_a_static_statistic_held_in_an_array_is_read_back_once_and_a_traced_one_refused() -> None:
    arrays = dataclasses.replace(
        sc.init(), norm_mean=np.float32(1.5), norm_var=jnp.float32(0.25), norm_count=np.int32(7)
    )
    for state in (to_device(arrays), jax.jit(lambda s: s)(arrays)):
        assert [getattr(state, n) for n in STATS] == [1.5, 0.25, 7]
        assert [type(getattr(state, n)) for n in STATS] == [float, float, int]
    with pytest.raises(
        sc.InvalidStateError, match=r"ScalerState\.norm_mean=.*makes norm_mean static"
    ):
        jax.jit(lambda m: to_device(dataclasses.replace(sc.init(), norm_mean=m)))(jnp.float32(1))


@given(config=configs(), steps=st.integers(0, 50), skipped=st.integers(0, 50))
@settings(max_examples=15)
def test_flatten_unflatten_jit_tree_map_and_vmap_keep_every_field(
    config: sc.ScalerConfig, steps: int, skipped: int
) -> None:
    skipped = min(steps, skipped)
    host = dataclasses.replace(sc.init(config), steps=steps, skipped_steps=skipped)
    state = to_device(host)
    flat, treedef = jax.tree_util.tree_flatten(state)
    back = jax.tree_util.tree_unflatten(treedef, flat)
    through_jit = jax.jit(lambda s: s)(state)
    mapped = jax.tree_util.tree_map(lambda x: x, state)
    for out in (back, through_jit, mapped):
        assert out.config == config  # min_scale, max_scale and every knob included
        assert out.config.min_scale == config.min_scale
        assert out.to_host() == host
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), state, state)
    stepped = jax.vmap(sc.update)(stacked, jnp.asarray([False, True]))
    assert stepped.config == config
    for i, flag in enumerate((False, True)):
        one = jax.tree_util.tree_map(lambda x, i=i: x[i], stepped)
        try:
            expected = host_update(host, flag)
        except sc.ScaleCollapseError:
            assert int(one.failure) != 0
        else:
            assert one.to_host() == expected


def _scan(config: sc.ScalerConfig) -> Any:
    def run(state: sc.ScalerState, flags: Any) -> Any:
        def body(s: sc.ScalerState, f: Any) -> Any:
            new = sc.update(s, f)
            return new, new

        return jax.lax.scan(body, state, flags)[1]

    return jax.jit(run)


@given(config=configs(), flags=flag_sequences(max_size=FLAGS_LEN))
@settings(max_examples=20)
def test_device_transition_equals_host_transition(config: sc.ScalerConfig, flags: list) -> None:
    flags = (flags + [False] * FLAGS_LEN)[:FLAGS_LEN]
    traj = _scan(config)(to_device(sc.init(config)), jnp.asarray(flags))
    for i, (host, failed) in enumerate(host_run(config, flags)):
        dev = jax.tree_util.tree_map(lambda x, i=i: x[i], traj)
        if failed is None:
            assert _fields(dev) == _host_fields(host), f"step {i}"
        else:
            # The device keeps the last valid values and records why it stopped.
            at = DATA_FIELDS.index("failure")
            dev_kept, host_kept = list(_fields(dev)), list(_host_fields(host))
            del dev_kept[at], host_kept[at]
            assert dev_kept == host_kept, f"step {i}"
            assert int(dev.failure) == int(failed)
            err = sc.SkipLimitError if failed is sc.Failure.SKIP_LIMIT else sc.ScaleCollapseError
            with pytest.raises(err):
                dev.check()
            with pytest.raises(err):
                dev.current_scale()
            with pytest.raises(err):
                sc.to_dict(dev)


def _scan_spikes(config: sc.ScalerConfig) -> Any:
    def run(state: sc.ScalerState, flags: Any, norms: Any) -> Any:
        def body(s: sc.ScalerState, step: Any) -> Any:
            new = sc.update(s, step[0], grad_norm=step[1])
            return new, new

        return jax.lax.scan(body, state, (flags, norms))[1]

    return jax.jit(run)


@given(config=configs(spikes=True), flags=flag_sequences(max_size=FLAGS_LEN), data=st.data())
@settings(max_examples=20, deadline=None)
def test_device_transition_with_spikes_equals_host_under_jit(
    config: sc.ScalerConfig, flags: list, data: st.DataObject
) -> None:
    """Spike skipping inside jax.jit (XLA flushes float32 subnormals, and may fuse
    multiply-adds): the window statistics and every decision equal the host's bit for bit."""
    flags = (flags + [False] * FLAGS_LEN)[:FLAGS_LEN]
    norms = data.draw(norm_sequences(FLAGS_LEN, FLAGS_LEN))
    traj = _scan_spikes(config)(
        to_device(sc.init(config)), jnp.asarray(flags), jnp.asarray(norms, dtype=jnp.float32)
    )
    host = sc.init(config)
    for i, (flag, norm) in enumerate(zip(flags, norms, strict=True)):
        dev = jax.tree_util.tree_map(lambda x, i=i: x[i], traj)
        try:
            host = host_update(host, flag, norm)
        except sc.ScaleCollapseError:
            assert int(dev.failure) != 0
            return
        assert _fields(dev) == _host_fields(host), f"step {i}"


def test_a_spike_inside_jit_is_skipped_and_a_missing_norm_refused_at_trace_time() -> None:
    config = sc.ScalerConfig(spike_threshold=3.0, spike_window=4)
    state = to_device(sc.init(config))
    step = jax.jit(sc.update)
    for norm in (1.0, 1.25, 0.75, 1.0):
        state = step(state, jnp.asarray(False), jnp.float32(norm))
    spiked = step(state, jnp.asarray(False), jnp.float32(100.0))
    assert spiked.last_step is sc.StepKind.SPIKE_SKIP
    assert int(spiked.skipped_steps) == 1
    assert float(spiked.scale) == float(state.scale)
    assert int(spiked.growth_tracker) == int(state.growth_tracker)
    with pytest.raises(sc.InvalidArgumentError, match="grad_norm=None"):
        jax.jit(sc.update)(state, jnp.asarray(False))
    # A device norm with host flag and state moves the step onto the device.
    moved = sc.update(sc.init(config), False, grad_norm=jnp.float32(1.0))
    assert isinstance(moved.norm_mean, jax.Array)
    assert moved.to_host() == sc.update(sc.init(config), False, grad_norm=1.0)
    with pytest.raises(sc.GradientTypeError, match="grad_norm"):
        sc.update(sc.init(config), False, grad_norm=jnp.ones(2))


def test_collapse_inside_jit_is_recorded_and_raised_on_first_look() -> None:
    config = sc.ScalerConfig(init_scale=2.0**-125)
    state = to_device(sc.init(config))
    step = jax.jit(sc.update)
    once = step(state, jnp.asarray(True))  # 2**-126 is still normal
    assert once.current_scale() == 2.0**-126
    twice = step(once, jnp.asarray(True))  # 2**-127 is subnormal: collapse
    assert int(twice.failure) == int(sc.Failure.COLLAPSE)
    assert float(twice.scale) == 2.0**-126  # the last valid scale
    with pytest.raises(sc.ScaleCollapseError, match="device transition recorded"):
        twice.current_scale()
    frozen = step(twice, jnp.asarray(False))  # a failed state stays frozen
    assert _fields(frozen) == _fields(twice)
    # to_device moves a recorded failure along (as scaler_core.cupy.to_device does):
    # it reads nothing back, and the first host-side look still raises.
    moved = to_device(twice)
    assert int(moved.failure) == int(sc.Failure.COLLAPSE)
    with pytest.raises(sc.ScaleCollapseError, match="device transition recorded"):
        moved.check()
    with pytest.raises(sc.InvalidArgumentError, match="must be a ScalerState"):
        to_device({"scale": 1.0})  # type: ignore[arg-type]


@given(
    period=st.integers(1, 12),
    factor=st.sampled_from([2.0, 4.0]),
    init_exp=st.integers(-20, 30),
    min_exp=st.integers(-40, 0),
    flags=flag_sequences(max_size=FLAGS_LEN),
)
@settings(max_examples=12)
def test_trajectory_equals_jmp_dynamic_loss_scale(
    period: int, factor: float, init_exp: int, min_exp: int, flags: list
) -> None:
    jmp = pytest.importorskip("jmp", reason="jmp is the oracle here")
    flags = (flags + [False] * FLAGS_LEN)[:FLAGS_LEN]
    init_scale, min_scale = 2.0**init_exp, 2.0 ** min(min_exp, init_exp)
    config = sc.ScalerConfig(
        init_scale=init_scale,
        growth_factor=factor,
        backoff_factor=1.0 / factor,
        growth_interval=period,
        min_scale=min_scale,
    )
    theirs = jmp.DynamicLossScale(
        loss_scale=jnp.float32(init_scale),
        period=period,
        factor=factor,
        min_loss_scale=jnp.float32(min_scale),
    )
    ours = _scan(config)(to_device(sc.init(config)), jnp.asarray(flags))
    for i, flag in enumerate(flags):
        theirs = theirs.adjust(jnp.asarray(not flag))
        assert float(ours.scale[i]) == float(theirs.loss_scale), f"step {i}"
        assert int(ours.growth_tracker[i]) == int(theirs.counter), f"step {i}"


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("factor", [1 - 2.0**-24, 1 - 2.0**-23, 0.5])
def test_a_backoff_near_the_smallest_normal_equals_the_host_under_jit(
    k: int, factor: float
) -> None:
    """XLA flushes float32 subnormals to zero: a product that rounds up to FLT_MIN on the
    host must not be a recorded collapse on the device."""
    scale = float(np.float32(2.0**-126) + np.float32(k * 2.0**-149))
    state = sc.init(sc.ScalerConfig(init_scale=scale, backoff_factor=factor))
    try:
        host: Any = sc.update(state, True)
    except sc.ScaleCollapseError:
        host = None
    dev = jax.jit(sc.update)(to_device(state), jnp.asarray(True))
    if host is None:
        assert int(dev.failure) != 0
    else:
        assert int(dev.failure) == 0
        assert dev.to_host() == host


def test_a_static_scale_never_touches_the_trackers_under_jit() -> None:
    cfg = sc.ScalerConfig(dynamic=False, hysteresis=3, hysteresis_refill="on_clean_step")
    loaded = dataclasses.replace(sc.init(cfg), hysteresis_tracker=1)
    dev = jax.jit(sc.update)(to_device(loaded), jnp.asarray(False))
    assert dev.to_host() == sc.update(loaded, False)
    assert int(dev.hysteresis_tracker) == 1


def test_without_float64_a_factor_float32_cannot_hold_is_refused_with_the_fix() -> None:
    """JAX without jax_enable_x64 has no float64 to form PyTorch's product in."""
    from scaler_core.optax import with_loss_scaling

    cfg = sc.ScalerConfig(backoff_factor=0.9)
    assert not jax.config.read("jax_enable_x64")
    with pytest.raises(sc.InvalidConfigError, match=r"backoff_factor=0\.9, .*use 0\.899999976"):
        sc.update(to_device(sc.init(cfg)), jnp.asarray(True))
    optax = pytest.importorskip("optax")
    with pytest.raises(sc.InvalidConfigError, match=r"jax_enable_x64"):
        with_loss_scaling(optax.sgd(0.1), cfg)


def _collapsing_loop() -> tuple[Any, Any, Any]:
    """A jitted optax step, and its params and optimizer state two overflows from a
    collapse (2**-125 backs off to 2**-126, then to a subnormal: refused)."""
    optax = pytest.importorskip("optax", reason="the optax wrapper needs optax")
    from scaler_core.optax import current_scale, with_loss_scaling

    tx = with_loss_scaling(optax.adam(0.1), sc.ScalerConfig(init_scale=2.0**-125))
    params = {"w": jnp.ones(3)}

    @jax.jit
    def step(params: Any, opt_state: Any, bad: Any) -> Any:
        g = jnp.where(bad, jnp.inf, 1.0) * jnp.ones(3) * current_scale(opt_state)
        updates, opt_state = tx.update({"w": g}, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step, params, tx.init(params)


def test_after_a_recorded_collapse_with_loss_scaling_applies_nothing_and_says_so() -> None:
    """The collapse is recorded inside jit; every later step, finite gradients
    included, leaves the parameters and the optimizer state as they were, the state
    says so on the device, and the first host-side look raises."""
    from scaler_core.optax import current_scale

    step, params, opt_state = _collapsing_loop()
    params, opt_state = step(params, opt_state, jnp.asarray(False))  # a real step
    params, opt_state = step(params, opt_state, jnp.asarray(True))  # 2**-126
    params, opt_state = step(params, opt_state, jnp.asarray(True))  # collapse: recorded
    failed = opt_state.scaler.failure
    assert isinstance(failed, jax.Array)
    assert int(failed) == int(sc.Failure.COLLAPSE)
    before = [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves((params, opt_state))]
    for _ in range(3):  # finite gradients: nothing may move until the user acts
        params, opt_state = step(params, opt_state, jnp.asarray(False))
        assert bool(opt_state.skipped)  # a device bool a loop can log, no host sync
    after = [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves((params, opt_state))]
    assert after == before
    for look in (
        lambda: current_scale(opt_state),
        opt_state.scaler.check,
        opt_state.scaler.current_scale,
        lambda: sc.to_dict(opt_state.scaler),
    ):
        with pytest.raises(sc.ScaleCollapseError, match="device transition recorded"):
            look()


def test_the_functional_loop_skips_every_step_after_a_recorded_failure() -> None:
    """The loop docs/jax.md shows: update, then select on step_skipped(state)."""
    backend = sc.get_backend("jax")

    @jax.jit
    def step(params: Any, state: sc.ScalerState, bad: Any) -> Any:
        grads = {"w": jnp.where(bad, jnp.inf, 1.0) * jnp.ones(2) * state.scale}
        grads, found = sc.unscale(grads, state)
        state = sc.update(state, found)
        new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        return backend.select(sc.step_skipped(state, jnp), params, new), state

    params = {"w": jnp.ones(2)}
    state = to_device(sc.init(sc.ScalerConfig(init_scale=2.0**-125)))
    params, state = step(params, state, jnp.asarray(False))
    assert float(params["w"][0]) != 1.0
    for _ in range(2):
        params, state = step(params, state, jnp.asarray(True))
    moved = params
    params, state = step(params, state, jnp.asarray(False))
    assert int(state.failure) == int(sc.Failure.COLLAPSE)
    assert np.asarray(params["w"]).tobytes() == np.asarray(moved["w"]).tobytes()
    assert bool(sc.step_skipped(state, jnp))
    assert sc.step_skipped(state) is True


def _replicate(state: sc.ScalerState, n: int = 4) -> sc.ScalerState:
    """What pmap returns: every field with a leading replica axis."""
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), state)


def test_host_looks_read_a_replicated_state_and_refuse_replicas_that_disagree() -> None:
    state = to_device(sc.update(sc.init(), True))
    rep = _replicate(state)
    assert rep.current_scale() == 32768.0
    assert rep.check() is rep
    assert rep.to_host() == state.to_host()
    assert sc.to_dict(rep) == sc.to_dict(state)
    assert rep.last_step is sc.StepKind.BACKOFF
    failed = dataclasses.replace(rep, failure=jnp.full((4,), int(sc.Failure.SKIP_LIMIT)))
    for look in (failed.check, failed.current_scale, failed.to_host):
        with pytest.raises(sc.SkipLimitError, match="device transition recorded"):
            look()
    split = dataclasses.replace(rep, scale=rep.scale.at[2].set(1.0))
    for look in (split.current_scale, split.to_host, lambda: sc.to_dict(split)):
        with pytest.raises(sc.ReplicaMismatchError, match=r"scale.*replica 2") as info:
            look()
        assert info.value.differences["scale"][2] == 1.0
    half = dataclasses.replace(rep, failure=rep.failure.at[1].set(int(sc.Failure.COLLAPSE)))
    with pytest.raises(sc.ReplicaMismatchError, match="failure"):
        half.check()
