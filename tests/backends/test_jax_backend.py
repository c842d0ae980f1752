"""What only the JAX backend has: traced scales and flags under ``jit``, every kind of
pytree, equinox modules, no host sync, small and large leaves. The rules every backend
keeps are checked once, for every backend, in ``test_contract.py``."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX backend needs jax")
jnp = pytest.importorskip("jax.numpy", reason="the JAX backend needs jax")
ml_dtypes = pytest.importorskip("ml_dtypes")

import scaler_core as sc  # noqa: E402
from scaler_core import _ops  # noqa: E402
from scaler_core.backends._jax import BACKEND, to_device  # noqa: E402

NP = sc.get_backend("numpy")
DTYPES = ["float16", "bfloat16", "float32"]
# Scales whose inverse is not a power of two exercise the f32(1/f64(s)) rounding.
# Above 2**126 the inverse is a float32 subnormal, which XLA flushes to zero (docs/jax.md).
SCALES = [1.0, 3.0, 65536.0, 0.1, 2.0**-20, 12345.678, 2.0**100]


def _np_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _values(dtype: str, n: int = 64, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 1000).astype(np.float32)
    return x.astype(_np_dtype(dtype))


def _unscale(grads: Any, scale: Any) -> Any:
    return _ops.unscale(BACKEND, grads, scale)


_UNSCALE = jax.jit(_unscale)  # one compile per dtype, shared by every case


class Pair(NamedTuple):
    a: Any
    b: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    w: Any
    b: Any


def _bits(x: Any) -> np.ndarray:
    arr = np.asarray(x)
    return arr.view(np.dtype(f"u{arr.dtype.itemsize}"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", SCALES, ids=repr)
@pytest.mark.parametrize("poison", [None, np.nan, np.inf, -np.inf], ids=repr)
def test_unscale_under_jit_with_a_traced_scale_matches_numpy(
    dtype: str, scale: float, poison: Any
) -> None:
    host = _values(dtype)
    if poison is not None:
        host[7] = poison
    with np.errstate(all="ignore"):  # NumPy warns when float16 overflows; that is the point
        ref, ref_found = _ops.unscale(NP, [host.copy()], scale)
    out, found = _UNSCALE([jnp.asarray(host)], jnp.float32(scale))
    np.testing.assert_array_equal(_bits(out[0]), _bits(ref[0]))
    assert bool(found) == bool(ref_found)
    # A host scale takes the same path, validated on the host.
    out2, found2 = _unscale([jnp.asarray(host)], scale)
    np.testing.assert_array_equal(_bits(out2[0]), _bits(ref[0]))
    assert bool(found2) == bool(ref_found)


def test_pytrees_of_every_kind_with_none_leaves() -> None:
    grads = {
        "dict": {"x": jnp.full((2, 3), 4.0)},
        "list": [jnp.full(2, 8.0), None],
        "tuple": (jnp.asarray(16.0),),
        "named": Pair(jnp.full(1, 2.0), None),
        "dataclass": Layer(w=jnp.full((1, 1), 4.0, jnp.bfloat16), b=jnp.zeros((0,))),
    }
    out, found = jax.jit(sc.unscale)(grads, jnp.float32(2.0))
    assert not bool(found)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(grads)
    assert out["list"][1] is None
    assert out["named"].b is None
    assert out["dict"]["x"].tolist() == [[2.0] * 3] * 2
    assert out["named"].a.tolist() == [1.0]
    assert out["dataclass"].w.dtype == jnp.bfloat16
    assert float(out["dataclass"].w[0, 0]) == 2.0
    assert out["dataclass"].b.shape == (0,)
    assert float(out["tuple"][0]) == 8.0
    # The input is not modified (functional).
    assert grads["dict"]["x"].tolist() == [[4.0] * 3] * 2


def test_equinox_module_gradients() -> None:
    eqx = pytest.importorskip("equinox", reason="equinox pytrees need equinox")
    model = eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0))
    grads = jax.tree_util.tree_map(lambda x: x * 4.0, model)
    out, found = sc.unscale(grads, 4.0)
    assert not bool(found)
    np.testing.assert_allclose(np.asarray(out.weight), np.asarray(model.weight), rtol=0)
    bad = eqx.tree_at(lambda m: m.bias, grads, grads.bias.at[1].set(jnp.nan))
    assert bool(sc.find_non_finite(bad))


def test_backend_is_picked_from_jax_arrays_and_tracers() -> None:
    assert sc.backend_for([jnp.ones(2)]).name == "jax"

    @jax.jit
    def name_inside(x: Any) -> Any:
        assert sc.backend_for([x]) is BACKEND
        return x

    name_inside(jnp.ones(2))


def test_numpy_and_jax_reject_the_same_dtypes_with_one_message() -> None:
    with pytest.raises(sc.GradientTypeError) as np_err:
        _ops.unscale(NP, [np.ones(2, np.int32)], 2.0)
    with pytest.raises(sc.GradientTypeError) as jax_err:
        _unscale([jnp.ones(2, jnp.int32)], 2.0)
    assert str(np_err.value).split(";")[0] == str(jax_err.value).split(";")[0]


def test_device_scale_must_be_a_0d_float() -> None:
    with pytest.raises(sc.GradientValueError, match="0-d float"):
        _unscale([jnp.ones(2)], jnp.ones(2))
    with pytest.raises(sc.GradientValueError, match="0-d float"):
        _unscale([jnp.ones(2)], jnp.asarray(2))


def test_select_under_jit_keeps_nan_payloads_and_negative_zero() -> None:
    old = {"w": jnp.asarray([-0.0, jnp.nan, 1.0]), "n": jnp.asarray(3, jnp.int32)}
    new = {"w": jnp.asarray([1.0, 2.0, 3.0]), "n": jnp.asarray(4, jnp.int32)}
    sel = jax.jit(BACKEND.select)
    kept = sel(jnp.asarray(True), old, new)
    np.testing.assert_array_equal(_bits(kept["w"]), _bits(old["w"]))
    assert int(kept["n"]) == 3
    stepped = sel(jnp.asarray(False), old, new)
    assert stepped["w"].tolist() == [1.0, 2.0, 3.0]
    assert int(stepped["n"]) == 4


def test_flags_under_jit_and_a_traced_flag_cannot_be_read() -> None:
    t, f = jnp.asarray(True), jnp.asarray(False)
    assert bool(jax.jit(BACKEND.any)(f, t))
    with pytest.raises(sc.GradientTypeError, match="found="):
        BACKEND.to_bool(jnp.asarray(1.0))
    with pytest.raises(sc.GradientTypeError, match=r"flags\[1\]"):
        BACKEND.any(t, 1)

    @jax.jit
    def read_inside(found: Any) -> Any:
        BACKEND.to_bool(found)
        return found

    with pytest.raises(sc.GradientTypeError, match="traced"):
        read_inside(t)


def _train_step(params: Any, grads: Any, state: sc.ScalerState) -> tuple[Any, sc.ScalerState]:
    grads, found = sc.unscale(grads, state)
    stepped = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    return BACKEND.select(found, params, stepped), sc.update(state, found)


def test_whole_step_runs_without_host_sync_and_traces_once() -> None:
    traces = []

    def step(params: Any, grads: Any, state: sc.ScalerState) -> Any:
        traces.append(1)
        return _train_step(params, grads, state)

    jitted = jax.jit(step)
    params = {"w": jnp.ones(4), "b": jnp.zeros(2, jnp.bfloat16)}
    clean = {"w": jnp.full(4, 65536.0), "b": jnp.full(2, 65536.0, jnp.bfloat16)}
    dirty = {"w": clean["w"].at[2].set(jnp.inf), "b": clean["b"]}
    state = to_device(sc.init())
    jax.block_until_ready((params, clean, dirty, state))
    with jax.transfer_guard("disallow"):
        p1, s1 = jitted(params, clean, state)
        p2, s2 = jitted(p1, dirty, s1)
        p3, s3 = jitted(p2, clean, s2)
        jax.block_until_ready((p3, s3))
    assert len(traces) == 1, "jit must trace once for both flag values"
    assert s3.to_host() == sc.ScalerState(
        sc.ScalerConfig(), 32768.0, 1, 1, 3, 1, 0, 0, last_kind=sc.StepKind.COUNT.code
    )
    np.testing.assert_array_equal(np.asarray(p2["w"]), np.asarray(p1["w"]))
    np.testing.assert_allclose(np.asarray(p1["w"]), 0.9, rtol=1e-6)


def test_update_dispatches_to_device_for_jax_flags_and_states() -> None:
    host = sc.init(sc.ScalerConfig(growth_interval=1))
    dev = sc.update(host, jnp.asarray(False))
    assert not dev.on_host
    assert dev.scale.dtype == jnp.float32
    assert dev.current_scale() == 131072.0
    again = sc.update(dev, False)  # a host flag on a device state stays on the device
    assert not again.on_host
    assert again.current_scale() == 262144.0
    with pytest.raises(sc.GradientTypeError, match="found_non_finite"):
        BACKEND.update(host, jnp.asarray(1))


def test_import_scaler_core_never_imports_jax(tmp_path: Any) -> None:
    import subprocess
    import sys

    code = (
        "import sys, numpy as np, scaler_core as sc\n"
        "s = sc.update(sc.init(), sc.unscale([np.ones(2, np.float32)], 2.0)[1])\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


def test_state_built_before_backend_use_can_be_jitted(tmp_path: Any) -> None:
    import subprocess
    import sys

    code = (
        "import scaler_core as sc\n"
        "import jax\n"
        "s = sc.init()\n"  # built by the core only: no backend call has loaded _jax yet
        "out = jax.jit(lambda s: s)(s)\n"
        "assert out.config == s.config and float(out.scale) == 65536.0\n"
        "assert 'scaler_core.backends._jax' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", "import sys\n" + code], check=True, cwd=tmp_path)


@pytest.mark.parametrize("where", ["big", "small16", "small32", "none"])
def test_detection_over_small_and_large_leaves(where: str) -> None:
    from scaler_core.backends._jax import SMALL_LEAF

    big = np.ones(SMALL_LEAF + 5, np.float32)
    s16 = np.ones(7, np.float16)
    s32 = np.ones((3, 2), np.float32)
    if where == "big":
        big[-1] = np.inf
    elif where == "small16":
        s16[3] = 40000.0  # finite as given; overflows float16 once unscaled by 2
    elif where == "small32":
        s32[2, 1] = np.nan
    grads = {"big": jnp.asarray(big), "s16": jnp.asarray(s16), "s32": [jnp.asarray(s32)]}
    out, found = _UNSCALE(grads, jnp.float32(0.5))
    with np.errstate(all="ignore"):
        # Copies: on the CPU jnp.asarray may share memory with the NumPy array, and the
        # jitted call may still be running while the in-place reference writes.
        ref_grads = {"big": big.copy(), "s16": s16.copy(), "s32": [s32.copy()]}
        ref, ref_found = _ops.unscale(NP, ref_grads, 0.5)
    assert bool(found) == bool(ref_found) == (where != "none")
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    assert bool(_ops.find_non_finite(BACKEND, grads)) == (where in ("big", "small32"))


def test_reduce_found_ors_over_a_named_axis_and_facade_works_eagerly() -> None:
    from scaler_core.jax import found_reducer, reduce_found

    flags = jnp.asarray([False, False, True, False])
    out = jax.vmap(lambda f: reduce_found(f, "i"), axis_name="i")(flags)
    assert out.tolist() == [True] * 4
    none = jax.vmap(found_reducer("i"), axis_name="i")(jnp.zeros(4, bool))
    assert none.tolist() == [False] * 4
    with pytest.raises(sc.InvalidArgumentError, match="axis_name=None"):
        found_reducer(None)

    scaler = sc.LossScaler(sc.ScalerConfig(growth_interval=1))
    grads = scaler.unscale({"w": jnp.asarray([65536.0, 2.0])})
    assert grads["w"].tolist()[0] == 1.0
    assert scaler.should_skip_step() is False
    scaler.update()
    scaler.unscale({"w": jnp.asarray([jnp.inf])})
    assert scaler.should_skip_step() is True
    scaler.update()
    assert sc.to_dict(scaler.state)["state"]["skipped_steps"] == 1
    assert scaler.current_scale() == 65536.0


@pytest.mark.parametrize("bad", [-2.0, 0.0, float("inf"), float("nan"), 1e-40])
def test_a_bad_device_scale_is_refused_or_fails_closed(bad: float) -> None:
    """A concrete device scale is validated like a host one (a sign flip, 0, inf, NaN or a
    subnormal is refused); under jit, where it has no value yet, the step fails closed:
    the flag is set and the next update records a collapse instead of training on."""
    scale = jnp.asarray(bad, jnp.float32)
    grads = {"w": jnp.ones(3)}
    with pytest.raises(sc.GradientValueError, match="scale="):
        _unscale(grads, scale)
    with pytest.raises(sc.GradientValueError, match="scale="):
        BACKEND.scale_loss(jnp.ones(()), scale)
    out, found = _UNSCALE(grads, scale)
    assert bool(found)
    assert not np.isfinite(np.asarray(out["w"])).any()
    assert not np.isfinite(float(jax.jit(BACKEND.scale_loss)(jnp.ones(()), scale)))


def test_clip_decides_on_the_device_and_a_skip_returns_the_given_leaves() -> None:
    """The clip pass selects on the traced decision (one trace for both values, no
    host transfer): a skipped step gives the gradients as given, bit for bit; a step,
    the unscaled values times the coefficient of the measured norm."""
    from scaler_core.backends._numpy_reference import clip_in_place, unscaled_copy

    host = {"h": np.asarray([3e4, -2e4, 1.0, 0.5], np.float16), "f": _values("float32", 9)}
    grads = jax.tree_util.tree_map(jnp.asarray, host)
    traces = []

    @jax.jit
    def clip(g: Any, scale: Any, other: Any) -> Any:
        traces.append(1)
        return _ops.unscale_and_clip(BACKEND, g, scale, 1.0, lambda found: found | other)

    scale, true, false = jnp.float32(1024.0), jnp.asarray(True), jnp.asarray(False)
    jax.block_until_ready((grads, scale, true, false))
    with jax.transfer_guard("disallow"):
        skipped = clip(grads, scale, true)
        stepped = clip(grads, scale, false)
    assert len(traces) == 1
    out, found, norm = skipped
    assert bool(found)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(grads), strict=True):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    out, found, norm = stepped
    assert not bool(found)
    np.testing.assert_array_equal(_bits(norm), _bits(skipped[2]))
    coef = _ops.clip_coefficient(np, np.float32(norm), 1.0)
    assert coef < 1.0
    for key, g in host.items():
        want = g.copy()
        clip_in_place(want, unscaled_copy(g, 1.0 / 1024.0), coef)
        np.testing.assert_array_equal(_bits(out[key]), _bits(want))


def test_the_passes_return_the_given_tree_where_they_compute_no_new_one() -> None:
    grads = {"w": jnp.asarray([2.0, jnp.inf])}
    prepared = BACKEND.plan(grads, writable=False)
    same, found = BACKEND.unscale(prepared, None)  # detection alone
    assert same is grads
    assert bool(found)
    same, found, norm = BACKEND.measure(prepared, 2.0, write=False)
    assert same is grads
    assert bool(found)
    assert not np.isfinite(float(norm))
    new, found, _ = BACKEND.measure(prepared, 2.0, write=True)
    assert new is not grads
    assert new["w"].tolist() == [1.0, float("inf")]
    assert grads["w"].tolist() == [2.0, float("inf")]  # functional: nothing modified


def test_an_eager_clip_unscales_each_leaf_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The clip pass takes the measuring pass's unscaled leaves: outside ``jit``
    nothing merges the two, so the leaves are unscaled once (one inverse scale made)."""
    from scaler_core.backends import _jax

    calls: list[int] = []
    inv_scale = _jax._inv_scale
    monkeypatch.setattr(_jax, "_inv_scale", lambda s: calls.append(1) or inv_scale(s))
    grads = {"a": jnp.full(5, 64.0, jnp.float32), "b": jnp.full(3, 128.0, jnp.float16)}
    out, found, norm = sc.unscale_and_clip(grads, 64.0, 1.0)
    assert len(calls) == 1
    assert not bool(found)
    assert float(norm) == pytest.approx(float(np.sqrt(5 * 1.0 + 3 * 4.0)), rel=1e-6)
    assert float(out["a"][0]) < 1.0  # clipped
