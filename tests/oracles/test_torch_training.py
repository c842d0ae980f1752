"""``scaler_core.torch.GradScaler`` trains bit for bit as ``torch.amp.GradScaler`` does.

Each case trains the same small two-branch model twice from the same seed, once with
each scaler, for 500 steps under ``torch.autocast`` on the CPU: two optimizers (one per
branch), gradient accumulation over two micro-batches, clipping between ``unscale_`` and
``step`` on every other step, and inf or NaN written into a random gradient at random
steps (so one optimizer skips while the other steps). After every step the parameters,
both optimizers' states, the scale and the state dict must be equal, to the bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is the oracle for these tests")

from scaler_core.torch import GradScaler  # noqa: E402

pytestmark = pytest.mark.torch
STEPS = 500


def _optimizer(name: str, params: Any) -> Any:
    kind, form = name.split("-")
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    kwargs: dict[str, Any] = {"lr": 0.05, "momentum": 0.9} if kind == "sgd" else {"lr": 1e-2}
    if form == "forloop":
        kwargs["foreach"] = False
    elif form == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["fused"] = True
    return cls(params, **kwargs)


OPTIMIZERS = [f"{k}-{f}" for k in ("sgd", "adam", "adamw") for f in ("forloop", "foreach", "fused")]


def _train(
    make_scaler: Callable[[], Any], optimizer: str, dtype: Any, record: Callable[..., None]
) -> None:
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh())
    head = torch.nn.Linear(16, 4)
    optimizers = [
        _optimizer(optimizer, encoder.parameters()),
        _optimizer(optimizer, head.parameters()),
    ]
    scaler = make_scaler()
    rng = np.random.default_rng(1)
    params = [*encoder.parameters(), *head.parameters()]
    for step in range(STEPS):
        for opt in optimizers:
            opt.zero_grad()
        for _ in range(2):  # two accumulated micro-batches
            x, y = torch.randn(16, 8), torch.randn(16, 4)
            with torch.autocast("cpu", dtype=dtype):
                loss = torch.nn.functional.mse_loss(head(encoder(x)).float(), y)
            scaler.scale(loss).backward()
        if rng.random() < 0.08:  # an overflow in one branch's gradients
            victim = params[int(rng.integers(len(params)))]
            assert victim.grad is not None
            victim.grad.view(-1)[0] = float(rng.choice([np.inf, -np.inf, np.nan]))
        if step % 2:
            for opt in optimizers:  # clip per optimizer: a NaN norm must not cross over
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 1.0)
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        record(step, scaler, params, optimizers)


def _snapshot(scaler: Any, params: list[Any], optimizers: list[Any]) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in params],
        "scale": scaler.get_scale(),
        "state_dict": {k: v for k, v in scaler.state_dict().items() if k != "scaler_core"},
        "opt": [
            {
                i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for i, s in enumerate(opt.state.values())
            }
            for opt in optimizers
        ],
    }


def _same(a: Any, b: Any) -> bool:
    """Equal to the bit: tensors by their bytes (so NaN equals the same NaN)."""
    if torch.is_tensor(a):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_training_is_bit_identical_to_torch_amp_gradscaler(optimizer: str, dtype: Any) -> None:
    theirs: list[dict[str, Any]] = []
    ours: list[dict[str, Any]] = []

    def make(cls: Any) -> Callable[[], Any]:
        return lambda: cls("cpu", init_scale=2.0**12, growth_interval=20)

    _train(make(torch.amp.GradScaler), optimizer, dtype, lambda s, *a: theirs.append(_snapshot(*a)))
    split: list[bool] = []  # steps where one optimizer ran and the other skipped

    def record_ours(step: int, scaler: Any, params: list[Any], optimizers: list[Any]) -> None:
        ours.append(_snapshot(scaler, params, optimizers))
        split.append(scaler.stepped(optimizers[0]) != scaler.stepped(optimizers[1]))

    _train(make(GradScaler), optimizer, dtype, record_ours)
    assert any(split), "an overflow in one branch should skip only that branch's optimizer"
    scales = [t["scale"] for t in theirs]
    assert len(set(scales)) > 3, "the run should grow and back off the scale"
    for step, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        for key in t:
            assert _same(t[key], o[key]), f"step {step}: {key} differs"


def test_a_factor_float32_cannot_hold_trains_as_pytorch_does() -> None:
    """backoff_factor=0.9, growth_factor=1.1: PyTorch multiplies in float64; so does ours."""
    theirs: list[float] = []
    ours: list[float] = []
    for cls, out in ((torch.amp.GradScaler, theirs), (GradScaler, ours)):
        scaler = cls(
            "cpu", init_scale=3.0, growth_factor=1.1, backoff_factor=0.9, growth_interval=2
        )
        rng = np.random.default_rng(3)
        w = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([w], lr=0.1)
        for _ in range(300):
            opt.zero_grad()
            scaler.scale((w * 2).sum()).backward()
            if rng.random() < 0.3:
                assert w.grad is not None
                w.grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            out.append(scaler.get_scale())
    assert ours == theirs
    assert len(set(ours)) > 10
