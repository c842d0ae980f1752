"""The MLX backend and scaler_core.mlx: the contract, the compiled passes, the device
transition against the host one, the skipped step inside ``mx.compile``, and a float16
training run that scaling saves."""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

mx = pytest.importorskip("mlx.core", reason="the MLX backend needs mlx")
nn = pytest.importorskip("mlx.nn", reason="the MLX backend needs mlx")
optim = pytest.importorskip("mlx.optimizers", reason="the MLX backend needs mlx")

from common_floats import DTYPES, bits  # noqa: E402
from common_transitions import host_run  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import scaler_core as sc  # noqa: E402
from scaler_core._state import DATA_FIELDS, FLOAT_FIELDS, host_update  # noqa: E402
from scaler_core.backends import _mlx  # noqa: E402
from scaler_core.mlx import (  # noqa: E402
    StateCell,
    optimizer_update,
    scaled_value_and_grad,
    to_device,
)
from scaler_core.testing import (  # noqa: E402
    BACKEND_CHECKS,
    check_backend,
    configs,
    flag_sequences,
    norm_sequences,
)
from scaler_core.testing._conversions import mlx_conversions  # noqa: E402

FLAGS_LEN = 48


#: NumPy to MLX and back, dtype for dtype: the contract suite's own conversions.
to_mlx, to_numpy = mlx_conversions()


def f32_bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def unscaled(host: np.ndarray, scale: float) -> np.ndarray:
    """The rules' unscaled values: float16/bfloat16 in float32, float64 in float64."""
    inv = np.float32(1.0) / np.float32(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        if host.dtype == np.float64:
            return host * np.float64(inv)
        return (host.astype(np.float32) * inv).astype(host.dtype)


# --------------------------------------------------------------------- the contract
@pytest.mark.parametrize("check", list(BACKEND_CHECKS))
def test_the_mlx_backend_keeps_the_contract(check: str) -> None:
    assert check_backend("mlx", asarray=to_mlx, to_numpy=to_numpy, only=[check]) == [check]


def test_the_contract_runs_on_every_dtype() -> None:
    """The conversions round-trip all four dtypes, so no check skips float64 or bfloat16."""
    for dtype in DTYPES:
        back = to_numpy(to_mlx(np.arange(3).astype(dtype)))
        assert back.dtype == dtype
        assert np.array_equal(bits(back), bits(np.arange(3).astype(dtype)))


class _InputDetection(_mlx.MlxBackend):
    """Flags the gradients as given, not as stored after unscaling: an overflow the
    unscale itself makes (a scale below 1) goes unseen."""

    def unscale(self, leaves: Any, scale: Any) -> Any:
        grads, _ = super().unscale(leaves, scale)
        return grads, super().unscale(leaves, None)[1]


class _FloatIsBool(_mlx.MlxNamespace):
    """isdtype calls a float a bool: a norm would pass for a flag."""

    @staticmethod
    def isdtype(dtype: Any, kind: str) -> bool:
        return _mlx.MlxNamespace.isdtype(dtype, kind) or _mlx.MlxNamespace.isdtype(
            dtype, "real floating"
        )


class _BrokenNamespace(_mlx.MlxBackend):
    def namespace(self, *values: Any) -> Any:
        return _FloatIsBool()


@pytest.mark.parametrize(
    ("broken", "check"),
    [(_InputDetection, "unscale_values"), (_BrokenNamespace, "namespace")],
    ids=["input-detection", "float-is-bool"],
)
def test_the_contract_catches_a_broken_mlx_backend(broken: type, check: str) -> None:
    with pytest.raises(sc.BackendContractError, match=rf"'{check}' failed for backend 'mlx'"):
        check_backend(broken(), asarray=to_mlx, to_numpy=to_numpy)


def test_the_namespace_answers_as_the_core_asks() -> None:
    xp = sc.get_backend("mlx").namespace()
    assert xp.on_host is False
    assert xp.float64_missing is None  # the CPU has float64
    assert xp.float32(0.1).dtype == mx.float32
    assert xp.float32(0.1).item() == float(np.float32(0.1))
    assert xp.float64(0.1).item() == 0.1
    assert xp.isdtype(mx.bool_, "bool") is True
    assert xp.isdtype(mx.bfloat16, "real floating") is True
    assert xp.isdtype(mx.int32, "real floating") is False
    assert xp.isdtype(np.dtype(np.float32), "real floating") is False  # not an MLX dtype
    nan = np.array([np.nan], np.float32)
    bits(nan)[0] = 0x7FC01234  # a NaN with a payload
    chosen = xp.where(xp.flag(True), to_mlx(nan), mx.array([1.0]))
    assert bits(to_numpy(chosen))[0] == 0x7FC01234


# ------------------------------------------------------------ the compiled passes
def _big_tree(dtype: np.dtype[Any], seed: int) -> list[np.ndarray]:
    """Leaves of every size class the passes treat apart: cut into several pieces (with a
    tail to join and a tail of its own), joined with others, a 0-d one, an empty one."""
    rng = np.random.default_rng(seed)
    piece, join = _mlx.PIECE, _mlx.JOIN
    sizes = (2 * piece + 13, piece + join + 3, join - 1, 5, join + 7, 1)
    leaves = [(rng.standard_normal(n) * 512).astype(dtype) for n in sizes]
    leaves += [np.array(3.0 * 512, dtype), np.zeros((0, 4), dtype)]
    return leaves


def _exactly_rounded_norm(arrays: list[np.ndarray]) -> float:
    total = math.fsum(float(v) ** 2 for a in arrays for v in a.astype(np.float64).ravel())
    return float(np.float32(math.sqrt(total)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_trees_give_the_rules_bits_and_a_norm_within_one_ulp(dtype: np.dtype[Any]) -> None:
    hosts = _big_tree(dtype, seed=1)
    hosts.append((np.random.default_rng(2).standard_normal((300, 700)) * 512).astype(dtype))
    leaves = [to_mlx(h) for h in hosts]
    leaves[-1], hosts[-1] = leaves[-1][:, ::3], hosts[-1][:, ::3]  # a strided leaf
    want = [unscaled(h, 512.0) for h in hosts]
    out, found, norm = sc.unscale_and_norm(leaves, 512.0)
    for got, w in zip(out, want, strict=True):
        assert np.array_equal(bits(to_numpy(got)), bits(w))
    assert found.item() is False
    exact = _exactly_rounded_norm(want)
    assert abs(f32_bits(norm.item()) - f32_bits(exact)) <= 1, (norm.item(), exact)
    _, found, measured = sc.get_backend("mlx").measure(
        sc.get_backend("mlx").plan(leaves, writable=False), 512.0, write=False
    )
    assert measured.item() == norm.item()
    assert found.item() is False


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("leaf", [0, 1, 2, 3, 4, 6], ids=lambda i: f"leaf{i}")
@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_value_anywhere_is_flagged_by_every_pass(
    dtype: np.dtype[Any], leaf: int, special: float
) -> None:
    hosts = _big_tree(dtype, seed=3)
    flat = hosts[leaf].reshape(-1)
    flat[-1 if leaf != 6 else 0] = special  # the last element: a tail, or a joined leaf
    leaves = [to_mlx(h) for h in hosts]
    _, found = sc.unscale(leaves, 512.0)
    _, found_norm, norm = sc.unscale_and_norm(leaves, 512.0)
    out, found_clip, _ = sc.unscale_and_clip(leaves, 512.0, 1.0)
    assert found.item()
    assert found_norm.item()
    assert found_clip.item()
    assert sc.find_non_finite(leaves).item()
    assert not math.isfinite(norm.item())
    for got, host in zip(out, hosts, strict=True):  # a skipped clip keeps the given values
        assert np.array_equal(bits(to_numpy(got)), bits(host))


def test_an_overflow_of_the_unscale_itself_is_flagged() -> None:
    """The flag is taken on the values as stored: float16's largest value, unscaled by a
    scale below one, is inf."""
    host = np.full(3 * _mlx.PIECE, 1.0, np.float16)
    host[-1] = np.float16(65504.0)
    leaves = [to_mlx(host)]
    assert not sc.find_non_finite(leaves).item()
    assert sc.unscale(leaves, 0.5)[1].item()
    assert sc.unscale_and_norm(leaves, 0.5)[1].item()


def test_large_finite_float64_values_are_not_flagged_though_their_squares_overflow() -> None:
    host = np.array([1e200, -1e200, 3.0], np.float64)
    _, found, norm = sc.unscale_and_norm([to_mlx(host), to_mlx(np.ones(4, np.float32))], 2.0)
    assert found.item() is False
    assert norm.item() == math.inf  # the norm itself passes float32's largest value


def test_a_bad_device_scale_fails_closed_inside_the_pass() -> None:
    grads = [to_mlx(np.ones(5, np.float32))]
    for bad in (0.0, -2.0, math.inf, math.nan, 1e-40):
        out, found = sc.unscale(grads, mx.array(bad, dtype=mx.float32))
        assert found.item() is True
        assert np.isnan(to_numpy(out[0])).all()


def test_every_pass_runs_inside_mx_compile_with_nothing_read_back() -> None:
    """MLX refuses to evaluate anything while it traces: a pass that read a value back
    would raise here."""
    state = to_device(sc.init(sc.ScalerConfig(init_scale=4.0)))

    xp = sc.get_backend("mlx").namespace()

    @mx.compile
    def step(grads: list[Any], scale: Any) -> Any:
        held = dataclasses.replace(state, scale=scale)
        clipped, found, norm = sc.unscale_and_clip(grads, held, 1.0)
        new = sc.update(held, found)
        return clipped, found, norm, new.scale, sc.step_skipped(new, xp)

    grads = [to_mlx(np.full(4, 8.0, np.float32)), to_mlx(np.array(4.0, np.float16))]
    clipped, found, norm, scale, skipped = step(grads, mx.array(4.0, dtype=mx.float32))
    assert found.item() is False
    assert skipped.item() is False
    assert norm.item() == pytest.approx(math.sqrt(4 * 4.0 + 1.0))
    assert scale.item() == 4.0
    assert to_numpy(clipped[0])[0] == pytest.approx(2.0 / norm.item(), rel=1e-6)
    grads[0] = to_mlx(np.array([8.0, np.inf, 1.0, 1.0], np.float32))
    clipped, found, _, scale, skipped = step(grads, mx.array(4.0, dtype=mx.float32))
    assert found.item()
    assert skipped.item()
    assert scale.item() == 2.0
    assert to_numpy(clipped[0])[0] == 8.0  # a skipped step keeps the scaled values


def test_reading_a_flag_inside_mx_compile_is_refused_with_the_way_out() -> None:
    backend = sc.get_backend("mlx")

    @mx.compile
    def read(flag: Any) -> Any:
        backend.to_bool(flag)
        return flag

    with pytest.raises(sc.GradientTypeError, match="select\\(\\) and advance with update"):
        read(mx.array(True))

    @mx.compile
    def report(grads: list[Any]) -> Any:
        sc.non_finite_leaves(grads)
        return grads

    with pytest.raises(sc.GradientTypeError, match="call non_finite_leaves outside"):
        report([mx.array([1.0, math.nan])])


def test_the_passes_are_compiled_once_per_dtypes_not_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A training loop traces each pass once: later calls (new values, same shapes) run the
    compiled function without tracing the Python again."""
    traced: list[Any] = []
    times = _mlx._times

    def counting(g: Any, factor: Any) -> Any:
        traced.append(g.shape)
        return times(g, factor)

    monkeypatch.setattr(_mlx, "_times", counting)
    monkeypatch.setattr(_mlx, "_COMPILED", {})
    rng = np.random.default_rng(0)
    for _ in range(4):
        grads = {
            "w": to_mlx(rng.standard_normal((64, 32)).astype(np.float32)),
            "b": to_mlx(rng.standard_normal(32).astype(np.float16)),
        }
        out, found, norm = sc.unscale_and_norm(grads, 1024.0)
        mx.eval(out, found, norm)
        if not traced:
            pytest.fail("the pass was never traced")
        if len(_mlx._COMPILED) != 1:
            pytest.fail(f"{len(_mlx._COMPILED)} compiled passes for one tree")
    first = len(traced)
    assert first > 0
    grads = {"w": to_mlx(np.ones((64, 32), np.float32)), "b": to_mlx(np.ones(32, np.float16))}
    mx.eval(sc.unscale_and_norm(grads, 2.0))
    assert len(traced) == first  # traced by the first call only


# --------------------------------------------------- the device transition vs the host
def _fields(state: sc.ScalerState) -> tuple[Any, ...]:
    """Every data field as a Python value; the float32 fields as their bits."""
    out = []
    for n in DATA_FIELDS:
        value = getattr(state, n)
        value = value.item() if isinstance(value, mx.array) else value
        out.append(f32_bits(value) if n in FLOAT_FIELDS else int(value))
    return tuple(out)


def _compiled_steps(config: sc.ScalerConfig, spikes: bool) -> tuple[StateCell, Callable[..., Any]]:
    cell = StateCell(sc.init(config))

    @partial(mx.compile, inputs=[cell], outputs=[cell])
    def step(flag: Any, norm: Any) -> Any:
        cell.state = sc.update(cell.state, flag, norm if spikes else None)
        return flag

    return cell, step


@given(config=configs(), flags=flag_sequences(max_size=FLAGS_LEN))
@settings(max_examples=20, deadline=None)
def test_the_compiled_transition_equals_the_host_rule_bit_for_bit(
    config: sc.ScalerConfig, flags: list[bool]
) -> None:
    flags = (flags + [False] * FLAGS_LEN)[:FLAGS_LEN]
    cell, step = _compiled_steps(config, spikes=False)
    for i, (flag, (host, failed)) in enumerate(zip(flags, host_run(config, flags), strict=True)):
        step(mx.array(flag), mx.array(0.0))
        dev = cell.state
        if failed is None:
            assert _fields(dev) == _fields(host), f"step {i}"
            continue
        # The device keeps the last valid values and records why it stopped.
        at = DATA_FIELDS.index("failure")
        kept, want = list(_fields(dev)), list(_fields(host))
        del kept[at], want[at]
        assert kept == want, f"step {i}"
        assert int(dev.failure.item()) == int(failed)
        err = sc.SkipLimitError if failed is sc.Failure.SKIP_LIMIT else sc.ScaleCollapseError
        with pytest.raises(err):
            dev.current_scale()


@given(config=configs(spikes=True), flags=flag_sequences(max_size=FLAGS_LEN), data=st.data())
@settings(max_examples=15, deadline=None)
def test_the_compiled_transition_with_spikes_equals_the_host_rule(
    config: sc.ScalerConfig, flags: list[bool], data: st.DataObject
) -> None:
    flags = (flags + [False] * FLAGS_LEN)[:FLAGS_LEN]
    norms = data.draw(norm_sequences(FLAGS_LEN, FLAGS_LEN))
    cell, step = _compiled_steps(config, spikes=True)
    host = sc.init(config)
    for i, (flag, norm) in enumerate(zip(flags, norms, strict=True)):
        step(mx.array(flag), mx.array(norm, dtype=mx.float32))
        try:
            host = host_update(host, flag, norm)
        except sc.ScaleCollapseError:
            assert cell.state.failure.item() != 0
            return
        assert _fields(cell.state) == _fields(host), f"step {i}"


def test_the_eager_transition_on_mlx_flags_equals_the_host_rule() -> None:
    config = sc.ScalerConfig(growth_interval=3, hysteresis=2, min_scale=2.0**10)
    flags = np.random.default_rng(5).random(200) < 0.3
    state, host = to_device(sc.init(config)), sc.init(config)
    for flag in flags:
        state = sc.update(state, mx.array(bool(flag)))
        host = sc.update(host, bool(flag))
        assert isinstance(state.scale, mx.array)
        assert _fields(state) == _fields(host)


def test_a_collapse_is_recorded_on_mlx_and_raised_at_the_first_look() -> None:
    state = to_device(sc.init(sc.ScalerConfig(init_scale=2.0**-125)))
    once = sc.update(state, mx.array(True))
    assert once.current_scale() == 2.0**-126
    twice = sc.update(once, mx.array(True))
    assert twice.failure.item() == int(sc.Failure.COLLAPSE)
    assert twice.scale.item() == 2.0**-126
    with pytest.raises(sc.ScaleCollapseError, match="device transition recorded"):
        twice.current_scale()
    assert sc.step_skipped(sc.update(twice, mx.array(False)))


def test_to_device_makes_mlx_fields_and_keeps_static_statistics_on_the_host() -> None:
    state = to_device(sc.init())
    assert state.scale.dtype == mx.float32
    assert state.steps.dtype == mx.int32
    assert state.norm_mean == 0.0  # static while spike skipping is off
    assert to_device(state).to_host() == sc.init()
    spiking = to_device(sc.init(sc.ScalerConfig(spike_threshold=3.0)))
    assert spiking.norm_mean.dtype == mx.float32
    with pytest.raises(sc.InvalidArgumentError, match="must be a ScalerState"):
        to_device({"scale": 1.0})  # type: ignore[arg-type]


# ------------------------------------------------------------------- the state cell
def test_a_state_cell_holds_the_state_as_a_dict_of_mlx_arrays() -> None:
    config = sc.ScalerConfig(growth_interval=2)
    cell = StateCell(sc.init(config))
    assert set(cell) == set(DATA_FIELDS) - {"norm_mean", "norm_var", "norm_count"}
    assert all(isinstance(v, mx.array) for v in cell.values())
    assert cell.config == config
    cell.state = sc.update(sc.update(sc.init(config), False), False)  # a host state moves
    assert cell.state.current_scale() == 2.0**17
    assert isinstance(cell["scale"], mx.array)
    assert "StateCell(ScalerState(" in repr(cell)
    with pytest.raises(sc.InvalidArgumentError, match="make a new StateCell"):
        cell.state = sc.init(sc.ScalerConfig(growth_interval=3))
    with pytest.raises(sc.InvalidArgumentError, match="must be a ScalerState"):
        StateCell({"scale": 1.0})  # type: ignore[arg-type]


# ------------------------------------------------- the skipped step inside mx.compile
class _Net(nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(6, 8), nn.Linear(8, 3)]

    def __call__(self, x: Any) -> Any:
        return self.layers[1](nn.relu(self.layers[0](x)))


def _snapshot(tree: Any) -> list[tuple[str, np.ndarray]]:
    return [(k, bits(np.array(v))) for k, v in tree_flatten(tree)]


def _same(a: list[tuple[str, np.ndarray]], b: list[tuple[str, np.ndarray]]) -> bool:
    return [k for k, _ in a] == [k for k, _ in b] and all(
        x.dtype == y.dtype and np.array_equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True)
    )


def _loss(model: Any, x: Any, y: Any) -> Any:
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


@pytest.mark.parametrize("kind", ["adam", "multi"])
def test_a_skipped_step_inside_mx_compile_keeps_parameters_and_optimizer_state(
    kind: str,
) -> None:
    mx.random.seed(0)
    model = _Net()
    schedule = optim.linear_schedule(1e-2, 1e-3, 100)
    if kind == "adam":
        optimizer: Any = optim.Adam(learning_rate=schedule)
    else:  # the first layer by SGD with momentum, the rest by Adam
        optimizer = optim.MultiOptimizer(
            [optim.SGD(learning_rate=0.1, momentum=0.9), optim.Adam(learning_rate=schedule)],
            [lambda path, _: path.startswith("layers.0")],
        )
    cell = StateCell(sc.init(sc.ScalerConfig(init_scale=2.0**10, growth_interval=3)))
    loss_and_grad = scaled_value_and_grad(model, _loss)
    captured = [model.state, optimizer.state, cell]

    @partial(mx.compile, inputs=captured, outputs=captured)
    def step(x: Any, y: Any, poison: Any) -> Any:
        loss, grads = loss_and_grad(cell, model, x, y)
        grads["layers"][1]["bias"] = grads["layers"][1]["bias"] * poison
        grads, found = sc.unscale(grads, cell.state)
        cell.state = sc.update(cell.state, found)
        optimizer_update(optimizer, model, grads, cell)
        return loss

    x = mx.random.normal((16, 6))
    y = mx.random.randint(0, 3, (16,))
    plan = [1.0, math.inf, 1.0, 1.0, math.nan, 1.0, 1.0, 1.0]
    scales, steps_done = [], []
    for poison in plan:
        before = (_snapshot(model.parameters()), _snapshot(optimizer.state))
        step(x, y, mx.array(poison))
        mx.eval(model.parameters(), optimizer.state)
        after = (_snapshot(model.parameters()), _snapshot(optimizer.state))
        skipped = not math.isfinite(poison)
        assert sc.step_skipped(cell.state) is skipped
        if skipped:
            assert _same(before[0], after[0]), "a skipped step changed a parameter"
            assert _same(before[1], after[1]), "a skipped step changed the optimizer state"
        else:
            assert not _same(before[0], after[0]), "a good step left the parameters"
            assert not _same(before[1], after[1]), "a good step left the optimizer state"
        scales.append(cell.state.current_scale())
        steps_done.append(int(cell.state.steps.item()))
    # 2**10, inf: 2**9, then three clean steps grow it, NaN backs off, three clean grow it.
    assert scales == [2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**8, 2.0**8, 2.0**8, 2.0**9]
    assert cell.state.skipped_steps.item() == 2
    assert steps_done == list(range(1, len(plan) + 1))


def test_optimizer_update_takes_a_flag_and_refuses_what_is_not_one() -> None:
    mx.random.seed(1)
    model = _Net()
    optimizer = optim.SGD(learning_rate=0.1, momentum=0.9)
    grads = nn.value_and_grad(model, _loss)(model, mx.ones((2, 6)), mx.array([0, 1]))[1]
    before = _snapshot(model.parameters())
    optimizer_update(optimizer, model, grads, mx.array(True))
    assert _same(before, _snapshot(model.parameters()))
    assert optimizer.state["step"].item() == 0  # initialised, not advanced
    optimizer_update(optimizer, model, grads, False)
    assert not _same(before, _snapshot(model.parameters()))
    assert optimizer.state["step"].item() == 1
    with pytest.raises(sc.GradientTypeError, match="skip"):
        optimizer_update(optimizer, model, grads, 1)


def test_scaled_value_and_grad_gives_the_loss_and_the_gradients_of_the_scaled_loss() -> None:
    mx.random.seed(2)
    model = _Net()
    x, y = mx.random.normal((8, 6)), mx.array([0, 1, 2, 0, 1, 2, 0, 1])
    state = to_device(sc.init(sc.ScalerConfig(init_scale=2.0**12)))
    loss, grads = scaled_value_and_grad(model, _loss)(state, model, x, y)
    plain_loss, want = nn.value_and_grad(model, lambda m, a, b: _loss(m, a, b) * 2.0**12)(
        model, x, y
    )
    assert loss.item() == _loss(model, x, y).item()
    assert plain_loss.item() == loss.item() * 2.0**12
    assert _same(_snapshot(grads), _snapshot(want))

    def with_aux(m: Any, a: Any, b: Any) -> Any:
        return _loss(m, a, b), m(a)

    (aux_loss, logits), aux_grads = scaled_value_and_grad(model, with_aux)(
        sc.init(sc.ScalerConfig(init_scale=2.0**12)), model, x, y
    )
    assert aux_loss.item() == loss.item()
    assert logits.shape == (8, 3)
    assert _same(_snapshot(aux_grads), _snapshot(want))
    with pytest.raises(sc.InvalidArgumentError, match=r"mlx\.nn\.Module"):
        scaled_value_and_grad(object(), _loss)  # type: ignore[arg-type]


# ---------------------------------------------------- float16 training that scaling saves
#: The loss is multiplied by this and the learning rate divided by it: the same training
#: in float32, but float16's backward then holds no gradient value (as docs/demo.md does).
LOSS_WEIGHT = 2.0**-20


class _HalfMLP(nn.Module):  # type: ignore[misc]
    """float32 master weights; forward and backward in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)]

    def __call__(self, x: Any) -> Any:
        h = x.astype(mx.float16)
        for i, layer in enumerate(self.layers):
            h = h @ layer.weight.astype(mx.float16).T + layer.bias.astype(mx.float16)
            h = nn.relu(h) if i < len(self.layers) - 1 else h
        return h


def _digits(n: int = 2048) -> tuple[Any, Any]:
    """Ten random 8x8 patterns, each example a dimmed copy under noise."""
    rng = np.random.default_rng(0)
    patterns = rng.standard_normal((10, 64)).astype(np.float32)
    y = rng.integers(0, 10, n)
    dim = rng.uniform(0.5, 1.0, (n, 1)).astype(np.float32)
    x = patterns[y] * dim + 0.6 * rng.standard_normal((n, 64)).astype(np.float32)
    return mx.array(x), mx.array(y)


def _half_loss(model: Any, x: Any, y: Any) -> Any:
    logits = model(x)
    loss = nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean")
    return loss * LOSS_WEIGHT, logits


def _train_in_float16(scaled: bool, steps: int = 150) -> dict[str, Any]:
    mx.random.seed(0)
    model = _HalfMLP()
    optimizer = optim.SGD(learning_rate=0.05 / LOSS_WEIGHT, momentum=0.9)
    x, y = _digits()
    cell = StateCell(sc.init(sc.ScalerConfig(init_scale=2.0**40, growth_interval=25)))
    captured = [model.state, optimizer.state, cell]
    if scaled:
        loss_and_grad = scaled_value_and_grad(model, _half_loss)

        @partial(mx.compile, inputs=captured, outputs=captured)
        def step(xb: Any, yb: Any) -> Any:
            (loss, logits), grads = loss_and_grad(cell, model, xb, yb)
            grads, found = sc.unscale(grads, cell.state)
            cell.state = sc.update(cell.state, found)
            optimizer_update(optimizer, model, grads, cell)
            return loss, logits, grads

    else:
        plain = nn.value_and_grad(model, _half_loss)

        @partial(mx.compile, inputs=captured, outputs=captured)
        def step(xb: Any, yb: Any) -> Any:
            (loss, logits), grads = plain(model, xb, yb)
            optimizer.update(model, grads)
            return loss, logits, grads

    start = _snapshot(model.parameters())
    first = nn.losses.cross_entropy(model(x).astype(mx.float32), y, reduction="mean").item()
    kinds, nonzero, dtypes = [], 0, set()
    for i in range(steps):
        idx = mx.array(np.random.default_rng(i).integers(0, x.shape[0], 128))
        _, logits, grads = step(x[idx], y[idx])
        dtypes.add(logits.dtype)
        nonzero += sum(int((np.array(g) != 0).sum()) for _, g in tree_flatten(grads))
        kinds.append(cell.state.last_step if scaled else None)
    logits = model(x)
    return {
        "first": first,
        "last": nn.losses.cross_entropy(logits.astype(mx.float32), y, reduction="mean").item(),
        "accuracy": (mx.argmax(logits, axis=1) == y).astype(mx.float32).mean().item(),
        "unchanged": _same(start, _snapshot(model.parameters())),
        "nonzero": nonzero,
        "dtypes": dtypes,
        "kinds": kinds,
        "state": cell.state,
    }


def test_float16_training_stalls_without_scaling_and_trains_with_it() -> None:
    without = _train_in_float16(scaled=False)
    assert without["dtypes"] == {mx.float16}  # activations (the logits) in float16
    assert without["nonzero"] == 0  # every gradient value underflowed in float16
    assert without["unchanged"]  # so not one weight moved
    assert without["last"] == without["first"]

    with_scaling = _train_in_float16(scaled=True)
    assert with_scaling["dtypes"] == {mx.float16}
    assert with_scaling["first"] == without["first"]  # the same start
    assert with_scaling["last"] < 0.1 * with_scaling["first"]
    assert with_scaling["accuracy"] > 0.9
    kinds = with_scaling["kinds"]
    assert sc.StepKind.BACKOFF in kinds  # scaled float16 gradients overflowed: real skips
    assert sc.StepKind.GROW in kinds  # and real growth after growth_interval clean steps
    state = with_scaling["state"]
    assert state.skipped_steps.item() == kinds.count(sc.StepKind.BACKOFF) > 0
