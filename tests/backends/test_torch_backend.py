"""What only the torch backend has: sparse gradients, tensors that require grad, the
unscale's own overflow that PyTorch's kernel misses, scales held in tensors, dispatch.
The rules every backend keeps are checked once, for every backend, in
``test_contract.py``."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch backend needs torch")

import scaler_core as sc  # noqa: E402
from scaler_core import _ops  # noqa: E402

BACKEND = sc.get_backend("torch")


def test_torch_tensors_pick_the_torch_backend() -> None:
    grads = {"w": torch.full((3,), 4.0), "b": [None, torch.full((2,), 8.0, dtype=torch.bfloat16)]}
    out, found = sc.unscale(grads, 4.0)
    assert out is grads
    assert grads["w"].tolist() == [1.0] * 3
    assert grads["b"][1].tolist() == [2.0, 2.0]
    assert found.dtype == torch.bool
    assert found.shape == ()
    assert not bool(found)


def test_an_overflow_made_by_the_unscale_is_found_where_pytorchs_kernel_misses_it() -> None:
    """Below a scale of 1 the inverse can turn a finite float16 into inf: PyTorch's kernel
    checks its input and misses it; the rules check the unscaled values."""
    g = torch.tensor([60000.0, 1.0], dtype=torch.float16)
    theirs = g.clone()
    found_inf = torch.zeros(())
    torch._amp_foreach_non_finite_check_and_unscale_([theirs], found_inf, torch.full((), 2.0))
    assert found_inf.item() == 0.0  # missed ...
    assert torch.isinf(theirs[0])  # ... though the result is inf
    for scale in (0.5, torch.tensor(0.5)):
        ours = g.clone()
        _, found = _ops.unscale(BACKEND, [ours], scale)
        assert bool(found)
        assert torch.isinf(ours[0])


def test_gradients_of_parameters_that_require_grad_are_unscaled_in_place() -> None:
    layer = torch.nn.Linear(3, 2)
    layer(torch.ones(4, 3)).sum().mul(1024.0).backward()
    weight_grad = layer.weight.grad
    assert weight_grad is not None
    before = weight_grad.clone()
    _ops.unscale(BACKEND, [p.grad for p in layer.parameters()], 1024.0)
    assert layer.weight.grad is weight_grad
    torch.testing.assert_close(weight_grad, before / 1024.0, rtol=0, atol=0)
    _ops.unscale(BACKEND, [layer.weight], 2.0)  # a parameter itself, under no_grad


def test_sparse_gradients_are_unscaled_and_float16_ones_coalesced_first() -> None:
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([16.0, 32.0, 64.0])
    dense = torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True)
    _, found = _ops.unscale(BACKEND, [dense], 4.0)
    assert not bool(found)
    assert dense._values().tolist() == [4.0, 8.0, 16.0]
    # float16 with duplicate indices: each value is finite, their sum overflows.
    dup_i = torch.tensor([[0, 1, 0], [2, 0, 2]])
    dup_v = torch.tensor([64000.0, 32.0, 64000.0], dtype=torch.float16)
    uncoalesced = torch.sparse_coo_tensor(dup_i, dup_v, (2, 3), check_invariants=True)
    out, found = _ops.unscale(BACKEND, {"g": uncoalesced}, 1.0)
    assert bool(found), "the coalesced sum overflows float16"
    assert out["g"] is not uncoalesced
    assert out["g"].is_coalesced()
    assert not BACKEND.to_bool(_ops.find_non_finite(BACKEND, [dense]))


def test_a_tensor_scale_must_hold_one_float() -> None:
    for bad in (torch.ones(2), torch.tensor(2)):
        with pytest.raises(sc.GradientValueError, match="a tensor scale must hold one float"):
            _ops.unscale(BACKEND, [torch.ones(2)], bad)
    with pytest.raises(sc.GradientValueError, match="scale="):
        _ops.unscale(BACKEND, [torch.ones(2)], torch.tensor(-2.0))  # a CPU tensor is read: refused


def test_a_sparse_csr_tensor_is_refused_by_name() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # CSR support is "beta" in torch
        csr = torch.eye(3).to_sparse_csr()
    with pytest.raises(sc.GradientTypeError, match=r"grads\[0\] has layout torch\.sparse_csr"):
        _ops.unscale(BACKEND, [csr], 2.0)


def test_the_device_transition_runs_on_tensors_and_equals_the_host() -> None:
    cfg = sc.ScalerConfig(growth_interval=2, min_scale=1.0, hysteresis=2, backoff_factor=0.9)
    host = sc.init(cfg)
    dev = sc.init(cfg)
    rng = np.random.default_rng(0)
    for found in (rng.random(60) < 0.4).tolist():
        host = sc.update(host, found)
        dev = sc.update(dev, torch.tensor(found))
        assert isinstance(dev.scale, torch.Tensor)
        assert dev.scale.dtype == torch.float32
        assert dev.to_host() == host


def test_import_scaler_core_never_imports_torch() -> None:
    code = (
        "import sys, numpy as np, scaler_core as sc; sc.unscale([np.ones(2)], 2.0); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str
)
@pytest.mark.parametrize("scale", [2.0**-7, 0.75, 1.0, 3.0, 2.0**24])
def test_the_route_for_devices_without_the_kernel_gives_the_kernels_bits(
    monkeypatch: pytest.MonkeyPatch, dtype: Any, scale: float
) -> None:
    """bfloat16 on CUDA (and other devices) unscales by _foreach_mul_: run it on the CPU."""
    from scaler_core.backends import torch_kernels

    gen = torch.Generator().manual_seed(7)
    base = [(torch.randn(257, generator=gen) * 10.0 ** float(e)).to(dtype) for e in (-6, 0, 3, 30)]
    base.append(torch.tensor([1.0, float("nan"), -float("inf")]).to(dtype))
    big = float(torch.finfo(dtype).max) / 2  # overflows below a scale of 1
    base.append(torch.full((4,), big, dtype=dtype))
    for picks in ([0, 1, 2], [0, 3], [4], [5], list(range(6))):
        grads = {
            "kernel": [base[i].clone() for i in picks],
            "mul": [base[i].clone() for i in picks],
        }
        _, found_kernel = _ops.unscale(BACKEND, grads["kernel"], scale)
        monkeypatch.setattr(torch_kernels, "kernel_takes", lambda device, dtype: False)
        _, found_mul = _ops.unscale(BACKEND, grads["mul"], scale)
        monkeypatch.undo()
        assert bool(found_kernel) == bool(found_mul), picks
        for a, b in zip(grads["kernel"], grads["mul"], strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), picks


def test_float64_values_beyond_float32s_range_are_finite() -> None:
    """The check reads each norm in its own dtype (a float32 cast made 1e300 inf)."""
    big = torch.tensor([1e300, -1e300], dtype=torch.float64)
    assert not bool(_ops.find_non_finite(BACKEND, [big]))
    _, found = _ops.unscale(BACKEND, [big.clone()], 0.5)  # below 1: the outputs are checked
    assert not bool(found)
    _, found = _ops.unscale(BACKEND, [big.clone()], 2.0**-100)  # 1e300 * 2**100 is inf in float64
    assert bool(found)


def test_empty_tensors_are_checked_like_any_other() -> None:
    torch = pytest.importorskip("torch")
    assert not bool(sc.find_non_finite([torch.zeros(0), torch.ones(2)]))
    assert bool(sc.find_non_finite([torch.zeros((0, 3)), torch.tensor([math.inf])]))
    assert not bool(sc.find_non_finite({"e": torch.zeros(0, dtype=torch.bfloat16)}))


def _embedding_grad(dtype: Any = torch.float32, scale: float = 1.0) -> Any:
    """An ``nn.Embedding(sparse=True)`` gradient with a repeated index: not coalesced."""
    torch.manual_seed(3)
    emb = torch.nn.Embedding(6, 4, sparse=True)
    weights = torch.randn(5, 4)
    (emb(torch.tensor([1, 4, 1, 1, 2])) * weights).sum().mul(scale).backward()
    grad = emb.weight.grad
    assert grad is not None
    assert grad.is_sparse
    assert not grad.is_coalesced()
    return grad.to(dtype)


def _their_clip(coalesced: Any, max_norm: float, norm: Any) -> Any:
    """PyTorch's clip of a coalesced gradient's values, for a given norm (its coefficient)."""
    values = torch.nn.Parameter(torch.zeros_like(coalesced._values()))
    values.grad = coalesced._values().clone()
    torch.nn.utils.clip_grads_with_norm_([values], max_norm, norm)
    return values.grad


def test_the_norm_and_clip_of_a_sparse_gradient_are_those_of_its_coalesced_sum() -> None:
    """Duplicate indices are summed before the norm (PyTorch's clip cannot take a sparse
    gradient at all: its oracle is clip_grad_norm_ on the coalesced gradient's values)."""
    scale, max_norm = 1024.0, 0.5
    grad = _embedding_grad(scale=scale)
    # PyTorch's route: GradScaler.unscale_ (the stored values), then coalesce.
    param = torch.nn.Parameter(torch.zeros(grad.shape))
    param.grad = grad.clone()
    theirs = torch.amp.GradScaler("cpu", init_scale=scale)
    theirs.scale(torch.ones(()))
    theirs.unscale_(torch.optim.SGD([param], lr=1.0))
    coalesced = param.grad.coalesce()
    their_norm = torch.nn.utils.get_total_norm([coalesced._values()])
    exact = math.sqrt(math.fsum(v * v for v in coalesced._values().double().flatten().tolist()))

    out, found, norm = sc.unscale_and_norm({"emb": grad.clone()}, scale)
    assert not bool(found)
    assert out["emb"].is_coalesced()
    assert torch.equal(out["emb"]._values(), coalesced._values())
    assert torch.equal(out["emb"]._indices(), coalesced._indices())
    assert float(norm) == pytest.approx(float(their_norm), rel=1e-6)
    assert float(norm) == float(np.float32(exact))  # float64 sum, rounded once

    out, found, norm = sc.unscale_and_clip({"emb": grad.clone()}, scale, max_norm)
    assert not bool(found)
    assert float(norm) == float(np.float32(exact))
    assert torch.equal(out["emb"]._indices(), coalesced._indices())
    clipped = _their_clip(coalesced, max_norm, norm)
    assert torch.equal(out["emb"]._values(), clipped)  # PyTorch's coefficient, bit for bit


def test_float16_duplicates_that_overflow_only_once_summed_are_seen_by_every_check() -> None:
    """unscale coalesces a float16 sparse gradient first, as PyTorch's GradScaler does;
    detection, the facade's detect and the leaf report see the same sum."""
    i = torch.tensor([[0, 1, 0]])
    v = torch.tensor([60000.0, 1.0, 60000.0], dtype=torch.float16)
    grad = torch.sparse_coo_tensor(i, v, (3,), check_invariants=True)
    param = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    param.grad = grad.clone()
    theirs = torch.amp.GradScaler("cpu", init_scale=1.0)
    opt = torch.optim.SGD([param], lr=1.0)
    theirs.scale(torch.ones(()))
    found = theirs._unscale_grads_(opt, torch.ones(()), torch.zeros(()), True)
    assert [f.item() for f in found.values()] == [1.0]  # PyTorch: inf once summed
    assert bool(sc.unscale([grad.clone()], 1.0)[1])
    assert bool(sc.find_non_finite([grad]))
    facade = sc.LossScaler()
    assert bool(facade.find_non_finite([grad]))
    assert [str(r) for r in sc.non_finite_leaves({"emb": grad})] == ["grads['emb']: 1 inf, 0 nan"]
    assert not grad.is_coalesced()  # the read-only checks left the caller's tensor as it was


def test_a_refused_sparse_call_changes_nothing() -> None:
    grad = _embedding_grad(scale=8.0)
    before = (grad._indices().clone(), grad._values().clone())
    bad = {"emb": grad, "w": torch.ones(2, dtype=torch.int32)}
    for call in (
        lambda: sc.unscale_and_clip(bad, 8.0, 1.0),
        lambda: sc.unscale_and_norm(bad, 8.0),
        lambda: sc.unscale({"emb": grad}, -1.0),
        lambda: sc.unscale_and_clip({"emb": grad}, 8.0, -1.0),
    ):
        with pytest.raises(sc.ScalerError):
            call()
        assert not grad.is_coalesced()
        assert torch.equal(grad._indices(), before[0])
        assert torch.equal(grad._values(), before[1])


def test_float_tensors_never_import_ml_dtypes(run_python: Any) -> None:
    """ml_dtypes (NumPy's bfloat16) takes over a second to import: the drop-in's step
    and the torch backend's operations on float16/32/64 CPU tensors run without it;
    a bfloat16 tensor imports it where its NumPy view needs it, and works."""
    code = """
import sys
import torch
import scaler_core as sc
from scaler_core.torch import GradScaler

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = GradScaler("cpu")
scaler.scale(model(torch.ones(2, 8)).sum()).backward()
scaler.unscale_and_clip_(opt, 1.0)
scaler.step(opt)
scaler.update()
for dtype in (torch.float16, torch.float32, torch.float64):
    grads = [torch.full((5,), 4.0, dtype=dtype), torch.full((3, 3), 4.0, dtype=dtype).t()]
    sc.unscale_and_clip(grads, 2.0, 1.0)
    sc.unscale_and_norm(grads, 2.0)
    sc.find_non_finite(grads)
    sc.non_finite_leaves(grads)
assert "ml_dtypes" not in sys.modules, "a float tensor imported ml_dtypes"
g = [torch.full((4,), 4.0, dtype=torch.bfloat16), torch.full((3, 3), 4.0, dtype=torch.bfloat16).t()]
_, found, norm = sc.unscale_and_clip(g, 2.0, 100.0)
assert not bool(found) and all(bool((t == 2.0).all()) for t in g), g
print("ok")
"""
    assert run_python(code).split() == ["ok"]


def _clamped_coefficient(norm: Any, max_norm: float) -> Any:
    """The clip coefficient as the torch backend formed it before the kernel protocol
    (and ``clip_grads_with_norm_`` forms it): a reciprocal, a product, a clamp."""
    return torch.clamp((norm + float(np.float32(1e-6))).reciprocal() * max_norm, max=1.0)


def _coefficient_norms() -> Any:
    """float32 norms of every kind: random bits (subnormals, huge values, NaN payloads
    of both signs, infinities), random magnitudes, and the edges."""
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore"):
        magnitudes = np.exp(rng.uniform(-100, 90, 50_000)).astype(np.float32)
    edges = np.array(
        [0.0, -0.0, 1e-45, 1e-40, 1.2e-38, 3.4e38, np.inf, -np.inf, np.nan, 1.0, 1e-6],
        np.float32,
    )
    return torch.from_numpy(np.concatenate([bits, magnitudes, edges]))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)
def test_the_clip_coefficient_on_tensors_is_the_clamped_reciprocal_bit_for_bit(
    device: str,
) -> None:
    """``_ops.clip_coefficient`` over :class:`TorchNamespace` (one divided by the
    denominator, ``minimum`` as a select) gives the bits of the reciprocal and clamp it
    replaced, NaN payloads included, element by element and as the 0-d tensor the clip
    uses."""
    from scaler_core.backends._torch import TorchNamespace

    norms = _coefficient_norms().to(device)
    xp = TorchNamespace(norms.device)
    for max_norm in (1.0, 0.5, 2.0, 1e-30, 3.4028234663852886e38, 1.4e-45, 7.3, 123456.789):
        got = _ops.clip_coefficient(xp, norms, max_norm)
        want = _clamped_coefficient(norms, max_norm)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), max_norm
        for norm in norms[::997]:
            got = _ops.clip_coefficient(xp, norm, max_norm)
            assert got.shape == ()
            assert got.view(torch.int32).item() == (
                _clamped_coefficient(norm, max_norm).view(torch.int32).item()
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_device_route_clips_with_pytorchs_coefficient_and_a_skip_leaves_values_unscaled(
    monkeypatch: pytest.MonkeyPatch, dtype: Any
) -> None:
    """Off the CPU route (as on an accelerator, driven here with CPU tensors) the measure
    unscales in place and the clip pass multiplies by the coefficient, 1 on a skipped step:
    PyTorch's clip of the unscaled values, and on a skip the values ``unscale_`` leaves."""
    from scaler_core.backends import _torch

    monkeypatch.setattr(_torch, "_route", lambda *a, **k: None)
    gen = torch.Generator().manual_seed(5)
    host = [(torch.randn(n, generator=gen) * 300).to(dtype) for n in (1000, 7, 33)]
    scale, max_norm = 1024.0, 0.5
    unscaled = [t.clone() for t in host]
    _ops.unscale(BACKEND, unscaled, scale)
    ours = [t.clone() for t in host]
    out, found, norm = sc.unscale_and_clip(ours, scale, max_norm)
    assert out is ours
    assert not bool(found)
    params = [torch.nn.Parameter(torch.zeros_like(u)) for u in unscaled]
    for p, u in zip(params, unscaled, strict=True):
        p.grad = u.clone()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    for p, o in zip(params, ours, strict=True):
        assert torch.equal(p.grad.view(torch.uint8), o.view(torch.uint8))
    # a skip decided by reduce (another group's inf): unscaled, not clipped
    skipped = [t.clone() for t in host]
    _, found, _ = _ops.unscale_and_clip(BACKEND, skipped, scale, max_norm, lambda f: f | True)
    assert bool(found)
    for u, s in zip(unscaled, skipped, strict=True):
        assert torch.equal(u.view(torch.uint8), s.view(torch.uint8))


def test_clip_without_a_read_only_measure_is_refused() -> None:
    for grads in ([torch.ones(3)], [torch.ones(3).to_sparse()]):
        handle = BACKEND.plan(grads, writable=True)
        with pytest.raises(sc.LifecycleError, match=r"measure\(write=False\)"):
            BACKEND.clip(handle, 2.0, torch.tensor(1.0), 1.0, torch.tensor(False))
        _, _, norm = BACKEND.measure(handle, 2.0, write=False)
        BACKEND.clip(handle, 2.0, norm, 1.0, torch.tensor(False))
        with pytest.raises(sc.LifecycleError):  # one clip per measure
            BACKEND.clip(handle, 2.0, norm, 1.0, torch.tensor(False))
