"""An optimizer's gradients planned once and reused, by the drop-in and the torch backend.

The drop-in walks ``optimizer.param_groups`` once (:mod:`scaler_core.torch._plan`) and
the torch backend plans a list of many small CPU tensors once
(:mod:`scaler_core.backends._torch_plans`); both hand the plan back while the same
objects come back, and notice any change: a replaced, removed or resized gradient, a
new parameter group. Each test checks the values a step leaves against a scaler that
never saw the gradients before.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from scaler_core.backends import _torch  # noqa: E402
from scaler_core.torch import GradScaler, _plan  # noqa: E402

#: Enough tensors for the backend to keep its plan (it keeps lists of 32 or more).
COUNT = 40


def _model(count: int = COUNT, size: int = 16) -> tuple[list[Any], Any]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(count)]
    return params, torch.optim.SGD(params, lr=0.1)


def _fill(params: list[Any], seed: int, scale: float = 2.0**10) -> None:
    """Scaled gradients, written into the existing ``.grad`` tensors where they exist."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        values = torch.randn(p.shape, generator=gen) * scale
        if p.grad is None:
            p.grad = values
        else:
            p.grad.copy_(values)


def _expected(params: list[Any], max_norm: float | None) -> tuple[list[Any], Any]:
    """What a scaler that never saw these gradients leaves: the unscaled (and clipped)
    gradients and the norm, on copies."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = None if p.grad is None else p.grad.detach().clone()
    opt = torch.optim.SGD(copies, lr=0.1)
    fresh = GradScaler("cpu", init_scale=2.0**10)
    fresh.scale(torch.ones(()))
    if max_norm is None:
        fresh.unscale_(opt)
        norm = None
    else:
        norm = fresh.unscale_and_clip_(opt, max_norm)
    return [c.grad for c in copies], norm


def _walks(monkeypatch: pytest.MonkeyPatch, params: list[Any]) -> list[int]:
    """Counts the drop-in's walks of these parameters (not the fresh scalers')."""
    calls: list[int] = []
    walk = _plan._walk

    def counted(walked: list[Any], *rest: Any) -> Any:
        if walked[0] is params[0]:
            calls.append(1)
        return walk(walked, *rest)

    monkeypatch.setattr(_plan, "_walk", counted)
    return calls


def _step(scaler: Any, opt: Any, max_norm: float | None) -> Any:
    norm = None if max_norm is None else scaler.unscale_and_clip_(opt, max_norm)
    if max_norm is None:
        scaler.unscale_(opt)
    return norm


@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_the_drop_in_walks_an_optimizer_once_while_its_gradients_stay(
    monkeypatch: pytest.MonkeyPatch, max_norm: float | None
) -> None:
    params, opt = _model()
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    walks = _walks(monkeypatch, params)
    for seed in range(4):
        _fill(params, seed)
        want, want_norm = _expected(params, max_norm)
        norm = _step(scaler, opt, max_norm)
        for p, w in zip(params, want, strict=True):
            assert torch.equal(p.grad, w)
        assert (norm is None) == (want_norm is None)
        if norm is not None:
            assert torch.equal(norm, want_norm)
        scaler.step(opt)
        scaler.update()
    assert len(walks) == 1


@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("change", ["replaced", "removed", "added", "new_group"])
def test_a_changed_gradient_or_group_is_noticed(
    monkeypatch: pytest.MonkeyPatch, change: str, max_norm: float | None
) -> None:
    params, opt = _model()
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    _fill(params, 0)
    if change == "added":
        params[7].grad = None  # planned without one
    _step(scaler, opt, max_norm)
    scaler.step(opt)
    scaler.update()
    walks = _walks(monkeypatch, params)
    if change == "replaced":
        params[7].grad = torch.zeros(16)
    elif change == "removed":
        params[7].grad = None
    elif change == "added":
        params[7].grad = torch.zeros(16)
    else:
        extra = torch.nn.Parameter(torch.zeros(16))
        opt.add_param_group({"params": [extra]})
        params = [*params, extra]
    _fill([p for p in params if p.grad is not None or change == "new_group"], 1)
    want, want_norm = _expected(params, max_norm)
    norm = _step(scaler, opt, max_norm)
    assert walks == [1]
    for p, w in zip(params, want, strict=True):
        assert (p.grad is None) == (w is None)
        if w is not None:
            assert torch.equal(p.grad, w)
    if norm is not None:
        assert torch.equal(norm, want_norm)


def test_the_drop_in_keeps_no_gradient_alive() -> None:
    params, opt = _model()
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    _fill(params, 0)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    old = weakref.ref(params[3].grad)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert old() is None
    _fill(params, 1)  # new tensors, possibly at the freed ones' addresses
    want, _ = _expected(params, None)
    scaler.unscale_(opt)
    for p, w in zip(params, want, strict=True):
        assert torch.equal(p.grad, w)


def _plans_made(monkeypatch: pytest.MonkeyPatch, first: Any) -> list[int]:
    """Counts the backend's plans of lists starting with ``first`` (not the fresh
    scalers' lists)."""
    calls: list[int] = []
    plan = _torch._numpy_plan

    def counted(tensors: list[Any]) -> Any:
        if tensors[0] is first:
            calls.append(1)
        return plan(tensors)

    monkeypatch.setattr(_torch, "_numpy_plan", counted)
    return calls


@pytest.mark.parametrize("change", ["resize", "set", "strides"])
def test_the_backend_notices_memory_moved_under_the_same_tensor(
    monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    pytest.importorskip("numba")
    params, opt = _model()
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    _fill(params, 0)
    made = _plans_made(monkeypatch, params[0].grad)
    for seed in range(2):
        _fill(params, seed)
        scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    assert made == [1]  # planned once, then kept
    grad = params[5].grad
    if change == "resize":  # a longer buffer: another address
        grad.resize_(4096)
        grad.resize_(16)
        grad.copy_(torch.randn(16))
    elif change == "set":  # another storage, same shape
        grad.set_(torch.randn(16))
    else:  # the same storage read with other strides
        grad.set_(torch.randn(32).untyped_storage(), 0, (16,), (2,))
    _fill(params, 2)
    want, want_norm = _expected(params, 1.0)
    norm = scaler.unscale_and_clip_(opt, 1.0)
    assert made == [1, 1]
    assert torch.equal(norm, want_norm)
    for p, w in zip(params, want, strict=True):
        assert torch.equal(p.grad, w)


def test_the_backend_keeps_a_list_of_many_tensors_planned_for_the_functional_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("numba")
    import scaler_core as sc

    grads = [torch.full((8,), 4.0) for _ in range(COUNT)]
    made = _plans_made(monkeypatch, grads[0])
    for _ in range(3):
        for g in grads:
            g.fill_(4.0)
        _, found, norm = sc.unscale_and_clip(grads, 2.0, 1.0)
        assert not bool(found)
        assert float(norm) == pytest.approx((COUNT * 8 * 4.0) ** 0.5)
    assert made == [1]
    grads[-1] = torch.full((8,), 4.0)  # a new list entry: planned again
    sc.unscale_and_clip(grads, 2.0, 1.0)
    assert made == [1, 1]


def test_the_inverse_scale_follows_every_write_of_the_scale() -> None:
    """The drop-in makes ``1 / scale`` once per value the scale takes: a scale written
    by an update, by ``update(new_scale)`` or directly into ``_scale`` (as some
    frameworks do) unscales by its own inverse, as PyTorch's class does."""
    params, opt = _model(count=3)
    theirs_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    theirs_opt = torch.optim.SGD(theirs_params, lr=0.1)
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    writes = [None, "update", "new_scale", "direct", None]
    for step, write in enumerate(writes):
        for scaler in (ours, theirs):
            scaler.scale(torch.ones(()))
            if write == "direct":
                scaler._scale.fill_(3.0)  # not a power of two: the inverse rounds
        _fill(params, step)
        for p, q in zip(theirs_params, params, strict=True):
            q_grad = q.grad
            assert q_grad is not None
            p.grad = q_grad.clone()
        ours.unscale_(opt)
        theirs.unscale_(theirs_opt)
        for p, q in zip(params, theirs_params, strict=True):
            assert torch.equal(p.grad, q.grad)
        ours.step(opt)
        theirs.step(theirs_opt)
        new_scale = 40.0 if write == "new_scale" else None
        ours.update(new_scale)
        theirs.update(new_scale)
        assert ours.get_scale() == theirs.get_scale()
    assert ours.state.steps == len(writes)


def test_new_gradients_every_step_are_walked_without_keeping_a_plan_then_kept_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``zero_grad()``'s default brings new gradient tensors every step: after two
    misses nothing is kept (no weak reference made per gradient), and a loop that
    then keeps its gradients is planned again within 64 steps."""
    params, opt = _model()
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(torch.ones(()))
    made: list[int] = []
    cached = _plan._Cached

    def counted(*args: Any) -> Any:
        made.append(1)
        return cached(*args)

    monkeypatch.setattr(_plan, "_Cached", counted)
    walks = _walks(monkeypatch, params)
    for step in range(6):  # new tensors each step
        opt.zero_grad(set_to_none=True)
        _fill(params, step)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert len(walks) == 6
    assert len(made) == 2  # kept twice, then no more
    for step in range(70):  # the same tensors from now on
        _fill(params, step)
        want, _ = _expected(params, None)
        scaler.unscale_(opt)
        for p, w in zip(params, want, strict=True):
            assert torch.equal(p.grad, w)
        scaler.step(opt)
        scaler.update()
    assert 6 < len(walks) < 6 + 64
    before = len(walks)
    for step in range(5):
        _fill(params, step)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert len(walks) == before  # kept again


def test_clear_cache_lets_the_kept_tensors_go() -> None:
    pytest.importorskip("numba")
    import scaler_core as sc

    grads = [torch.full((8,), 4.0) for _ in range(COUNT)]
    sc.unscale_and_clip(grads, 2.0, 1.0)  # a plan of them is kept, holding them
    held = weakref.ref(grads[0])
    del grads
    gc.collect()
    assert held() is not None
    sc.get_backend("torch").clear_cache()
    gc.collect()
    assert held() is None
