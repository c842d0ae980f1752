"""The torch drop-in and backend on a CUDA GPU (skipped cleanly without one).

What only a GPU shows: training bit for bit as ``torch.amp.GradScaler`` there, no host
synchronisation in ``step``/``update`` with a fused optimizer (under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronising call),
a collapse recorded on the device and raised at the next host look, bfloat16
gradients (PyTorch's CUDA kernel has none), scales below 1 decided on the device, and
the clip's coefficient formed there with PyTorch's bits.
``benchmarks/gpu_check.sh`` runs this file on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")

import scaler_core as sc  # noqa: E402
from scaler_core import _ops  # noqa: E402
from scaler_core.torch import GradScaler  # noqa: E402

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
CUDA = "cuda"


@pytest.fixture
def no_sync() -> Iterator[None]:
    """Any synchronising call inside raises a RuntimeError."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _train(cls: Any, optimizer: str, steps: int, **kwargs: Any) -> list[Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)
    ).to(CUDA)
    form = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **form[optimizer])
    scaler = cls(CUDA, init_scale=2.0**14, growth_interval=10, **kwargs)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    history = []
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 16, device=CUDA, generator=gen)
        with torch.autocast(CUDA, dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step % 7 == 3:
            model[0].weight.grad[0, 0] = float("inf") if step % 2 else float("nan")
        if step % 3 == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        history.append(
            (
                [p.detach().clone() for p in model.parameters()],
                scaler.get_scale(),
                {k: v for k, v in scaler.state_dict().items() if k != "scaler_core"},
            )
        )
    return history


@pytest.mark.parametrize("optimizer", ["forloop", "foreach", "fused"])
def test_training_on_cuda_is_bit_identical_to_pytorchs(optimizer: str) -> None:
    theirs = _train(torch.amp.GradScaler, optimizer, 120)
    ours = _train(GradScaler, optimizer, 120)
    for step, ((pt, st, dt), (po, so, do)) in enumerate(zip(theirs, ours, strict=True)):
        assert st == so, step
        assert dt == do, step
        for a, b in zip(pt, po, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), step
    assert len({s for _, s, _ in ours}) > 2


def test_a_factor_float32_cannot_hold_matches_pytorch_on_cuda() -> None:
    theirs = _train(torch.amp.GradScaler, "fused", 60, backoff_factor=0.9, growth_factor=1.1)
    ours = _train(GradScaler, "fused", 60, backoff_factor=0.9, growth_factor=1.1)
    assert [s for _, s, _ in ours] == [s for _, s, _ in theirs]


@pytest.mark.parametrize("init_scale", [2.0**14, 0.25])
def test_step_and_update_with_a_fused_optimizer_never_synchronise(init_scale: float) -> None:
    model = torch.nn.Linear(64, 64).to(CUDA)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    scaler = GradScaler(CUDA, init_scale=init_scale)
    for step in range(5):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 64, device=CUDA)).sum()).backward()
        if step == 2:
            model.weight.grad[0, 0] = float("inf")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert scaler.state.skipped_steps == 1


def test_a_collapse_on_the_device_is_raised_at_the_next_host_look() -> None:
    config = sc.ScalerConfig(init_scale=2.0**-126, growth_interval=10)
    scaler = GradScaler(CUDA, config=config)
    w = torch.nn.Parameter(torch.ones(4, device=CUDA))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    assert w.grad is not None
    w.grad[0] = float("nan")
    scaler.step(opt)
    scaler.update()  # no sync: the refusal is recorded on the device
    with pytest.raises(sc.ScaleCollapseError, match="not a normal float32"):
        scaler.get_scale()
    with pytest.raises(sc.ScaleCollapseError):
        _ = scaler.state


def test_bfloat16_gradients_unscale_on_cuda_as_on_the_cpu() -> None:
    backend = sc.get_backend("torch")
    gen = torch.Generator().manual_seed(3)
    host = [torch.randn(1000, generator=gen).to(torch.bfloat16) * 100 for _ in range(3)]
    host[1][5] = float("inf")
    for scale in (2.0**10, 0.5):
        cpu = [t.clone() for t in host]
        gpu = [t.clone().to(CUDA) for t in host]
        _, found_cpu = _ops.unscale(backend, cpu, scale)
        _, found_gpu = _ops.unscale(backend, gpu, scale)
        assert bool(found_cpu)
        assert bool(found_gpu)
        for a, b in zip(cpu, gpu, strict=True):
            assert torch.equal(a.view(torch.int16), b.cpu().view(torch.int16))


def test_a_scale_below_one_on_the_device_is_decided_there(no_sync: None) -> None:
    backend = sc.get_backend("torch")
    grads = [torch.full((8,), 60000.0, dtype=torch.float16, device=CUDA)]
    _, found = _ops.unscale(backend, grads, torch.tensor(0.5, device=CUDA))  # 120000 overflows f16
    torch.cuda.set_sync_debug_mode("default")  # reading the flag is the one sync
    assert bool(found)
    grads = [torch.full((8,), 6000.0, dtype=torch.float16, device=CUDA)]
    _, found = _ops.unscale(backend, grads, torch.tensor(0.5, device=CUDA))
    assert not bool(found)


def test_unscale_and_clip_on_cuda_never_synchronises_and_clips_as_pytorch() -> None:
    """The device route: the measure unscales in place, the clip pass multiplies by the
    coefficient (``_ops.clip_coefficient`` on the device, 1 where the step is skipped),
    with no host synchronisation; the result is PyTorch's clip of the unscaled values,
    and a skip leaves them unscaled."""
    backend = sc.get_backend("torch")
    gen = torch.Generator(device=CUDA).manual_seed(2)
    cases = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        host = [(torch.randn(n, device=CUDA, generator=gen) * 300).to(dtype) for n in (1000, 7)]
        cases.append((host, [t.clone() for t in host], [t.clone() for t in host]))
    scale = torch.tensor(1024.0, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = []
        for _, ours, skipped in cases:
            _, found, norm = sc.unscale_and_clip(ours, scale, 0.5)
            _, skip, _ = _ops.unscale_and_clip(backend, skipped, scale, 0.5, lambda f: f | True)
            results.append((found, norm, skip))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for (host, ours, skipped), (found, norm, skip) in zip(cases, results, strict=True):
        unscaled = [t.clone() for t in host]
        _ops.unscale(backend, unscaled, scale)
        assert not bool(found)
        assert bool(skip)
        params = [torch.nn.Parameter(torch.zeros_like(u)) for u in unscaled]
        for p, u in zip(params, unscaled, strict=True):
            p.grad = u.clone()
        torch.nn.utils.clip_grads_with_norm_(params, 0.5, norm)
        for p, o, s, u in zip(params, ours, skipped, unscaled, strict=True):
            assert torch.equal(p.grad.view(torch.uint8), o.view(torch.uint8))
            assert torch.equal(s.view(torch.uint8), u.view(torch.uint8))


def test_the_clip_coefficient_on_cuda_is_the_clamped_reciprocal_bit_for_bit() -> None:
    """``_ops.clip_coefficient`` over the torch namespace on the GPU: the bits of
    ``clamp(reciprocal(norm + 1e-6) * max_norm, max=1)`` there, NaN payloads included
    (the GPU's own: it need not keep the CPU's)."""
    import numpy as np

    from scaler_core.backends._torch import TorchNamespace

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, 1e-45, 1e-40, 3.4e38, np.inf, np.nan, 1.0, 1e-6], np.float32)
    gpu = torch.from_numpy(np.concatenate([bits, edges])).to(CUDA)
    for max_norm in (1.0, 0.5, 1e-30, 3.4028234663852886e38, 7.3):
        got = _ops.clip_coefficient(TorchNamespace(gpu.device), gpu, max_norm)
        want = torch.clamp((gpu + float(np.float32(1e-6))).reciprocal() * max_norm, max=1.0)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), max_norm
