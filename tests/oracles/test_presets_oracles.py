"""Each preset against the real package, step by step on random flag sequences.

PyTorch (``torch._amp_update_scale_``), jmp (``jmp.DynamicLossScale``), flax
(``flax.training.dynamic_scale.DynamicScale``) and Keras 3
(``keras.optimizers.LossScaleOptimizer``, in a subprocess with the NumPy backend)
are imported only here and skipped cleanly when missing. Where an anchor carries
on with a scale that is no longer a normal float32 (0, subnormal, inf), the
preset must have refused that step instead; the comparison ends there.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core._f32 import FLT_MAX, FLT_MIN
from scaler_core.testing import flag_sequences, scales


def _ours(config: sc.ScalerConfig, flags: list[bool]) -> tuple[list[float], list[int], int | None]:
    """Our scale and growth tracker after each step, and the step we refused (if any)."""
    state = sc.init(config)
    out_scale, out_tracker = [], []
    for i, flag in enumerate(flags):
        try:
            state = sc.update(state, flag)
        except sc.ScaleCollapseError:
            return out_scale, out_tracker, i
        out_scale.append(state.scale)
        out_tracker.append(state.growth_tracker)
    return out_scale, out_tracker, None


def _compare(
    name: str,
    config: sc.ScalerConfig,
    flags: list[bool],
    anchor_scales: list[float],
    anchor_trackers: list[int] | None = None,
) -> None:
    """Equal step by step until the anchor's scale stops being a normal float32.

    From that step on the anchor is broken (inf after an unchecked growth, 0 or
    subnormal after a backoff); there the preset must have blocked the growth
    (scale unchanged) or refused the step.
    """
    ours, trackers, refused = _ours(config, flags)
    broken = next(
        (i for i, x in enumerate(anchor_scales) if not FLT_MIN <= x <= FLT_MAX), len(flags)
    )
    n = min(len(ours), broken)
    assert anchor_scales[:n] == ours[:n], f"{name}: scales differ for flags={flags}"
    if anchor_trackers is not None:
        assert anchor_trackers[:n] == trackers[:n], f"{name}: trackers differ for flags={flags}"
    if broken < len(flags):
        bad = anchor_scales[broken]
        before = ours[broken - 1] if broken else config.init_scale
        blocked = refused is None or refused > broken
        assert refused == broken or (blocked and ours[broken] == before), (
            f"{name}: the anchor's scale became {bad!r} at step {broken}; we neither "
            f"refused that step nor kept the scale (flags={flags})"
        )
    else:
        assert refused is None, f"{name}: we refused step {refused}, the anchor did not break"


# Scales near both ends of float32 so floors, ceilings and collapses are reached.
_INIT = st.one_of(
    st.sampled_from([1.0, 2.0**15, 2.0**16, 2.0**-124, 2.0**126, 3.0 * 2.0**125]), scales()
)


@pytest.mark.torch
@given(_INIT, st.integers(1, 6), flag_sequences(max_size=150))
@settings(max_examples=60)
def test_torch_preset_equals_amp_update_scale(
    init: float, interval: int, flags: list[bool]
) -> None:
    torch = pytest.importorskip("torch", reason="PyTorch is an optional oracle")
    scale = torch.full((1,), init, dtype=torch.float32)
    tracker = torch.zeros((1,), dtype=torch.int32)
    got, trackers = [], []
    for flag in flags:
        found = torch.full((1,), float(flag), dtype=torch.float32)
        torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, interval)
        got.append(float(scale.item()))
        trackers.append(int(tracker.item()))
    config = sc.preset("torch", init_scale=init, growth_interval=interval)
    _compare("torch", config, flags, got, trackers)


_PAD = 160  # one trace length, so each static config compiles once
_RUNNERS: dict[tuple[Any, ...], Any] = {}


def _scan(key: tuple[Any, ...], make_step: Any, carry: Any, flags: list[bool]) -> Any:
    """Run ``step`` over ``flags`` in one compiled scan, cached per static ``key``."""
    jax = pytest.importorskip("jax", reason="JAX is an optional oracle")
    import jax.numpy as jnp

    if key not in _RUNNERS:
        step = make_step()
        _RUNNERS[key] = jax.jit(lambda c, fs: jax.lax.scan(step, c, fs)[1])
    padded = jnp.asarray(flags + [False] * (_PAD - len(flags)), dtype=bool)
    return [np.asarray(x)[: len(flags)] for x in _RUNNERS[key](carry, padded)]


@given(_INIT, st.integers(1, 6), st.data(), flag_sequences(min_size=1, max_size=150))
@settings(max_examples=30)
def test_jmp_preset_equals_dynamic_loss_scale(
    init: float, period: int, data: st.DataObject, flags: list[bool]
) -> None:
    jmp = pytest.importorskip("jmp", reason="jmp is an optional oracle")
    import jax.numpy as jnp

    floor = data.draw(st.one_of(st.just(1.0), scales(max_value=init)), label="min_loss_scale")
    floor = min(floor, init)

    def make_step() -> Any:
        # jmp's pytree flattening drops min_loss_scale (it comes back as 1.0), so
        # the carry holds only the arrays and the floor is closed over.
        def step(carry: Any, found: Any) -> Any:
            scale, counter, low = carry
            ls = jmp.DynamicLossScale(
                loss_scale=scale, counter=counter, period=period, factor=2, min_loss_scale=low
            ).adjust(~found)
            return (ls.loss_scale, ls.counter, low), (ls.loss_scale, ls.counter)

        return step

    start = (jnp.float32(init), jnp.int32(0), jnp.float32(floor))
    got, counters = _scan(("jmp", period), make_step, start, flags)
    config = sc.preset("jmp", loss_scale=init, period=period, min_loss_scale=floor)
    _compare("jmp", config, flags, [float(x) for x in got], [int(c) for c in counters])


@given(_INIT, st.integers(1, 6), st.booleans(), flag_sequences(min_size=1, max_size=150))
@settings(max_examples=30)
def test_flax_preset_equals_dynamic_scale(
    init: float, interval: int, floor: bool, flags: list[bool]
) -> None:
    pytest.importorskip("flax", reason="flax is an optional oracle")
    import jax.numpy as jnp
    from flax.training.dynamic_scale import DynamicScale

    minimum = float(jnp.finfo(jnp.float32).tiny) if floor else None

    def loss(p: Any, g: Any) -> Any:
        return jnp.sum(p * g)

    def make_step() -> Any:
        def step(ds: Any, found: Any) -> Any:
            g = jnp.where(found, jnp.inf, 1.0)
            ds, _, _, _ = ds.value_and_grad(loss)(jnp.ones(()), g)
            return ds, (ds.scale, ds.fin_steps)

        return step

    start = DynamicScale(
        growth_interval=interval,
        fin_steps=jnp.int32(0),
        scale=jnp.float32(init),
        minimum_scale=minimum,
    )
    got, fin_steps = _scan(("flax", interval, minimum), make_step, start, flags)
    config = sc.preset("flax", growth_interval=interval, scale=init, minimum_scale=minimum)
    # flax's fin_steps is our growth_tracker: both count clean steps since the last change.
    _compare("flax", config, flags, [float(x) for x in got], [int(c) for c in fin_steps])


_KERAS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import keras

    cases = json.load(sys.stdin)
    out = []
    for init, steps, flags in cases:
        opt = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.0), initial_scale=init, dynamic_growth_steps=steps
        )
        v = keras.Variable(np.zeros(1, np.float32))
        opt.build([v])
        ok, bad = [np.ones(1, np.float32)], [np.full(1, np.inf, np.float32)]
        traj = []
        with np.errstate(all="ignore"):
            for f in flags:
                opt.apply(bad if f else ok, [v])
                traj.append([float(np.asarray(opt.dynamic_scale.value)),
                             int(np.asarray(opt.step_counter.value))])
        out.append(traj)
    json.dump(out, sys.stdout)
    """
)


def _keras_cases(n: int, seed: int = 7) -> list[tuple[float, int, list[bool]]]:
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(n):
        init = float(rng.choice([2.0**15, 2.0**-120, 2.0**124, 1.0, 3.0 * 2.0**100]))
        steps = int(rng.integers(1, 6))
        flags: list[bool] = []
        while len(flags) < 100:  # bursts: runs of clean steps and of overflows
            flags += [bool(rng.random() < 0.4)] * int(rng.integers(1, 12))
        cases.append((init, steps, flags[:100]))
    return cases


def test_keras_preset_equals_loss_scale_optimizer(run_python: Callable[..., str]) -> None:
    if importlib.util.find_spec("keras") is None:
        pytest.skip("Keras 3 is an optional oracle")
    cases = _keras_cases(12)
    out = run_python(_KERAS_SCRIPT, env={"KERAS_BACKEND": "numpy"}, stdin=json.dumps(cases))
    results = json.loads(out)
    broken = 0
    for (init, steps, flags), traj in zip(cases, results, strict=True):
        config = sc.preset("keras", initial_scale=init, dynamic_growth_steps=steps)
        got = [s for s, _ in traj]
        _compare("keras", config, flags, got, [c for _, c in traj])
        broken += any(not FLT_MIN <= x <= FLT_MAX for x in got)
    # The cases must reach Keras's unchecked growth to inf and decay to 0.
    assert broken >= 2, "too few cases reach the float32 limits; widen the cases"


# ------------------------------------------------------------- flax's gradients
_FLAX_GRADS: dict[str, Any] = {}


def _flax_unscale(scaled: Any, scale: float) -> tuple[Any, bool]:
    """``DynamicScale.value_and_grad``'s gradient and ``finite`` when backpropagation
    produces exactly ``scaled`` (a custom VJP injects it), at ``scale``."""
    jax = pytest.importorskip("jax", reason="flax is an optional oracle")
    pytest.importorskip("flax", reason="flax is an optional oracle")
    import jax.numpy as jnp
    from flax.training.dynamic_scale import DynamicScale

    if "run" not in _FLAX_GRADS:

        @jax.custom_vjp
        def inject(p: Any, g: Any) -> Any:
            return jnp.sum(p, dtype=jnp.float32)

        def fwd(p: Any, g: Any) -> Any:
            return inject(p, g), g

        def bwd(g: Any, _: Any) -> Any:
            return g, jnp.zeros_like(g)  # the gradient is g, whatever the scale

        inject.defvjp(fwd, bwd)

        def run(s: Any, g: Any) -> Any:
            ds = DynamicScale(scale=s)
            _, finite, _, grad = ds.value_and_grad(inject)(jnp.zeros_like(g), g)
            return grad, finite

        _FLAX_GRADS["run"] = jax.jit(run)
    grad, finite = _FLAX_GRADS["run"](jnp.float32(scale), scaled)
    return grad, bool(finite)


def _our_unscale(scaled: Any, scale: float) -> tuple[np.ndarray, bool]:
    out, found = sc.unscale({"g": scaled}, scale)
    return np.asarray(out["g"]), bool(found)


def _bits(a: Any) -> bytes:
    return np.asarray(a).tobytes()


@pytest.mark.skipif(
    importlib.util.find_spec("flax") is None, reason="flax (and JAX) is an optional oracle"
)
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    scale=st.one_of(st.integers(-12, 40).map(lambda e: 2.0**e), scales(max_value=2.0**60)),
    seed=st.integers(0, 2**32 - 1),
    bad=st.sampled_from([None, "inf", "nan", "huge"]),
)
@settings(max_examples=40, deadline=None)
def test_flax_gradients_are_ours_in_float32_and_ours_are_theirs_rounded(
    dtype: str, scale: float, seed: int, bad: str | None
) -> None:
    """The differences PRESETS['flax'] states are the only ones. Unscaling the
    gradients cast to float32 gives flax's gradients and flag bit for bit, at every
    scale; unscaling them in their own dtype gives flax's rounded to that dtype,
    and the flag checks that rounded value."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    # Magnitudes from far below float16's subnormals to above its largest value.
    values = rng.standard_normal(256) * 2.0 ** rng.integers(-30, 20, 256).astype(np.float64)
    if bad == "inf":
        values[7] = np.inf
    elif bad == "nan":
        values[7] = np.nan
    elif bad == "huge":
        values[7] = 60000.0
    scaled = jnp.asarray(values.astype(np.float32)).astype(dtype)  # what backward gave
    theirs, finite = _flax_unscale(scaled, scale)
    assert theirs.dtype == jnp.float32  # flax returns float32 whatever the dtype
    as_f32, found32 = _our_unscale(scaled.astype(jnp.float32), scale)
    assert _bits(as_f32) == _bits(theirs)
    assert found32 is not finite
    native, found = _our_unscale(scaled, scale)
    assert native.dtype == np.dtype(scaled.dtype)
    rounded = theirs.astype(dtype)
    assert _bits(native) == _bits(rounded)
    assert found is not bool(jnp.all(jnp.isfinite(rounded)))


@pytest.mark.skipif(
    importlib.util.find_spec("flax") is None, reason="flax (and JAX) is an optional oracle"
)
def test_flax_divides_and_xla_multiplies_by_the_rounded_inverse() -> None:
    """flax's source divides by the scale; XLA compiles a division by a scalar into
    a multiply by its reciprocal, which is our f32(1/f64(scale)): equal at scales
    where a true division differs by one ulp (flax's clamp at float32 max leaves
    such a scale)."""
    import jax.numpy as jnp

    for scale in (3.0, 65536.0 * 1.5, FLT_MAX):
        g = np.linspace(1.0, 2.0, 4096, dtype=np.float32) * np.float32(min(scale, 2.0**100))
        theirs, _ = _flax_unscale(jnp.asarray(g), scale)
        ours, _ = _our_unscale(jnp.asarray(g), scale)
        assert _bits(ours) == _bits(theirs), scale
        if scale != FLT_MAX:  # (at FLT_MAX both flush every quotient to 0)
            assert _bits(g / np.float32(scale)) != _bits(theirs), scale


def test_flax_preset_states_the_gradient_differences() -> None:
    """PRESETS['flax'] said it differed in nothing; its gradients' dtype does."""
    text = sc.PRESETS["flax"].differences
    for claim in ("divides", "f32(1/f64(scale))", "float32", "float16", "float64"):
        assert claim in text, claim


_FLAX_X64 = textwrap.dedent(
    """
    import jax, numpy as np
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from flax.training.dynamic_scale import DynamicScale
    import scaler_core as sc

    g = np.random.default_rng(0).standard_normal(1000)
    _, _, _, theirs = DynamicScale(scale=jnp.float32(1024.0)).value_and_grad(
        lambda p: jnp.sum(p * jnp.asarray(g)))(jnp.zeros(1000))
    scaled = jnp.asarray(g) * 1024.0  # what flax's backward pass gave (exact)
    ours, _ = sc.unscale({"g": scaled}, 1024.0)
    ours32, _ = sc.unscale({"g": scaled.astype(jnp.float32)}, 1024.0)
    assert theirs.dtype == jnp.float32 and ours["g"].dtype == jnp.float64
    assert np.asarray(ours32["g"]).tobytes() == np.asarray(theirs).tobytes()
    assert np.array_equal(np.asarray(ours["g"]), g)
    print("OK")
    """
)


def test_flax_casts_float64_gradients_to_float32_and_we_keep_them(
    run_python: Callable[..., str],
) -> None:
    """With jax_enable_x64 (a subprocess: the flag is global), flax's gradients of a
    float64 model are float32; ours stay float64, and cast first they are flax's."""
    if importlib.util.find_spec("flax") is None:
        pytest.skip("flax is an optional oracle")
    assert run_python(_FLAX_X64, env={"JAX_PLATFORMS": "cpu"}).strip() == "OK"
