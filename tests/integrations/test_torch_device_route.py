"""The torch backend's and the drop-in's device route, run on CPU tensors in CI.

On an accelerator nothing is read back: scales and flags stay on the device, a scale
below 1 is checked there (masked), a bad device scale fails closed, a refused step is
recorded in the state. ``backends.torch_kernels.reads_free`` is the one place the route is
chosen; here it says "not free" for the CPU too, so CPU tensors take the device route,
and every host read (``item``, ``tolist``, ``bool``, ``float``, ``int``, ``numpy``,
``cpu``) raises. The results are compared bit for bit with the host route's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")

from scaler_core import _ops  # noqa: E402
from scaler_core.backends import _torch, torch_kernels  # noqa: E402
from scaler_core.torch import GradScaler  # noqa: E402

pytestmark = pytest.mark.torch
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


class HostReadError(AssertionError):
    """A host read on the device route (on an accelerator: a synchronisation)."""


@pytest.fixture
def device_route(monkeypatch: pytest.MonkeyPatch) -> Callable[[], Any]:
    """CPU tensors take the device route; the returned context forbids host reads."""
    monkeypatch.setattr(torch_kernels, "reads_free", lambda device: False)

    @contextlib.contextmanager
    def no_host_reads() -> Iterator[None]:
        saved = {name: getattr(torch.Tensor, name) for name in _READS}

        def forbid(name: str) -> Callable[..., Any]:
            def read(self: Any, *args: Any, **kwargs: Any) -> Any:
                raise HostReadError(f"Tensor.{name}() on the device route")

            return read

        try:
            for name in _READS:
                setattr(torch.Tensor, name, forbid(name))
            yield
        finally:
            for name, method in saved.items():
                setattr(torch.Tensor, name, method)

    return no_host_reads


def _grads(dtype: torch.dtype, seed: int, special: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=gen).mul(2.0**6).to(dtype) for n in (1, 37, 4099)]
    out.append(torch.randn(6, 5, generator=gen).to(dtype).t())  # strided
    if special:
        out[2][[0, 100, 4000]] = torch.tensor([float("inf"), float("nan"), -float("inf")]).to(dtype)
    return out


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    wide = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(wide).numpy().copy()


def _assert_same(got: torch.Tensor, want: torch.Tensor, case: Any) -> None:
    """Bit for bit, except a NaN's payload: PyTorch's kernel (the device route) and the
    NumPy kernels (the host route's norm pass) make NaNs of their own bits."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), case
    assert np.array_equal(_bits(got)[~nan.numpy()], _bits(want)[~nan.numpy()]), case


def _run(op: str, grads: list[torch.Tensor], scale: Any) -> tuple[Any, Any]:
    backend = _torch.BACKEND
    if op == "unscale":
        return _ops.unscale(backend, grads, scale)[1], None
    if op == "detect":
        return _ops.find_non_finite(backend, grads), None
    if op == "norm":
        _, found, norm = _ops.unscale_and_norm(backend, grads, scale)
        return found, norm
    _, found, norm = _ops.unscale_and_clip(backend, grads, scale, 0.5)
    return found, norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["unscale", "detect", "norm", "clip"])
@pytest.mark.parametrize("scale", [65536.0, 3.0, 1.0, 0.25, "tensor", "tensor-below-one"])
@pytest.mark.parametrize("special", [False, True])
def test_the_device_route_gives_the_host_routes_bits_without_reading_anything(
    device_route: Callable[[], Any], dtype: torch.dtype, op: str, scale: Any, special: bool
) -> None:
    host_scale = {"tensor": 512.0, "tensor-below-one": 0.125}.get(scale, scale)
    want_grads = _grads(dtype, 0, special)
    with _restored_route():
        want_found, want_norm = _run(op, want_grads, torch.tensor(host_scale))
        if op == "clip" and bool(want_found):
            # A skipped clip: the host route writes nothing; the device route has no
            # read-only pass and leaves the gradients unscaled, as unscale_ does.
            want_grads = _grads(dtype, 0, special)
            _run("unscale", want_grads, torch.tensor(host_scale))
    grads = _grads(dtype, 0, special)
    dev_scale = torch.tensor(host_scale) if isinstance(scale, str) else scale
    with device_route():
        found, norm = _run(op, grads, dev_scale)
    for g, w in zip(grads, want_grads, strict=True):
        _assert_same(g, w, (op, dtype, scale))
    assert bool(found) == bool(want_found)
    if norm is not None:
        if torch.isnan(want_norm):
            assert torch.isnan(norm)
        else:
            a, b = (int(np.float32(float(x)).view(np.int32)) for x in (norm, want_norm))
            assert abs(a - b) <= 1, (float(norm), float(want_norm))


@contextlib.contextmanager
def _restored_route() -> Iterator[None]:
    """The host route, for the expected values, inside a test that forced the device one."""
    saved = torch_kernels.reads_free
    torch_kernels.reads_free = lambda device: device.type == "cpu"
    try:
        yield
    finally:
        torch_kernels.reads_free = saved


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan"), 1e-45])
def test_a_bad_device_scale_fails_closed_without_a_host_read(
    device_route: Callable[[], Any], bad: float
) -> None:
    grads = [torch.ones(10, dtype=dtype) for dtype in DTYPES]
    with device_route():
        _, found = _ops.unscale(_torch.BACKEND, grads, torch.tensor(bad))
    assert bool(found)
    assert all(torch.isnan(g.double()).all() for g in grads)


def _train(steps: int, route: Callable[[], Any] | None) -> list[Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    guard = route if route is not None else contextlib.nullcontext
    history = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
        with guard():
            scaled = scaler.scale(loss)
        scaled.backward()
        if step % 5 == 2:
            model[0].weight.grad[0, 0] = float("inf")
        with guard():
            scaler.unscale_(opt)
        scaler.step(opt)  # PyTorch's own step reads found_inf (its one sync)
        with guard():
            scaler.update()
        history.append(float(scaler.get_scale()))
    history.append([p.detach().clone() for p in model.parameters()])
    return history


def test_the_drop_in_trains_bit_for_bit_on_the_device_route(
    device_route: Callable[[], Any],
) -> None:
    """The drop-in's scale, unscale_ and update read nothing on the device route, and train
    exactly as the host route does (a skipped step, growth, the same parameters)."""
    with _restored_route():
        want = _train(12, None)
    got = _train(12, device_route)
    assert got[:-1] == want[:-1]
    for p, q in zip(got[-1], want[-1], strict=True):
        _assert_same(p, q, "parameters")


def test_the_guard_sees_a_host_read(device_route: Callable[[], Any]) -> None:
    """The guard is real: the host route's own read of a CPU scale trips it."""
    with device_route(), pytest.raises(HostReadError):
        float(torch.tensor(2.0))


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_a_fused_optimizers_check_fails_closed_on_a_bad_device_scale(
    device_route: Callable[[], Any], bad: float
) -> None:
    """A fused optimizer divides by the scale itself; the check before it must flag a bad
    device scale (NaN after the backend's check) rather than let it write NaN weights."""
    grads = [torch.ones(4), torch.ones(3, dtype=torch.float16)]
    found = {torch.device("cpu"): torch.zeros(())}
    with device_route():
        inv, check = _torch.inverse_scale(torch.tensor(bad))
        assert check is None  # decided on the device
        torch_kernels.check_for_fused(torch_kernels.buckets(grads), inv, found)
    assert float(found[torch.device("cpu")]) == 1.0


def _float32_ulps(a: Any, b: Any) -> float:
    x, y = np.float32(float(a)), np.float32(float(b))
    return float(abs(np.float64(x) - np.float64(y)) / np.spacing(max(abs(x), abs(y))))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [65536.0, 3.0, 0.25, "tensor", "tensor-below-one"])
@pytest.mark.parametrize("special", [False, True])
def test_the_fold_reads_on_the_device_route_and_writes_nothing(
    device_route: Callable[[], Any], dtype: torch.dtype, scale: Any, special: bool
) -> None:
    """``fold_clip`` (what ``clip_and_step`` hands a fused optimizer) on the device route:
    no host read, no gradient written, the host route's flag, its norm within a float32
    ulp (bit for bit at a power-of-two scale), and the divisor with it."""
    host_scale = {"tensor": 512.0, "tensor-below-one": 0.125}.get(scale, scale)
    with _restored_route():
        want_found, want_norm, want_divisor = _ops.fold_clip(
            _torch.BACKEND, _grads(dtype, 0, special), torch.tensor(host_scale), 0.5
        )
    grads = _grads(dtype, 0, special)
    scaled = [g.clone() for g in grads]
    dev_scale = torch.tensor(host_scale) if isinstance(scale, str) else scale
    with device_route():
        found, norm, divisor = _ops.fold_clip(_torch.BACKEND, grads, dev_scale, 0.5)
    for g, s in zip(grads, scaled, strict=True):
        assert np.array_equal(_bits(g), _bits(s)), "a gradient was written"
    assert bool(found) == bool(want_found) == special
    if not special:
        exact = math.log2(host_scale).is_integer()
        assert _float32_ulps(norm, want_norm) <= (0 if exact else 1)
        assert _float32_ulps(divisor, want_divisor) <= (0 if exact else 2)


def test_the_folded_step_trains_as_the_host_route_and_reads_once(
    device_route: Callable[[], Any],
) -> None:
    """``clip_and_step`` with a fused AdamW on the device route: the host route's
    parameters and scales bit for bit (skips and growth included); after the first step
    (which reads its flag once: a fused step skipped there would leave fused SGD's
    momentum uninitialised; it reads again until a step is taken) nothing is read back."""

    def train(route: Callable[[], Any] | None) -> list[Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
        scaler = GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
        gen = torch.Generator().manual_seed(1)
        history: list[Any] = []
        for step in range(10):
            opt.zero_grad()
            guard = route if route is not None and step > 0 else contextlib.nullcontext
            loss = model(torch.randn(4, 8, generator=gen)).pow(2).mean()
            with guard():
                scaled = scaler.scale(loss)
            scaled.backward()
            if step in (2, 5):
                model[0].weight.grad[0, 0] = float("inf")
            with guard():
                norm = scaler.clip_and_step(opt, 0.05)
                scaler.update()
            history.append((scaler.get_scale(), float(norm)))
        return [history, [p.detach().clone() for p in model.parameters()]]

    with _restored_route():
        want = train(None)
    got = train(device_route)
    assert [s for s, _ in got[0]] == [s for s, _ in want[0]]
    assert len({s for s, _ in got[0]}) > 2  # it backed off and grew
    for (_, a), (_, b) in zip(got[0], want[0], strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == b
    for p, q in zip(got[1], want[1], strict=True):
        _assert_same(p, q, "parameters")
