"""The array_api backend: any Array API library, run on array-api-strict (which refuses
anything outside the standard, and has devices that refuse each other's arrays and one
without float64), on NumPy and on torch through array-api-compat.

The contract suite runs here on the backend bound to array-api-strict, on three of its
devices, and the broken variants below show it catches this backend's likely slips.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

xp = pytest.importorskip("array_api_strict", reason="the array_api backend is tested on it")

import scaler_core as sc  # noqa: E402
from scaler_core._ops import CLIP_EPS, as_flag  # noqa: E402
from scaler_core.backends._array_api import (  # noqa: E402
    ArrayApiBackend,
    Prepared,
    _times,
    array_namespace_of,
    namespace_on,
)
from scaler_core.testing import BACKEND_CHECKS, check_backend  # noqa: E402

NUMPY = sc.get_backend("numpy")
#: The strict devices run: the default; another (arrays of two devices cannot be combined
#: there, so an array made off the leaves' device fails); one without float64.
DEVICES = {
    "cpu": None,
    "device1": xp.Device("device1"),
    "no_float64": xp.Device("no_float64"),
}


def _to_numpy(x: Any) -> np.ndarray:
    return np.from_dlpack(x)  # the standard's interchange: any device of array-api-strict


def _on(device: Any) -> Callable[[np.ndarray], Any]:
    def asarray(a: np.ndarray) -> Any:
        return xp.asarray(a, device=device)

    return asarray


def _bits(x: Any) -> np.ndarray:
    a = np.asarray(x if isinstance(x, np.ndarray | np.generic) else _to_numpy(x))
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _same(a: Any, b: Any) -> bool:
    a, b = _bits(a), _bits(b)
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.all(a == b))


# ------------------------------------------------------------------- the contract
@pytest.mark.parametrize("check", list(BACKEND_CHECKS))
@pytest.mark.parametrize("device", list(DEVICES))
def test_the_backend_keeps_the_contract_on_array_api_strict(device: str, check: str) -> None:
    backend = ArrayApiBackend(xp, DEVICES[device])
    got = check_backend(backend, asarray=_on(DEVICES[device]), to_numpy=_to_numpy, only=[check])
    assert got == [check]


def _numpy_without_bfloat16(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.dtype(ml_dtypes.bfloat16):  # ml_dtypes', outside NumPy's namespace
        raise TypeError("NumPy's Array API namespace has no bfloat16")
    return np.array(a)


@pytest.mark.parametrize("check", list(BACKEND_CHECKS))
def test_the_registered_backend_keeps_the_contract_on_numpy_arrays(check: str) -> None:
    """NumPy 2's arrays carry __array_namespace__: get_backend("array_api") takes them
    (the NumPy backend is what dispatch picks for them). With no device value it decides
    on the host, as NumPy's values go with every library."""
    backend = sc.get_backend("array_api")
    got = check_backend(backend, asarray=_numpy_without_bfloat16, to_numpy=np.asarray, only=[check])
    assert got == [check]


def _torch_conversions() -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    torch = pytest.importorskip("torch")
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def asarray(a: np.ndarray) -> Any:
        a = np.array(a, order="C")
        if a.dtype == bf16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    def to_numpy(t: Any) -> np.ndarray:
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(bf16)  # type: ignore[no-any-return]
        return t.numpy()  # type: ignore[no-any-return]

    return asarray, to_numpy


@pytest.mark.parametrize("check", list(BACKEND_CHECKS))
def test_the_backend_keeps_the_contract_on_torch_through_array_api_compat(check: str) -> None:
    """torch tensors have no __array_namespace__: array-api-compat's namespace serves them,
    float16 and bfloat16 included (computed in float32, as the rules say)."""
    compat = pytest.importorskip("array_api_compat")
    asarray, to_numpy = _torch_conversions()
    backend = ArrayApiBackend(compat.array_namespace(asarray(np.ones(1, np.float32))))
    assert check_backend(backend, asarray=asarray, to_numpy=to_numpy, only=[check]) == [check]


# ------------------------------------------------------------------- dispatch
def _tree(seed: int, scale: float, *, nan: bool = False) -> dict[str, Any]:
    """Host gradients (float32 and float64, nested, a 0-d leaf, None) at ``scale``."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((4, 5)) * scale).astype(np.float32)
    if nan:
        w[1, 2] = np.nan
    b = (rng.standard_normal(7) * scale).astype(np.float64)
    s = np.array(rng.standard_normal() * scale, np.float32)
    return {"layer": {"w": w, "b": b}, "frozen": None, "scalar": [s]}


def _strict(tree: Any, device: Any = None) -> Any:
    return {
        "layer": {k: xp.asarray(v, device=device) for k, v in tree["layer"].items()},
        "frozen": None,
        "scalar": [xp.asarray(tree["scalar"][0], device=device)],
    }


def _copy(tree: Any) -> Any:
    return {
        "layer": {k: v.copy() for k, v in tree["layer"].items()},
        "frozen": None,
        "scalar": [tree["scalar"][0].copy()],
    }


def _leaves(tree: Any) -> list[Any]:
    return [tree["layer"]["w"], tree["layer"]["b"], tree["scalar"][0]]


@pytest.mark.parametrize("scale", [65536.0, 3.0, 2.0**-8])
@pytest.mark.parametrize("nan", [False, True])
def test_dispatch_picks_array_api_and_gives_the_numpy_backends_bits(
    scale: float, nan: bool
) -> None:
    host = _tree(7, scale, nan=nan)
    grads = _strict(host)
    assert sc.backend_for(grads).name == "array_api"

    out, found = sc.unscale(grads, scale)
    want, want_found = sc.unscale(_copy(host), scale, backend=NUMPY)
    assert array_namespace_of(found) is xp
    assert found.shape == ()
    assert bool(found) is bool(want_found) is nan
    for got, exp in zip(_leaves(out), _leaves(want), strict=True):
        assert array_namespace_of(got) is xp
        assert _same(got, exp)

    out, found, norm = sc.unscale_and_clip(grads, scale, 1.0)
    want, want_found, want_norm = sc.unscale_and_clip(_copy(host), scale, 1.0, backend=NUMPY)
    assert bool(found) is bool(want_found) is nan
    assert _same(xp.astype(norm, xp.float32), np.float32(want_norm))
    for got, exp in zip(_leaves(out), _leaves(want), strict=True):
        assert _same(got, exp)

    state = sc.init(sc.ScalerConfig(growth_interval=1))
    moved = sc.update(state, found)
    assert array_namespace_of(moved.scale) is xp
    assert moved.to_host() == sc.update(state, bool(want_found))


def test_the_inputs_are_never_written() -> None:
    """Functional: the standard does not promise in-place writes, so nothing is written
    to a gradient, on a clean step or a skipped one."""
    for nan in (False, True):
        host = _tree(3, 1024.0, nan=nan)
        grads = _strict(host)
        sc.unscale(grads, 1024.0)
        sc.unscale_and_norm(grads, 1024.0)
        out, _, _ = sc.unscale_and_clip(grads, 1024.0, 0.5)
        for given, was in zip(_leaves(grads), _leaves(host), strict=True):
            assert _same(given, was)
        if nan:  # a skipped step returns the scaled values, bit for bit
            for got, was in zip(_leaves(out), _leaves(host), strict=True):
                assert _same(got, was)


def test_non_finite_values_are_flagged_without_a_numpy_warning() -> None:
    """array-api-strict computes with NumPy, which warns where a value becomes inf or NaN
    (pytest here turns warnings into errors): an unscale that overflows, and a skipped
    clip, whose inf times a coefficient of 0 is formed before ``where`` drops it."""
    big = {"w": xp.asarray([3e38, 1.0], dtype=xp.float32)}
    out, found = sc.unscale(big, 2.0**-8)
    assert bool(found)
    assert _same(out["w"], np.array([np.inf, 256.0], np.float32))
    grads = {"w": xp.asarray([np.inf, 1.0], dtype=xp.float32)}
    out, found, norm = sc.unscale_and_clip(grads, 2.0, 1.0)
    assert bool(found)
    assert float(norm) == math.inf
    assert _same(out["w"], np.array([np.inf, 1.0], np.float32))


def test_a_float64_norm_past_every_float_is_inf_without_a_flag() -> None:
    """float64 gradients whose squares overflow float64: the norm is inf, the values are
    finite, so the flag stays false (the float64 sum is no flag for float64 leaves)."""
    grads = {"w": xp.asarray([1e200, -1e200], dtype=xp.float64), "b": xp.ones(3)}
    out, found, norm = sc.unscale_and_norm(grads, 2.0)
    assert not bool(found)
    assert float(norm) == math.inf
    assert _same(out["w"], np.array([5e199, -5e199]))


def test_a_float64_scale_and_an_inexact_factor_stay_float32() -> None:
    """A 0-d float64 scale counts as its float32 value, and a factor float32 cannot hold
    is multiplied in float64 and rounded back: float32 values, the host rule's."""
    host = _tree(11, 1000.0)
    out, _ = sc.unscale(_strict(host), xp.asarray(1000.0, dtype=xp.float64))
    want, _ = sc.unscale(_copy(host), 1000.0, backend=NUMPY)
    for got, exp in zip(_leaves(out), _leaves(want), strict=True):
        assert _same(got, exp)
    config = sc.ScalerConfig(init_scale=3.0, backoff_factor=0.9, growth_factor=1.1)
    found = sc.find_non_finite([xp.asarray([np.nan], dtype=xp.float32)])
    clean = sc.find_non_finite([xp.ones(1, dtype=xp.float32)])
    on_device, on_host = sc.init(config), sc.init(config)
    for flag, value in ((found, True), (clean, False), (found, True)):
        on_device = sc.update(on_device, flag)
        on_host = sc.update(on_host, value)
        assert on_device.scale.dtype == xp.float32
        assert on_device.to_host() == on_host


def test_a_full_step_matches_the_numpy_path_bit_for_bit() -> None:
    """unscale_and_clip, then update with the device flag, step after step (growth, a
    skipped step, clipping and not): the same gradients, flags, norms and states as the
    NumPy backend with host flags."""
    config = sc.ScalerConfig(init_scale=2.0**10, growth_interval=2)
    on_device, on_host = sc.init(config), sc.init(config)
    for step in range(6):
        max_norm = 0.5 if step % 2 else 1e3
        host = _tree(100 + step, float(on_host.scale), nan=step == 3)
        grads = _strict(host)
        out, found, norm = sc.unscale_and_clip(grads, on_device.scale, max_norm)
        want, want_found, want_norm = sc.unscale_and_clip(
            _copy(host), on_host.scale, max_norm, backend=NUMPY
        )
        assert bool(found) is bool(want_found) is (step == 3), step
        assert math.isnan(float(norm)) if step == 3 else _same(norm, np.float32(want_norm))
        for got, exp in zip(_leaves(out), _leaves(want), strict=True):
            assert _same(got, exp), step
        on_device = sc.update(on_device, found)
        on_host = sc.update(on_host, want_found)
        assert on_device.to_host() == on_host, step
    assert (on_host.skipped_steps, on_host.scale) == (1, 2.0**11)  # grew, backed off, grew


# ------------------------------------------------------------------- libraries
class _OtherArray:
    """An array of another Array API library (its module: ``otherlib``)."""

    __module__ = "otherlib.core"
    shape, dtype = (2,), "float32"

    def __array_namespace__(self, api_version: Any = None) -> Any:
        return types.SimpleNamespace(__name__="otherlib")


def test_arrays_of_two_array_api_libraries_in_one_call_are_refused() -> None:
    strict = xp.ones(2, dtype=xp.float32)
    grads = {"a": strict, "b": _OtherArray()}
    with pytest.raises(sc.GradientTypeError, match=r"grads\['b'\] is a otherlib array but "):
        sc.unscale(grads, 2.0)
    with pytest.raises(sc.GradientTypeError, match=r"grads\['b'\] is a otherlib array but "):
        sc.unscale(grads, 2.0, backend="array_api")
    # named: NumPy's arrays are Array API arrays too, and not array-api-strict's
    mixed = {"a": strict, "b": np.ones(2, np.float32)}
    with pytest.raises(
        sc.GradientTypeError,
        match=r"grads\['b'\] is a numpy array but grads\['a'\] is a array_api_strict array; ",
    ):
        sc.find_non_finite(mixed, backend="array_api")
    with pytest.raises(
        sc.GradientTypeError,
        match=r"grads\['w'\] is a numpy array but ArrayApiBackend\(array_api_strict, "
        r"device=None\) serves array_api_strict arrays alone; ",
    ):
        sc.unscale({"w": np.ones(2, np.float32)}, 2.0, backend=ArrayApiBackend(xp))


def test_torch_tensors_go_through_array_api_compat_with_the_torch_backends_bits() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("array_api_compat")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        g = (torch.arange(-6, 6, dtype=torch.float32) * 300.0).to(dtype)
        out, found = sc.unscale({"g": g}, 3.0, backend="array_api")
        want, _ = sc.unscale({"g": g.clone()}, 3.0, backend="torch")
        assert type(found) is torch.Tensor
        assert not bool(found)
        assert torch.equal(out["g"].view(torch.uint8), want["g"].view(torch.uint8)), dtype
        assert not torch.equal(g, out["g"])  # the input kept its values


def test_the_namespace_makes_the_cores_values_on_its_device() -> None:
    """What the standard lacks, and only that: callable dtypes and an asarray taking them,
    Python's bool, Python numbers (filled on the device) and NumPy values (their dtype
    kept); the rest is array-api-strict's own."""
    d1 = DEVICES["device1"]
    ns = ArrayApiBackend(xp, d1).namespace()
    made = {
        "float32(0.1)": (ns.float32(0.1), xp.float32, np.float32(0.1)),
        "float64(0.1)": (ns.float64(0.1), xp.float64, 0.1),
        "asarray(7, int32)": (ns.asarray(7, dtype=ns.int32), xp.int32, 7),
        "asarray(True, bool)": (ns.asarray(True, dtype=bool), xp.bool, True),
        "asarray(np 0-d float32)": (ns.asarray(np.array(0.5, np.float32)), xp.float32, 0.5),
        "asarray(np.float64, float32)": (
            ns.asarray(np.float64(0.1), dtype=ns.float32),
            xp.float32,
            np.float32(0.1),
        ),
        "flag(True)": (ns.flag(True), xp.bool, True),
    }
    for what, (value, dtype, want) in made.items():
        assert (value.dtype, value.device, value.shape) == (dtype, d1, ()), what
        assert _same(value, np.asarray(want, _to_numpy(value).dtype)), what
    assert ns.where is xp.where
    assert ns.isdtype is xp.isdtype
    assert ns.float64_missing is None
    assert ns.is_array(ns.flag(False))
    assert not ns.is_array(np.ones(1))
    assert not ns.is_array(1.0)


def test_the_bound_namespace_is_required() -> None:
    with pytest.raises(sc.InvalidArgumentError, match=r"xp=.*Array API namespace"):
        ArrayApiBackend(object())


# ------------------------------------------------------------------- devices
def test_every_array_is_made_on_the_leaves_device() -> None:
    """On device1 an array made on the default device cannot be combined with the
    leaves: every pass, the flag, the norm, the transition and select run there."""
    d1 = DEVICES["device1"]
    host = _tree(5, 1024.0)
    grads = _strict(host, d1)
    scale = xp.asarray(1024.0, dtype=xp.float32)  # on the default device: moved
    out, found, norm = sc.unscale_and_clip(grads, scale, 0.5)
    state = sc.update(sc.init(), found)
    assert {x.device for x in [*_leaves(out), found, norm, state.scale]} == {d1}
    backend = sc.backend_for(grads)
    kept = backend.select(found, grads, out)
    assert all(x.device == d1 for x in _leaves(kept))
    assert backend.scale_loss(xp.asarray(0.5, dtype=xp.float32, device=d1), 8.0).device == d1


def test_leaves_on_two_devices_are_served_each_where_it_lives() -> None:
    d1, d2 = xp.Device("device1"), xp.Device("device2")
    host = _tree(9, 64.0, nan=True)
    grads = {
        "a": xp.asarray(host["layer"]["w"], device=d1),
        "b": xp.asarray(host["layer"]["b"], device=d2),
    }
    out, found, norm = sc.unscale_and_norm(grads, 64.0)
    assert (out["a"].device, out["b"].device, found.device, norm.device) == (d1, d2, d1, d1)
    want, _, _ = sc.unscale_and_norm(
        {"a": host["layer"]["w"].copy(), "b": host["layer"]["b"].copy()}, 64.0, backend=NUMPY
    )
    assert bool(found)
    assert _same(out["a"], want["a"])
    assert _same(out["b"], want["b"])


def test_a_device_without_float64_sums_in_float32_and_refuses_inexact_factors() -> None:
    nf64 = DEVICES["no_float64"]
    grads = {"w": xp.asarray(np.linspace(-3, 3, 101, dtype=np.float32), device=nf64)}
    backend = sc.backend_for(grads)
    assert backend.namespace(grads["w"]).float64_missing is not None
    assert backend.namespace(xp.ones(1)).float64_missing is None
    _, found, norm = sc.unscale_and_norm(grads, 1.0)
    exact = math.sqrt(math.fsum(float(v) ** 2 for v in np.linspace(-3, 3, 101, dtype=np.float32)))
    assert abs(float(norm) - exact) <= 4 * np.spacing(np.float32(exact))
    state = sc.init(sc.ScalerConfig(backoff_factor=0.9))
    with pytest.raises(sc.InvalidConfigError, match=r"backoff_factor=0\.9.*float64"):
        sc.update(state, found)
    assert float(sc.update(sc.init(), found).scale) == 65536.0


def test_a_bad_device_scale_fails_closed() -> None:
    """A device scale is not read back: where it is not a positive normal float32 every
    unscaled value is NaN and the flag is set; the scaled loss is NaN."""
    grads = {"w": xp.asarray([1.0, -2.0], dtype=xp.float32)}
    for bad in (0.0, -1.0, math.inf, math.nan, 1e-40):
        scale = xp.asarray(bad, dtype=xp.float32)
        out, found = sc.unscale(grads, scale)
        assert bool(found)
        assert bool(xp.all(xp.isnan(out["w"])))
        loss = sc.get_backend("array_api").scale_loss(xp.asarray(0.5, dtype=xp.float32), scale)
        assert math.isnan(float(loss))
    with pytest.raises(sc.GradientValueError, match="0-d float array"):
        sc.unscale(grads, xp.ones(2, dtype=xp.float32))


def test_a_host_flag_is_decided_on_the_host_keeping_each_librarys_arrays() -> None:
    """With no device value (a host flag, an empty tree) the registered backend decides on
    the host: select hands back the very arrays, copying none (device1's cannot be)."""
    d1 = DEVICES["device1"]
    backend = sc.get_backend("array_api")
    old, new = {"w": xp.zeros(2, device=d1)}, {"w": xp.ones(2, device=d1)}
    assert backend.select(True, old, new)["w"] is old["w"]
    assert backend.select(np.bool_(False), old, new)["w"] is new["w"]
    _, found = sc.unscale({}, 2.0, backend="array_api")
    assert type(found) is np.bool_
    assert not found
    assert type(backend.any()) is np.bool_


# ------------------------------------------------------------------- broken variants
class _ChecksTheInput(ArrayApiBackend):
    """PyTorch's check: the flag of the scaled input, which misses an unscale overflow."""

    def unscale(self, leaves: Prepared, scale: Any) -> tuple[Any, Any]:
        out, _ = super().unscale(leaves, scale)
        _, found = super().unscale(leaves, None)
        return out, found


class _ClipWithoutClamp(ArrayApiBackend):
    """The clip coefficient without its ``min(coef, 1)``: a small norm scales gradients up."""

    def clip(self, leaves: Prepared, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        ns = leaves.ns
        flag = as_flag(ns, skip, "skip")
        coef = (ns.float32(1.0) / (norm + ns.float32(CLIP_EPS))) * ns.float32(max_norm)
        out = [
            ns.xp.where(flag, g, _times(ns, u, coef))
            for g, u in zip(leaves.arrays, self._unscaled(leaves, scale), strict=True)
        ]
        return leaves.tree(out)


class _NamespaceOnTheDefaultDevice(ArrayApiBackend):
    """A namespace that ignores the values' device: its flags live on the default one."""

    def namespace(self, *values: Any) -> Any:
        return namespace_on(xp)


@pytest.mark.parametrize(
    ("broken", "device", "check", "message"),
    [
        (_ChecksTheInput(xp), None, "unscale_values", "flagged False, not True"),
        (_ClipWithoutClamp(xp), None, "norm_and_clip", "clamped at 1"),
        (
            _NamespaceOnTheDefaultDevice(xp, DEVICES["device1"]),
            DEVICES["device1"],
            "namespace",
            "namespace().where(flag(True), <an array>, <another>) raised ValueError",
        ),
    ],
    ids=["checks-the-input", "clip-unclamped", "flags-off-the-device"],
)
def test_check_backend_catches_a_broken_array_api_backend(
    broken: ArrayApiBackend, device: Any, check: str, message: str
) -> None:
    asarray = _on(device)
    with pytest.raises(sc.BackendContractError, match=rf"'{check}' failed for backend 'array_api'"):
        check_backend(broken, asarray=asarray, to_numpy=_to_numpy)
    with pytest.raises(sc.BackendContractError) as info:
        check_backend(broken, asarray=asarray, to_numpy=_to_numpy, only=[check])
    assert message in str(info.value)


def test_spike_skipping_reads_the_norm_of_a_library_the_core_never_names() -> None:
    """The core asks the backend's namespace whether a 0-d value is a float (``isdtype``):
    array-api-strict's dtypes print as ``array_api_strict.float32``, and its norm is
    taken, as its flag is, with the host rule's result."""
    assert str(xp.float32).startswith("array_api_strict")
    config = sc.ScalerConfig(spike_threshold=3.0, spike_window=4, growth_interval=3)
    device, host = sc.init(config), sc.init(config)
    for i, value in enumerate([1.0, 1.1, 0.9, 1.0, 1.05, 40.0, 1.0, 0.95]):
        grads = {"w": xp.asarray([value * 1024.0, 0.0], dtype=xp.float32)}
        _, found, norm = sc.unscale_and_norm(grads, 1024.0)
        assert norm.dtype == xp.float32, i
        device = sc.update(device, found, grad_norm=norm)
        host = sc.update(host, bool(found), grad_norm=float(norm))
        assert device.to_host() == host, i
        if value == 40.0:  # the spike: skipped, on the device as on the host
            assert host.last_step is sc.StepKind.SPIKE_SKIP
    assert host.skipped_steps == 1
