"""The drop-in at its seams with PyTorch: ``torch.compile``, setters, ``update(new_scale)``,
``state_dict`` in both directions, and a failure recorded on the device.

Each test runs the same calls on ``torch.amp.GradScaler`` (the oracle) where PyTorch
defines the behaviour, and compares.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")
np = pytest.importorskip("numpy")

from common_torch import one_step  # noqa: E402

import scaler_core as sc  # noqa: E402
from scaler_core.torch import GradScaler  # noqa: E402
from scaler_core.torch._held import HeldState  # noqa: E402

pytestmark = pytest.mark.torch


def _model(seed: int = 0, fused: bool = False) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    if fused:
        return model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _bits(model: Any) -> list[Any]:
    return [p.detach().clone().view(torch.int32) for p in model.parameters()]


# ------------------------------------------------------------------ torch.compile
def _loop(model: Any, opt: Any, scaler: Any, x: Any, clip: bool | str) -> Any:
    """The documented loop; ``x`` holding inf makes an overflow step. ``clip="fold"``:
    ``clip_and_step`` (a fused AdamW, the clip folded into its step)."""
    opt.zero_grad()
    loss = model(x).pow(2).sum()
    scaler.scale(loss).backward()
    if clip == "fold":
        scaler.clip_and_step(opt, 0.5)
        scaler.update()
        return loss.detach()
    if clip and isinstance(scaler, GradScaler):
        scaler.unscale_and_clip_(opt, 0.5)
    else:
        scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    return loss.detach()


def _inputs(steps: int) -> list[Any]:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 4, generator=gen) for _ in range(steps)]
    xs[2] = xs[2].clone()
    xs[2][0, 0] = float("inf")  # an overflow step: skipped, the scale backs off
    return xs


def _train(
    cls: Any, clip: bool | str, compiled: bool, steps: int = 6
) -> tuple[list[Any], list[float]]:
    model, opt = _model(fused=clip == "fold")
    scaler = cls("cpu", init_scale=2.0**10, growth_interval=2)
    step = torch.compile(_loop, backend="eager") if compiled else _loop
    scales = []
    for x in _inputs(steps):
        step(model, opt, scaler, x, clip)
        scales.append(scaler.get_scale())
    return _bits(model), scales


def dynamo_warns(test: Any) -> Any:
    """Warnings Dynamo's own tracing raises (of the loss's ``.grad``, of torch.jit inside
    an optimizer), with PyTorch's class as with this one."""
    for message in (
        "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning",
        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    ):
        test = pytest.mark.filterwarnings(message)(test)
    return test


@pytest.fixture
def fresh_dynamo() -> Any:
    import torch._dynamo

    torch._dynamo.reset()
    yield torch._dynamo
    torch._dynamo.reset()


@dynamo_warns
@pytest.mark.parametrize(
    "clip", [False, True, "fold"], ids=["unscale_", "unscale_and_clip_", "clip_and_step"]
)
def test_a_compiled_step_trains_as_the_eager_one_bit_for_bit(
    clip: bool | str, fresh_dynamo: Any
) -> None:
    """Dynamo traced the drop-in's methods (a third-party module) and lost
    ``unscale_and_clip_``'s record: ``step`` unscaled the clipped gradients again."""
    eager_params, eager_scales = _train(GradScaler, clip, compiled=False)
    params, scales = _train(GradScaler, clip, compiled=True)
    assert scales == eager_scales
    assert len(set(scales)) > 1  # it grew and backed off
    for a, b in zip(params, eager_params, strict=True):
        assert torch.equal(a, b)
    if not clip:  # and as PyTorch's class trains, compiled or not
        theirs, their_scales = _train(torch.amp.GradScaler, clip, compiled=True)
        assert their_scales == scales
        for a, b in zip(params, theirs, strict=True):
            assert torch.equal(a, b)


@dynamo_warns
@pytest.mark.parametrize(
    "clip", [False, True, "fold"], ids=["unscale_", "unscale_and_clip_", "clip_and_step"]
)
def test_a_compiled_loop_breaks_the_graph_no_more_often_than_pytorchs(
    clip: bool | str, fresh_dynamo: Any
) -> None:
    counts = {}
    for cls in (torch.amp.GradScaler, GradScaler):
        fresh_dynamo.reset()
        model, opt = _model(fused=clip == "fold")
        scaler = cls("cpu", init_scale=2.0**10)
        mode = (True if cls is torch.amp.GradScaler else "fold") if clip == "fold" else clip
        explained = fresh_dynamo.explain(_loop)(model, opt, scaler, torch.ones(3, 4), mode)
        counts[cls] = explained.graph_break_count
    assert counts[GradScaler] <= counts[torch.amp.GradScaler], counts


def _every_reader(scaler: GradScaler, opt: Any) -> tuple[Any, ...]:
    saved = scaler.state_dict()
    return (
        scaler.get_scale(),
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
        scaler._get_growth_tracker(),
        scaler.is_enabled(),
        scaler.state,
        scaler.config,
        scaler.stepped(opt),
        None if scaler.grad_norm is None else scaler.grad_norm.clone().view(torch.int32),
        saved,
    )


@dynamo_warns
def test_every_method_gives_the_eager_result_when_compiled(fresh_dynamo: Any) -> None:
    def session(compiled: bool) -> list[Any]:
        model, opt = _model()
        scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)

        def body(x: Any, phase: int) -> Any:
            out = []
            if phase == 1:
                scaler.set_growth_factor(4.0)
                scaler.set_backoff_factor(0.25)
                scaler.set_growth_interval(2)
            opt.zero_grad()
            scaler.scale(model(x).pow(2).sum()).backward()
            out.append(scaler.unscale_and_clip_(opt, 0.5).clone().view(torch.int32))
            scaler.step(opt)
            scaler.update(2.0**12 if phase == 3 else None)
            out.append(_every_reader(scaler, opt))
            if phase == 4:
                scaler.load_state_dict(copy.deepcopy(out[-1][-1]))
                scaler.abandon_step()
            return out

        run = torch.compile(body, backend="eager") if compiled else body
        results = [run(x, i) for i, x in enumerate(_inputs(6))]
        return [results, _bits(model)]

    eager, compiled = session(False), session(True)
    assert repr(compiled) == repr(eager)


# ------------------------------------------------------------------------ setters
SETTERS = st.one_of(
    st.tuples(st.just("set_growth_factor"), st.sampled_from([1.5, 2.0, 3.0, 1.1])),
    st.tuples(st.just("set_backoff_factor"), st.sampled_from([0.25, 0.5, 0.9])),
    st.tuples(st.just("set_growth_interval"), st.integers(1, 6)),
)
#: A step (True: an overflow, False: a clean one), a setter call between steps, or a
#: step with a setter called between its ``step`` and ``update``.
EVENTS = st.lists(
    st.one_of(st.booleans(), SETTERS, st.tuples(st.booleans(), SETTERS)), min_size=1, max_size=40
)


def _apply(scaler: Any, event: Any) -> None:
    if isinstance(event, bool):
        one_step(scaler, float("inf") if event else 1.0)
    elif isinstance(event[0], bool):
        name, value = event[1]
        one_step(scaler, float("inf") if event[0] else 1.0, lambda s: getattr(s, name)(value))
    else:
        getattr(scaler, event[0])(event[1])


@settings(max_examples=60, deadline=None)
@given(events=EVENTS)
def test_setters_steer_the_scale_as_pytorchs_at_any_point(events: list[Any]) -> None:
    """Setters after the first update were ignored by the next one (it worked from a copy
    of the state whose config was the old one) while the getters showed the new value."""
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    for event in events:
        _apply(theirs, event)
        _apply(ours, event)
        assert ours.get_scale() == theirs.get_scale(), events
        assert ours._get_growth_tracker() == theirs._get_growth_tracker()
        mine = {k: v for k, v in ours.state_dict().items() if k != "scaler_core"}
        assert mine == theirs.state_dict()
        assert ours.state.scale == theirs.get_scale()


# ---------------------------------------------------------------- update(new_scale)
def _outcome(fn: Any) -> tuple[str, str]:
    """What a call does: ('ok', '') or (error class, message)."""
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def _stepped(cls: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    if "config" not in kwargs:
        kwargs.setdefault("init_scale", 8.0)
    scaler, (model, opt) = cls("cpu", **kwargs), _model()
    scaler.scale(model(torch.ones(3, 4)).pow(2).sum()).backward()
    scaler.step(opt)
    return scaler, model, opt


NEW_SCALES = {
    "int tensor": lambda: torch.tensor(1024),
    "float64 tensor": lambda: torch.tensor(0.1, dtype=torch.float64),
    "float16 tensor": lambda: torch.tensor(3.5, dtype=torch.float16),
    "bool tensor": lambda: torch.tensor(True),
    "1-element 1-d tensor": lambda: torch.tensor([8.0]),
    "2 elements": lambda: torch.tensor([8.0, 8.0]),
    "requires grad": lambda: torch.tensor(8.0, requires_grad=True),
    "float": lambda: 1024.0,
    "float32-rounded float": lambda: 0.1,
    "numpy float64": lambda: np.float64(512.0),
}


@pytest.mark.parametrize("make", NEW_SCALES.values(), ids=NEW_SCALES.keys())
def test_update_takes_every_new_scale_pytorchs_takes(make: Any) -> None:
    """An int tensor (``torch.tensor(1024)``) was refused; PyTorch's class takes it."""
    results = []
    for cls in (torch.amp.GradScaler, GradScaler):
        scaler, _, _ = _stepped(cls)
        outcome = _outcome(lambda scaler=scaler: scaler.update(make()))
        results.append((outcome, scaler.get_scale(), scaler._get_growth_tracker()))
    assert results[1] == results[0]


@pytest.mark.parametrize(
    "value", [np.float32(1024.0), 1024, np.int64(64), torch.tensor(2**20, dtype=torch.int64)]
)
def test_update_takes_any_real_number_as_a_new_scale(value: Any) -> None:
    """Where PyTorch's class fails on a NumPy float32 or an int (it reads ``.device``)."""
    scaler, _, _ = _stepped(GradScaler)
    scaler.update(value)
    assert scaler.get_scale() == float(value)
    assert scaler.state.scale == float(value)


NOT_A_SCALE = [
    0.0,
    -2.0,
    float("inf"),
    float("nan"),
    1e-45,  # a float32 subnormal
    1e39,  # above float32's max
    10**400,  # above any float's
    "8",
    True,
    np.float32(0.0),
    np.array(8.0),
    torch.tensor(0),
    torch.tensor(float("nan")),
    torch.tensor(1e-45),
    torch.tensor(1e39, dtype=torch.float64),
    torch.tensor(-3.0),
]


@pytest.mark.parametrize("bad", NOT_A_SCALE, ids=repr)
def test_a_new_scale_that_is_no_scale_is_refused_before_anything_changes(bad: Any) -> None:
    log: list[Any] = []
    scaler, _, _ = _stepped(GradScaler, on_step=log.append)
    before = scaler.state
    with pytest.raises(sc.InvalidArgumentError, match=r"new_scale=.*, but it must be .*; pass"):
        scaler.update(bad)
    assert scaler.state == before
    assert log == []
    scaler.update()  # the step's checks are still there: the automatic update runs
    assert len(log) == 1


def test_a_new_scale_outside_the_configs_bounds_is_refused() -> None:
    config = sc.ScalerConfig(init_scale=8.0, min_scale=1.0, max_scale=2.0**10)
    scaler, _, _ = _stepped(GradScaler, config=config)
    for bad in (0.5, 2.0**11):
        with pytest.raises(sc.InvalidArgumentError, match=r"new_scale=.*min_scale"):
            scaler.update(bad)
    scaler, _, _ = _stepped(GradScaler, config=sc.ScalerConfig.static(8.0))
    with pytest.raises(sc.InvalidArgumentError, match=r"new_scale=16\.0.*static"):
        scaler.update(16.0)
    scaler.update(8.0)  # the static scale itself is a scale
    assert scaler.get_scale() == 8.0


def test_update_with_a_new_scale_reports_the_step_and_clears_its_norm_and_leaves() -> None:
    """It called no ``on_step``, and the next clean step reported this step's NaN norm
    and leaf."""
    log: list[Any] = []
    scaler = GradScaler("cpu", init_scale=8.0, on_step=log.append, report_leaves=True)
    model, opt = _model()
    scaler.scale(model(torch.ones(3, 4)).pow(2).sum()).backward()
    model.weight.grad[0, 0] = float("nan")
    scaler.unscale_and_clip_(opt, 1.0)
    scaler.step(opt)
    scaler.update(torch.tensor(1024))
    assert len(log) == 1
    report = log[0]
    assert bool(report.found)
    assert report.scale == 1024.0
    assert report.grad_norm is not None
    assert report.leaves
    assert report.state == scaler.state
    assert scaler.grad_norm is None
    opt.zero_grad()
    scaler.scale(model(torch.ones(3, 4)).pow(2).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert len(log) == 2
    assert (log[1].grad_norm, log[1].leaves, bool(log[1].found)) == (None, (), False)


# --------------------------------------------------------------------- state_dict
def _torch_part(saved: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in saved.items() if k != "scaler_core"}


def _lockstep(scalers: list[Any], grads: list[float]) -> None:
    """Step every scaler alike and check they agree (the first is PyTorch's)."""
    for grad in grads:
        for scaler in scalers:
            one_step(scaler, grad)
        first = scalers[0]
        for other in scalers[1:]:
            assert other.get_scale() == first.get_scale(), grads
            assert other._get_growth_tracker() == first._get_growth_tracker()
            assert _torch_part(other.state_dict()) == first.state_dict()


CLEAN, INF = 1.0, float("inf")


def test_a_tracker_past_a_shortened_interval_follows_pytorch_and_round_trips() -> None:
    """After set_growth_interval(3) at a tracker of 5 (PyTorch allows it), the drop-in's
    own state_dict() could not be loaded back: growth_tracker >= growth_interval."""
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10)
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=10)
    _lockstep([theirs, ours], [CLEAN] * 5)
    for scaler in (theirs, ours):
        scaler.set_growth_interval(3)
    assert ours._get_growth_tracker() == 5
    saved, their_saved = ours.state_dict(), theirs.state_dict()
    assert sc.from_dict(sc.to_dict(ours.state)) == ours.state
    reloaded, from_theirs = GradScaler("cpu"), GradScaler("cpu")
    reloaded.load_state_dict(copy.deepcopy(saved))
    from_theirs.load_state_dict(copy.deepcopy(their_saved))
    into_theirs = torch.amp.GradScaler("cpu")
    into_theirs.load_state_dict(copy.deepcopy(saved))
    assert reloaded.state == ours.state
    # PyTorch's kernel grows only when tracker + 1 == interval: from 5 it counts on
    # until a backoff resets it; every scaler must do the same, bit for bit.
    grads = [CLEAN] * 4 + [INF] + [CLEAN] * 7
    _lockstep([theirs, ours, reloaded, from_theirs, into_theirs], grads)
    assert theirs.get_scale() > 2.0**10  # it backed off, then grew twice


@pytest.mark.parametrize("tracker", [-1, 2**31, 1.5, True, "5", float("nan")])
def test_a_hostile_growth_tracker_is_still_refused(tracker: Any) -> None:
    scaler = GradScaler("cpu", init_scale=4.0)
    saved = scaler.state_dict()
    payload = copy.deepcopy(saved["scaler_core"])
    payload["state"]["growth_tracker"] = tracker
    with pytest.raises(sc.InvalidStateError, match="growth_tracker"):
        sc.from_dict(payload)
    for edited in (
        {**saved, "_growth_tracker": tracker},
        {**_torch_part(saved), "_growth_tracker": tracker},
    ):
        with pytest.raises(sc.InvalidStateError, match="_growth_tracker"):
            scaler.load_state_dict(edited)
    assert scaler.state == sc.from_dict(saved["scaler_core"])


EDITS = {
    "scale": 256.0,
    "growth_factor": 3.0,
    "backoff_factor": 0.25,
    "growth_interval": 4,
    "_growth_tracker": 1,
}


@pytest.mark.parametrize("key", EDITS)
def test_pytorchs_entries_win_over_the_scaler_core_payload(key: str) -> None:
    """With the "scaler_core" key present, an edited PyTorch entry was ignored without a
    word, while PyTorch's class loads it."""
    source = GradScaler(
        "cpu", config=sc.ScalerConfig(init_scale=2.0**10, growth_interval=6, min_scale=1.0)
    )
    _lockstep([source], [CLEAN, INF, CLEAN, CLEAN])
    saved = source.state_dict()
    edited = {**copy.deepcopy(saved), key: EDITS[key]}
    theirs, ours = torch.amp.GradScaler("cpu"), GradScaler("cpu")
    theirs.load_state_dict(edited)
    ours.load_state_dict(edited)
    assert _torch_part(ours.state_dict()) == theirs.state_dict() == _torch_part(edited)
    # The payload supplies what PyTorch has no entry for.
    assert ours.config.min_scale == 1.0
    assert (ours.state.steps, ours.state.skipped_steps) == (4, 1)
    _lockstep([theirs, ours], [CLEAN] * 5 + [INF] + [CLEAN] * 3)


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("scale", -1.0),
        ("scale", 0.5),
        ("growth_interval", 0),
        ("backoff_factor", 1.5),
        ("growth_factor", "2"),
    ],
)
def test_a_bad_pytorch_entry_beside_the_payload_loads_nothing(key: str, bad: Any) -> None:
    source = GradScaler("cpu", config=sc.ScalerConfig(init_scale=2.0**10, min_scale=1.0))
    saved = {**source.state_dict(), key: bad}
    target = GradScaler("cpu", init_scale=8.0)
    before = target.state
    with pytest.raises(sc.InvalidStateError, match=rf"state_dict\['{key}'\]={bad!r}"):
        target.load_state_dict(saved)
    assert target.state == before


# --------------------------------------------------- a failure recorded on the device
@pytest.fixture
def device_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route an accelerator takes (the rules on the device, a failure recorded, not
    raised), driven with CPU tensors: ``HeldState.host_route`` is where the drop-in's
    route is decided."""
    monkeypatch.setattr(HeldState, "host_route", staticmethod(lambda scale: False))


class _Fused(torch.optim.SGD):
    """An optimizer that unscales and skips in its own step, as fused ones do."""

    _step_supports_amp_scaling = True

    def step(self, closure: Any = None) -> Any:
        if not self.found_inf.item():
            inv = 1.0 if self.grad_scale is None else 1.0 / self.grad_scale.item()
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.add_(p.grad, alpha=-group["lr"] * inv)


@pytest.mark.parametrize("how", ["step", "unscale_", "unscale_and_clip_", "fused"])
def test_after_a_recorded_failure_no_step_moves_a_parameter(device_route: None, how: str) -> None:
    """On an accelerator a collapse is recorded instead of raised; the next clean
    iteration's step() still ran the optimizer."""
    config = sc.ScalerConfig(init_scale=2.0**-126, growth_interval=10)
    scaler = GradScaler("cpu", config=config)
    model, _ = _model()
    cls = _Fused if how == "fused" else torch.optim.SGD
    opt = cls(model.parameters(), lr=0.1)
    checkpoint = scaler.state_dict()

    def iteration(bad: bool) -> None:
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).pow(2).sum()).backward()
        if bad:
            model.weight.grad[0, 0] = float("nan")
        if how == "unscale_":
            scaler.unscale_(opt)
        elif how == "unscale_and_clip_":
            scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    iteration(bad=True)  # the backoff would collapse the scale: recorded, not raised
    with pytest.raises(sc.ScaleCollapseError):
        scaler.get_scale()
    before = _bits(model)
    for _ in range(2):
        iteration(bad=False)
        assert not scaler.stepped(opt)
        for a, b in zip(_bits(model), before, strict=True):
            assert torch.equal(a, b)
    with pytest.raises(sc.ScaleCollapseError):
        _ = scaler.state
    scaler.load_state_dict(checkpoint)  # dealt with: the steps run again
    iteration(bad=False)
    assert scaler.stepped(opt)
    assert any(not torch.equal(a, b) for a, b in zip(_bits(model), before, strict=True))


# ------------------------------------------------------------ round 3's seams
def test_a_static_scale_set_every_step_still_counts_the_steps_and_skips() -> None:
    """mmengine's ``loss_scale=512.0`` calls ``update(512.0)`` every step: the state
    counts each step and each skip (it used to stay at 0), and the scale and PyTorch's
    growth tracker are what PyTorch's class gives."""
    model, opt = _model()
    ours, theirs = GradScaler("cpu", init_scale=512.0), torch.amp.GradScaler("cpu", 512.0)
    for scaler in (ours, theirs):
        for step in range(7):
            opt.zero_grad()
            scaler.scale(model(torch.ones(3, 4)).pow(2).sum()).backward()
            if step in (1, 4, 5):
                model.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update(512.0)
    state = ours.state
    assert (state.steps, state.skipped_steps, state.consecutive_skips) == (7, 3, 0)
    assert state.last_step is sc.StepKind.STATIC_CLEAN
    assert ours.get_scale() == theirs.get_scale() == 512.0
    assert ours._get_growth_tracker() == theirs._get_growth_tracker()
    ours.load_state_dict(ours.state_dict())
    assert ours.state == state


def test_a_new_scale_keeps_the_skip_limit_and_refuses_before_anything_changes() -> None:
    model, opt = _model()
    scaler = GradScaler("cpu", config=sc.ScalerConfig(init_scale=512.0, max_consecutive_skips=1))
    for step in range(2):
        opt.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).pow(2).sum()).backward()
        model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        if step == 0:
            scaler.update(256.0)
    before = scaler.state
    with pytest.raises(sc.SkipLimitError):
        scaler.update(128.0)
    assert scaler.state == before
    assert scaler.get_scale() == 256.0


def test_pytorchs_unscale_grads_works_on_a_fresh_scaler() -> None:
    """PyTorch's own ``test_grad_scaling_unscale`` calls ``_unscale_grads_`` before any
    ``scale()``: it unscales and flags as PyTorch's class does (it raised AttributeError)."""
    results = []
    for cls in (GradScaler, torch.amp.GradScaler):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
        for p in params:
            p.grad = torch.full((3,), 4.0)
        params[1].grad[1] = float("inf")
        opt = torch.optim.SGD(params, lr=1.0)
        found = torch.zeros(1)
        flags = cls("cpu")._unscale_grads_(opt, torch.full((1,), 0.25), found, True)
        results.append(([p.grad.clone() for p in params], {k: v.clone() for k, v in flags.items()}))
    (ours, our_flags), (theirs, their_flags) = results
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert our_flags.keys() == their_flags.keys()
    assert all(torch.equal(our_flags[k], their_flags[k]) for k in our_flags)
    assert float(next(iter(our_flags.values()))) == 1.0


def test_the_grad_norm_is_this_steps_until_update() -> None:
    model, opt = _model()
    scaler = GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.ones(3, 4)).pow(2).sum()).backward()
    norm = scaler.unscale_and_clip_(opt, 1.0)
    scaler.step(opt)
    assert scaler.grad_norm is norm
    scaler.update()
    assert scaler.grad_norm is None


@pytest.mark.parametrize("how", ["unscale_and_clip_", "clip_and_step"])
def test_a_skipped_clip_leaves_the_gradients_unscaled_as_unscale_does(how: str) -> None:
    """A skipped step's gradients end unscaled (not clipped: the step is skipped), as
    PyTorch's ``unscale_`` leaves them, on the CPU too (they were left scaled there,
    and unscaled on an accelerator)."""
    grads = []
    for ours in (True, False):
        model, opt = _model()
        scaler = GradScaler("cpu", init_scale=8.0) if ours else torch.amp.GradScaler("cpu", 8.0)
        scaler.scale(model(torch.ones(3, 4)).pow(2).sum()).backward()
        model.weight.grad[0, 0] = float("inf")
        if ours:
            getattr(scaler, how)(opt, 1.0)
            if how == "unscale_and_clip_":
                scaler.step(opt)
            assert not scaler.stepped(opt)
        else:
            scaler.unscale_(opt)
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    assert grads[0][1].abs().max() < 8.0  # unscaled: the scaled bias gradient is 8x


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"init_scale": 10**400}, "init_scale"), ({"growth_factor": 10**400}, "growth_factor")],
)
def test_a_number_no_float_holds_is_refused_naming_the_field(kwargs: Any, field: str) -> None:
    with pytest.raises(sc.InvalidConfigError, match=f"{field}=an int of 1329 bits"):
        GradScaler("cpu", **kwargs)
    scaler = GradScaler("cpu")
    with pytest.raises(sc.InvalidConfigError, match="an int of 1329 bits"):
        scaler.set_growth_factor(10**400)
    assert scaler.get_growth_factor() == 2.0
