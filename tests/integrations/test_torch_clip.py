"""``GradScaler.unscale_and_clip_``: one call for ``unscale_`` then ``clip_grad_norm_``."""

from __future__ import annotations

import importlib.metadata
import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from scaler_core import InvalidArgumentError, StepKind, StepReport  # noqa: E402
from scaler_core.torch import GradScaler  # noqa: E402


def _train(fused: bool, steps: int = 30) -> tuple[list, list, float, list]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reports: list[StepReport] = []
    if fused:
        scaler = GradScaler("cpu", init_scale=2.0**12, growth_interval=5, on_step=reports.append)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=5)
    norms = []
    for i in range(steps):
        x = torch.randn(16, 32)
        loss = model(x).square().sum() * 10
        if i in (4, 11):
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if fused:
            norm = scaler.unscale_and_clip_(opt, 1.0)
        else:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(float(norm))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms, scaler.get_scale(), reports


def test_it_trains_as_unscale_then_clip_grad_norm() -> None:
    ours, our_norms, our_scale, reports = _train(True)
    theirs, their_norms, their_scale, _ = _train(False)
    assert our_scale == their_scale
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(our_norms, their_norms, strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5)
    kinds = [r.kind for r in reports]
    assert len(kinds) == 30
    assert kinds[4] is StepKind.BACKOFF
    assert kinds[11] is StepKind.BACKOFF
    assert all(r.grad_norm is not None for r in reports)


def test_a_skipped_step_leaves_the_gradients_unscaled_and_unclipped() -> None:
    """As ``unscale_`` leaves them (on every device; the CPU used to leave them scaled)."""
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))
    param.grad = torch.tensor([8.0, math.inf, 1.0, 2.0])
    before = param.grad.clone()
    norm = scaler.unscale_and_clip_(opt, 1.0)
    assert not math.isfinite(norm.item())
    assert torch.equal(param.grad, before * 0.125)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_and_clip_(opt, 1.0)
    scaler.step(opt)
    assert torch.equal(param.detach(), torch.zeros(4))
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_and_clip_(opt, 1.0)
    scaler.update()
    assert scaler.get_scale() == 4.0


def test_the_report_names_the_overflowing_gradient_and_pickling_drops_the_callback() -> None:
    import pickle

    first, second = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([{"params": [first]}, {"params": [second]}], lr=1.0)
    reports: list[StepReport] = []
    scaler = GradScaler(
        "cpu",
        init_scale=4.0,
        on_step=lambda r: reports.append(r),  # noqa: PLW0108 - a lambda cannot be pickled
        report_leaves=True,
    )
    for clip in (False, True):
        scaler.scale(torch.ones(()))
        first.grad = torch.ones(3)
        second.grad = torch.tensor([math.nan, math.inf])
        if clip:
            scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
    for report in reports:
        assert report.kind is StepKind.BACKOFF
        assert [str(leaf) for leaf in report.leaves] == ["grads[1][0]: 1 inf, 1 nan"]
    copy = pickle.loads(pickle.dumps(scaler))  # a lambda callback is left behind
    assert copy.get_scale() == 1.0
    with pytest.raises(InvalidArgumentError, match="report_leaves="):
        GradScaler("cpu", report_leaves=1)


def test_a_sparse_gradient_is_clipped_as_its_coalesced_sum() -> None:
    """nn.Embedding(sparse=True) with a repeated index: the drop-in unscales as PyTorch's
    GradScaler does, then clips the coalesced gradient with clip_grad_norm_'s coefficient
    (PyTorch's own clip_grad_norm_ refuses a sparse gradient: the oracle runs on its values)."""

    def model() -> tuple[Any, Any, Any]:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(8, 4, sparse=True)
        head = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1)
        return emb, head, opt

    def backward(scaler: Any, emb: Any, head: Any) -> None:
        out = head(emb(torch.tensor([[1, 3, 1, 1], [5, 3, 0, 1]]))).sum()
        scaler.scale(out * 100).backward()

    emb, head, opt = model()
    ours = GradScaler("cpu", init_scale=2.0**10)
    backward(ours, emb, head)
    assert not emb.weight.grad.is_coalesced()
    with pytest.raises(InvalidArgumentError, match="max_norm"):
        ours.unscale_and_clip_(opt, -1.0)  # refused: nothing unscaled, the stage unchanged
    norm = ours.unscale_and_clip_(opt, 1.0)

    emb2, head2, opt2 = model()
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    backward(theirs, emb2, head2)
    theirs.unscale_(opt2)
    emb2.weight.grad = emb2.weight.grad.coalesce()
    values = [emb2.weight.grad._values(), head2.weight.grad, head2.bias.grad]
    exact = math.sqrt(math.fsum(x * x for v in values for x in v.double().flatten().tolist()))
    assert float(norm) == pytest.approx(float(torch.nn.utils.get_total_norm(values)), rel=1e-6)
    assert abs(float(norm) - exact) <= float(np.spacing(np.float32(exact)))  # float64 sum
    holders = [torch.nn.Parameter(torch.zeros_like(v)) for v in values]
    for holder, v in zip(holders, values, strict=True):
        holder.grad = v.clone()
    torch.nn.utils.clip_grads_with_norm_(holders, 1.0, norm)  # PyTorch's clip for this norm
    got = [emb.weight.grad, head.weight.grad, head.bias.grad]
    assert got[0].is_coalesced()
    assert torch.equal(got[0]._indices(), emb2.weight.grad._indices())
    for g, holder in zip([got[0]._values(), *got[1:]], holders, strict=True):
        assert torch.equal(g, holder.grad)
    ours.step(opt)
    assert ours.stepped(opt)
    ours.update()


def test_the_report_names_the_leaf_with_a_fused_optimizer() -> None:
    """A fused optimizer unscales in its own kernel: step() checks it through
    _check_inf_per_device, not _unscale_grads_; the skipped step still names the leaf."""
    first, second = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([{"params": [first]}, {"params": [second]}], lr=0.1, fused=True)
    reports: list[StepReport] = []
    scaler = GradScaler("cpu", init_scale=4.0, on_step=reports.append, report_leaves=True)
    for bad in (True, False):
        scaler.scale(torch.ones(()))
        first.grad = torch.ones(3)
        second.grad = torch.tensor([math.nan, math.inf]) if bad else torch.ones(2)
        scaler.step(opt)
        scaler.update()
    assert [r.kind for r in reports] == [StepKind.BACKOFF, StepKind.COUNT]
    assert [str(leaf) for leaf in reports[0].leaves] == ["grads[1][0]: 1 inf, 1 nan"]
    assert reports[1].leaves == ()


def _extra_requirements(requires: list[str], extra: str) -> set[str]:
    """The distribution names an extra brings, following the project's own extras."""
    marker = f'extra == "{extra}"'
    names: set[str] = set()
    for line in requires:
        spec, _, env = line.partition(";")
        if env.strip() != marker:
            continue
        name = spec.strip()
        for stop in "<>=!~ ":
            name = name.split(stop)[0]
        base, _, bracket = name.partition("[")
        if base == "scaler-core":
            for inner in bracket.rstrip("]").split(","):
                names |= _extra_requirements(requires, inner.strip())
        else:
            names.add(base)
    return names


def test_the_torch_extra_brings_numba() -> None:
    """``pip install "scaler-core[torch]"`` brings numba: without it the drop-in's
    ``unscale_and_clip_`` on CPU tensors is slower than the ``unscale_`` +
    ``clip_grad_norm_`` pair it replaces (docs/performance.md, "The drop-in on CPU,
    with numba and without")."""

    requires = importlib.metadata.requires("scaler-core") or []
    brought = _extra_requirements(requires, "torch")
    assert "torch" in brought
    assert "numba" in brought, f"the torch extra brings {sorted(brought)}, not numba"


# ------------------------------------------------------- clip_grad_norm_'s arguments
def _recipe_run(ours: bool, steps: int = 10, **clip: Any) -> tuple[list[float], list[Any]]:
    """A short run with two inf steps, clipping with ``clip_grad_norm_``'s arguments:
    through ``unscale_and_clip_`` (``ours``) or PyTorch's class and recipe."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cls = GradScaler if ours else torch.amp.GradScaler
    scaler = cls("cpu", init_scale=2.0**10, growth_interval=3)
    subset = clip.pop("subset", False)
    chosen = list(model[0].parameters()) if subset else list(model.parameters())
    norms = []
    for i in range(steps):
        loss = model(torch.randn(8, 12)).square().sum() * (math.inf if i in (3, 7) else 1.0)
        scaler.scale(loss).backward()
        if ours:
            norm = scaler.unscale_and_clip_(opt, 0.5, parameters=chosen if subset else None, **clip)
        else:
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(chosen, 0.5, **clip)
        norms.append(float(norm))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return norms, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "clip",
    [
        {"norm_type": 1.0},
        {"norm_type": 3},
        {"norm_type": math.inf},
        {"norm_type": "inf"},
        {"subset": True},
        {"subset": True, "norm_type": math.inf, "foreach": False},
    ],
    ids=str,
)
def test_clip_grad_norms_arguments_give_pytorchs_recipe_bit_for_bit(clip: dict[str, Any]) -> None:
    """Other norms, a subset of the parameters, foreach: PyTorch's recipe exactly (norms,
    skipped steps and parameters), as ``unscale_`` then ``clip_grad_norm_``."""
    ours = _recipe_run(True, **dict(clip))
    want = _recipe_run(False, **dict(clip))
    np.testing.assert_array_equal(np.array(ours[0]), np.array(want[0]))
    for p, q in zip(ours[1], want[1], strict=True):
        assert torch.equal(p, q)


def test_error_if_nonfinite_raises_pytorchs_error_on_an_overflow() -> None:
    messages = []
    for ours in (True, False):
        with pytest.raises(RuntimeError, match="non-finite") as info:
            _recipe_run(ours, error_if_nonfinite=True)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    # and on a run without overflow it changes nothing
    finite = {"error_if_nonfinite": True}
    assert _recipe_run(True, steps=3, **finite)[0] == _recipe_run(False, steps=3, **finite)[0]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"norm_type": -1.0}, r"norm_type=-1\.0, but it must be a positive number"),
        ({"norm_type": 0}, r"norm_type=0,"),
        ({"norm_type": math.nan}, r"norm_type=nan,"),
        ({"norm_type": True}, r"norm_type=True,"),
        ({"norm_type": "two"}, r"norm_type='two',"),
        ({"parameters": [torch.nn.Parameter(torch.ones(2))]}, r"parameters\[0\] is a Parameter"),
        ({"max_norm": -1.0, "norm_type": 1.0}, r"max_norm=-1\.0"),
    ],
    ids=str,
)
def test_bad_clip_arguments_are_refused_before_anything_changes(
    kwargs: dict[str, Any], words: str
) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    max_norm = kwargs.pop("max_norm", 1.0)
    with pytest.raises(InvalidArgumentError, match=words):
        scaler.unscale_and_clip_(opt, max_norm, **kwargs)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    scaler.unscale_(opt)  # the optimizer was not marked unscaled
