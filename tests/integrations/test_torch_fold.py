"""``GradScaler.clip_and_step``: ``unscale_``, ``clip_grad_norm_`` and ``step`` in one call.

For a fused optimizer the clip is folded into the optimizer's own pass (it divides by
``scale / coef``): a read of the gradients and no write of ours. Checked here against
the unfolded recipe (``unscale_and_clip_`` then ``step``, itself PyTorch's recipe bit
for bit for the same norm) step by step over randomized runs: the same norm and
decision every step, the gradient the optimizer used within one ulp of the recipe's,
the parameters within ``ULPS``, and a skipped step leaving parameters and optimizer
state bit for bit.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")

from scaler_core import InvalidArgumentError  # noqa: E402
from scaler_core.torch import GradScaler  # noqa: E402

pytestmark = pytest.mark.torch

#: The parameters after one folded step against the recipe's, in float32 ulps of the
#: largest of each value's old and new magnitudes and the learning rate (docs/pytorch.md
#: states it; 2 was the most measured over 270 runs of 12 steps).
ULPS = 4.0

FUSED = {
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "Adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, fused=True),
}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _ulps(
    new: torch.Tensor, ref: torch.Tensor, old: torch.Tensor | None = None, lr: float = 0.0
) -> float:
    """``|new - ref|`` in float32 ulps of the largest magnitude among the values given
    (and ``lr``: a step moves a parameter by about that much)."""
    tensors = [new, ref] if old is None else [new, ref, old]
    top = np.max([np.abs(t.detach().float().numpy()) for t in tensors], axis=0)
    top = np.maximum(top, np.float32(lr))
    diff = np.abs(new.detach().double().numpy() - ref.detach().double().numpy())
    return float(np.max(diff / np.spacing(top.astype(np.float32)).astype(np.float64), initial=0))


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v.clone() for s in opt.state.values() for v in s.values()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit for bit (a NaN equals a NaN of the same bits)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True)
    )


class Twin:
    """A model, its optimizer and a scaler, copied whole so two calls start alike."""

    def __init__(self, name: str, seed: int, init_scale: float, interval: int) -> None:
        self.name = name
        self.model = _model(seed)
        self.params = list(self.model.parameters())
        self.opt = FUSED[name](self.params)
        self.scaler = GradScaler("cpu", init_scale=init_scale, growth_interval=interval)

    def copy(self) -> Twin:
        twin = copy.copy(self)
        twin.model = copy.deepcopy(self.model)
        twin.params = list(twin.model.parameters())
        twin.opt = FUSED[self.name](twin.params)
        twin.opt.load_state_dict(copy.deepcopy(self.opt.state_dict()))
        twin.scaler = GradScaler("cpu")
        twin.scaler.load_state_dict(self.scaler.state_dict())
        for p, q in zip(twin.params, self.params, strict=True):
            p.grad = None if q.grad is None else q.grad.clone()
        return twin

    def backward(self, x: torch.Tensor, poison: bool) -> None:
        loss = self.model(x).float().square().mean()
        self.scaler.scale(loss).backward()
        if poison:
            self.params[0].grad[0, 0] = math.inf


def _compare_step(ref: Twin, max_norm: float) -> dict[str, Any]:
    """From ``ref``'s state, the recipe's step on ``ref`` and the folded one on a copy."""
    fold = ref.copy()
    fold.scaler.scale(torch.zeros(()))  # the copy's scale tensor, as a step makes it
    before = [p.detach().clone() for p in ref.params]
    state_before = _state(ref.opt)
    norm = ref.scaler.unscale_and_clip_(ref.opt, max_norm)
    used = [p.grad.clone() for p in ref.params]
    ref.scaler.step(ref.opt)
    state_after = _state(ref.opt)
    folded_norm = fold.scaler.clip_and_step(fold.opt, max_norm)
    out = {
        "norms": (float(folded_norm), float(norm)),
        "stepped": (fold.scaler.stepped(fold.opt), ref.scaler.stepped(ref.opt)),
        "grad_ulps": max(
            _ulps(p.grad, g) for p, g in zip(fold.params, used, strict=True) if g.isfinite().all()
        )
        if ref.scaler.stepped(ref.opt)
        else 0.0,
        "param_ulps": max(
            _ulps(p, q, b, ref.opt.defaults["lr"])
            for p, q, b in zip(fold.params, ref.params, before, strict=True)
        ),
        "fold": fold,
        "before": before,
        "state_before": state_before,
        "state_after": state_after,
    }
    ref.scaler.update()
    fold.scaler.update()
    out["scales"] = (fold.scaler.get_scale(), ref.scaler.get_scale())
    return out


@pytest.mark.parametrize("name", sorted(FUSED))
@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    max_norm=st.sampled_from([0.05, 0.5, 1e6]),
    init_scale=st.sampled_from([2.0**10, 2.0**24, 3.0 * 2.0**10]),
    poisoned=st.sets(st.integers(0, 11), max_size=3),
)
def test_the_folded_step_tracks_the_recipe_step_by_step(
    name: str, seed: int, max_norm: float, init_scale: float, poisoned: set[int]
) -> None:
    """A randomized run (clipping or not, skips, growth every 2 steps, backoffs from a
    scale of 2**24 on float32 gradients): each step taken both ways from the recipe's
    state. Norm, decision and scale always equal; the optimizer's gradient within 1 ulp
    (2 at a scale that is not a power of two: the recipe rounds three times, the fold
    twice) and the parameters within ``ULPS``; bit for bit where nothing is clipped at a
    power-of-two scale; a skipped step changes no parameter, and leaves the optimizer
    state the recipe leaves (the fused step is called with ``found_inf``, as PyTorch's
    class calls it: a skipped first step creates the state, zeros, and a later one
    changes none)."""
    ref = Twin(name, seed, init_scale, interval=2)
    gen = torch.Generator().manual_seed(seed)
    exact = math.log2(init_scale).is_integer()  # unscaling by a power of two is exact
    for i in range(12):
        ref.backward(torch.randn(8, 16, generator=gen) * 4, poison=i in poisoned)
        got = _compare_step(ref, max_norm)
        a, b = got["norms"]
        assert a == b or (math.isnan(a) and math.isnan(b)), (i, a, b)
        assert got["stepped"][0] == got["stepped"][1] == (i not in poisoned and math.isfinite(b))
        assert got["scales"][0] == got["scales"][1]
        assert got["grad_ulps"] <= (1.0 if exact else 2.0), (i, got["grad_ulps"])
        assert got["param_ulps"] <= ULPS, (i, got["param_ulps"])
        clipped = b > max_norm
        if not clipped and exact:
            assert got["param_ulps"] == 0.0, i
        if not got["stepped"][0]:
            fold = got["fold"]
            assert _equal([p.detach() for p in fold.params], got["before"])
            assert _equal(_state(fold.opt), got["state_after"])
            if got["state_before"]:
                assert _equal(_state(fold.opt), got["state_before"])
        ref.opt.zero_grad()


@pytest.mark.parametrize("name", sorted(FUSED))
def test_the_optimizer_stepped_on_the_gradient_the_fold_left(name: str) -> None:
    """What the fold leaves in ``.grad`` is what the optimizer used: the same optimizer,
    stepped without a ``grad_scale`` on those gradients, lands on the same parameters
    and state bit for bit (so the update is the optimizer's own on a gradient within
    an ulp of the recipe's clipped one)."""
    ref = Twin(name, 3, 2.0**12, interval=2000)
    ref.backward(torch.randn(8, 16) * 4, poison=False)
    twin = ref.copy()
    norm = ref.scaler.clip_and_step(ref.opt, 0.1)
    assert float(norm) > 0.1  # it clipped
    for p, q in zip(twin.params, ref.params, strict=True):
        p.grad = q.grad.clone()
    twin.opt.step()
    assert _equal([p.detach() for p in twin.params], [p.detach() for p in ref.params])
    assert _equal(_state(twin.opt), _state(ref.opt))


def test_gradient_accumulation_then_the_folded_step() -> None:
    """Two micro-batches accumulated, then one folded step: as the recipe."""
    ref = Twin("AdamW", 5, 2.0**16, interval=2000)
    for _ in range(2):
        ref.backward(torch.randn(8, 16) * 4, poison=False)
    got = _compare_step(ref, 0.2)
    assert got["norms"][0] == got["norms"][1] > 0.2
    assert got["param_ulps"] <= ULPS


def test_other_optimizers_and_other_clips_take_the_recipe_bit_for_bit() -> None:
    """A foreach (unfused) optimizer, or a clip the fold does not do (an inf norm, a
    subset of the parameters), is ``unscale_and_clip_`` then ``step``: bit for bit."""
    cases = [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True), {}),
        (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), {}),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), {"norm_type": math.inf}),
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), {"subset": True}),
    ]
    for make, kwargs in cases:
        results = []
        for fold in (True, False):
            model = _model(7)
            params = list(model.parameters())
            opt = make(params)
            scaler = GradScaler("cpu", init_scale=2.0**10)
            extra = {"norm_type": kwargs["norm_type"]} if "norm_type" in kwargs else {}
            if kwargs.get("subset"):
                extra["parameters"] = params[:2]
            gen = torch.Generator().manual_seed(1)
            norms = []
            for _ in range(3):
                scaler.scale(model(torch.randn(8, 16, generator=gen)).square().sum()).backward()
                if fold:
                    norms.append(float(scaler.clip_and_step(opt, 0.3, **extra)))
                else:
                    norms.append(float(scaler.unscale_and_clip_(opt, 0.3, **extra)))
                    scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            results.append((norms, [p.detach().clone() for p in params]))
        (n1, p1), (n2, p2) = results
        assert n1 == n2, kwargs
        assert _equal(p1, p2), kwargs


def test_it_reads_the_gradients_once_and_writes_none_before_the_optimizer() -> None:
    """Before the optimizer's own pass, the gradients are untouched: the fold hands the
    optimizer ``scale / coef`` and the flag, and nothing else writes them."""
    ref = Twin("AdamW", 2, 2.0**10, interval=2000)
    ref.backward(torch.randn(8, 16) * 4, poison=False)
    scaled = [p.grad.clone() for p in ref.params]
    seen: dict[str, Any] = {}
    real_step = ref.opt.step

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen["grads"] = [p.grad.clone() for p in ref.params]
        seen["grad_scale"] = ref.opt.grad_scale.clone()  # type: ignore[attr-defined]
        seen["found_inf"] = ref.opt.found_inf.clone()  # type: ignore[attr-defined]
        return real_step(*args, **kwargs)

    ref.opt.step = spy  # type: ignore[method-assign]
    norm = ref.scaler.clip_and_step(ref.opt, 0.1)
    assert _equal(seen["grads"], scaled)
    coef = min(1.0, float(np.float32(1.0) / (np.float32(norm) + np.float32(1e-6)) * 0.1))
    assert float(seen["grad_scale"]) == pytest.approx(2.0**10 / coef, rel=1e-6)
    assert float(seen["found_inf"]) == 0.0
    assert not hasattr(ref.opt, "grad_scale")
    assert not hasattr(ref.opt, "found_inf")


def test_it_refuses_what_unscale_refuses_and_bad_arguments_before_anything_changes() -> None:
    ref = Twin("AdamW", 4, 2.0**10, interval=2000)
    ref.backward(torch.randn(8, 16), poison=False)
    grads = [p.grad.clone() for p in ref.params]
    params = [p.detach().clone() for p in ref.params]
    for bad in (0.0, -1.0, math.inf, math.nan, "1.0"):
        with pytest.raises(InvalidArgumentError, match="max_norm"):
            ref.scaler.clip_and_step(ref.opt, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="norm_type"):
        ref.scaler.clip_and_step(ref.opt, 1.0, norm_type=-2.0)
    assert _equal([p.grad for p in ref.params], grads)
    assert _equal([p.detach() for p in ref.params], params)
    ref.scaler.clip_and_step(ref.opt, 1.0)
    with pytest.raises(RuntimeError, match="after step"):
        ref.scaler.clip_and_step(ref.opt, 1.0)
    ref.scaler.update()
    ref.backward(torch.randn(8, 16), poison=False)
    ref.scaler.unscale_(ref.opt)
    with pytest.raises(RuntimeError, match="already been called"):
        ref.scaler.clip_and_step(ref.opt, 1.0)


def test_a_disabled_scaler_clips_and_steps() -> None:
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler("cpu", enabled=False)
    x = torch.randn(8, 16)
    scaler.scale(model(x).square().sum()).backward()
    twin(x).square().sum().backward()
    norm = scaler.clip_and_step(opt, 0.1)
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    twin_opt.step()
    assert torch.equal(norm, want)
    assert scaler.stepped(opt)
    assert _equal(list(model.parameters()), list(twin.parameters()))


def test_the_report_names_the_overflowing_leaf_on_a_folded_step() -> None:
    reports: list[Any] = []
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler("cpu", init_scale=2.0**10, report_leaves=True, on_step=reports.append)
    scaler.scale(model(torch.randn(4, 16)).sum()).backward()
    model[2].bias.grad[1] = math.nan
    scaler.clip_and_step(opt, 1.0)
    scaler.update()
    assert not scaler.stepped(opt)
    assert [leaf.path for leaf in reports[0].leaves] == ["grads[0][3]"]
    assert reports[0].grad_norm is not None
    assert math.isnan(float(reports[0].grad_norm))
