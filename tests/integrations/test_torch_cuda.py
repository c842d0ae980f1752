"""The torch drop-in and backend on a CUDA GPU (skipped cleanly without one).

What only a GPU shows: training bit for bit as ``torch.amp.GradScaler`` there, no host
synchronisation in ``step``/``update`` with a fused optimizer (under
``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronising call),
a collapse recorded on the device and raised at the next host look, bfloat16
gradients (PyTorch's CUDA kernel has none) and scales below 1 decided on the device.
``benchmarks/gpu_check.sh`` runs this file on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")

import scaler_core as sc  # noqa: E402
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
        _, found_cpu = backend.unscale(cpu, scale)
        _, found_gpu = backend.unscale(gpu, scale)
        assert bool(found_cpu)
        assert bool(found_gpu)
        for a, b in zip(cpu, gpu, strict=True):
            assert torch.equal(a.view(torch.int16), b.cpu().view(torch.int16))


def test_a_scale_below_one_on_the_device_is_decided_there(no_sync: None) -> None:
    backend = sc.get_backend("torch")
    grads = [torch.full((8,), 60000.0, dtype=torch.float16, device=CUDA)]
    _, found = backend.unscale(grads, torch.tensor(0.5, device=CUDA))  # 120000 overflows f16
    torch.cuda.set_sync_debug_mode("default")  # reading the flag is the one sync
    assert bool(found)
    grads = [torch.full((8,), 6000.0, dtype=torch.float16, device=CUDA)]
    _, found = backend.unscale(grads, torch.tensor(0.5, device=CUDA))
    assert not bool(found)
