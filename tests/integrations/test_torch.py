"""``scaler_core.torch.GradScaler`` behaves as ``torch.amp.GradScaler``, and adds what it lacks.

Tests marked "as PyTorch" run the same calls on both classes and compare: results,
error classes and messages. The rest cover what PyTorch's class does not have
(configs, fail-closed, ``state``, ``stepped``) and where it fails (an unscale that
overflows below a scale of 1).
"""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")

from common_checkpoints import version_1  # noqa: E402
from common_torch import assert_same_optimizer_state, one_step  # noqa: E402

import scaler_core as sc  # noqa: E402
from scaler_core.torch import GradScaler  # noqa: E402

pytestmark = pytest.mark.torch
CLASSES = pytest.mark.parametrize(
    "cls", [torch.amp.GradScaler, GradScaler], ids=["pytorch", "scaler_core"]
)


def _model(seed: int = 0) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward(scaler: Any, model: Any, inject: float | None = None) -> None:
    loss = model(torch.ones(3, 4)).pow(2).sum()
    scaler.scale(loss).backward()
    if inject is not None:
        model.weight.grad[0, 0] = inject


def _outcome(fn: Any) -> tuple[str, str]:
    """What a call does: ('ok', repr of result) or (error class, message)."""
    try:
        return "ok", repr(fn())
    except Exception as exc:
        return type(exc).__name__, str(exc)


# ---------------------------------------------------------------- the same as PyTorch
def test_it_is_a_torch_amp_gradscaler_with_the_same_defaults() -> None:
    ours, theirs = GradScaler("cpu"), torch.amp.GradScaler("cpu")
    assert isinstance(ours, torch.amp.GradScaler)
    for getter in ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval"):
        assert getattr(ours, getter)() == getattr(theirs, getter)(), getter
    assert ours.is_enabled()
    assert ours._get_growth_tracker() == 0
    assert ours._scale is None
    assert ours._init_growth_tracker == 0


@CLASSES
def test_scale_takes_tensors_and_nested_iterables(cls: Any) -> None:
    scaler = cls("cpu", init_scale=4.0)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor(3.0, dtype=torch.float16)
    assert torch.equal(scaler.scale(a), a * 4)
    nested = scaler.scale([a, (b, [a])])
    assert isinstance(nested, list)
    assert isinstance(nested[1], tuple)
    assert torch.equal(nested[1][1][0], a * 4)
    assert nested[1][0].dtype == torch.float32
    assert torch.equal(nested[1][0], torch.tensor(12.0))


def _misuse_cases() -> dict[str, Any]:
    def unscale_twice(cls: Any) -> Any:
        scaler, (model, opt) = cls("cpu"), _model()
        _backward(scaler, model)
        scaler.unscale_(opt)
        return scaler.unscale_(opt)

    def unscale_after_step(cls: Any) -> Any:
        scaler, (model, opt) = cls("cpu"), _model()
        _backward(scaler, model)
        scaler.step(opt)
        return scaler.unscale_(opt)

    def step_twice(cls: Any) -> Any:
        scaler, (model, opt) = cls("cpu"), _model()
        _backward(scaler, model)
        scaler.step(opt)
        return scaler.step(opt)

    def closure(cls: Any) -> Any:
        scaler, (model, opt) = cls("cpu"), _model()
        _backward(scaler, model)
        return scaler.step(opt, closure=lambda: 0.0)

    def update_without_step(cls: Any) -> Any:
        scaler, (model, _) = cls("cpu"), _model()
        _backward(scaler, model)
        return scaler.update()

    def step_before_scale(cls: Any) -> Any:
        scaler, (_, opt) = cls("cpu"), _model()
        return scaler.step(opt)

    def unscale_fp16_grads(cls: Any) -> Any:
        scaler, (model, opt) = cls("cpu"), _model()
        _backward(scaler, model)
        model.weight.grad = model.weight.grad.half()
        return scaler._unscale_grads_(opt, torch.ones(()), torch.zeros(()), False)

    def load_empty(cls: Any) -> Any:
        return cls("cpu").load_state_dict({})

    def scale_a_string(cls: Any) -> Any:
        return cls("cpu").scale([torch.ones(1), 2.0])

    def bad_new_scale(cls: Any) -> Any:
        scaler, (model, opt) = cls("cpu"), _model()
        _backward(scaler, model)
        scaler.step(opt)
        return scaler.update(torch.ones(2))

    def pickle_mid_iteration(cls: Any) -> Any:
        scaler, (model, opt) = cls("cpu"), _model()
        _backward(scaler, model)
        scaler.unscale_(opt)
        return pickle.dumps(scaler)

    return {f.__name__: f for f in (
        unscale_twice, unscale_after_step, step_twice, closure, update_without_step,
        step_before_scale, unscale_fp16_grads, load_empty, scale_a_string, bad_new_scale,
        pickle_mid_iteration,
    )}  # fmt: skip


@pytest.mark.parametrize("case", list(_misuse_cases()))
def test_misuse_raises_pytorchs_error_and_message(case: str) -> None:
    run = _misuse_cases()[case]
    theirs = _outcome(lambda: run(torch.amp.GradScaler))
    ours = _outcome(lambda: run(GradScaler))
    assert theirs[0] != "ok", f"{case} should be refused by PyTorch"
    assert ours == theirs


@CLASSES
def test_disabled_is_a_pass_through(cls: Any) -> None:
    scaler, (model, opt) = cls("cpu", enabled=False), _model()
    loss = model(torch.ones(3, 4)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    before = model.weight.detach().clone()
    scaler.unscale_(opt)
    assert scaler.step(opt, lambda: 7.0) == 7.0  # closures pass through too
    scaler.update()
    assert not torch.equal(model.weight, before)
    assert scaler.get_scale() == 1.0
    assert not scaler.is_enabled()
    assert scaler.state_dict() == {}
    scaler.load_state_dict({"scale": 3.0})  # a no-op, as PyTorch's


def test_disabled_scaler_says_it_holds_no_state() -> None:
    scaler = GradScaler("cpu", enabled=False)
    with pytest.raises(sc.InvalidArgumentError, match=r"disabled \(enabled=False\)"):
        _ = scaler.state
    _, opt = _model()
    scaler.step(opt)
    assert scaler.stepped(opt)


@CLASSES
def test_only_the_optimizer_that_overflowed_skips(cls: Any) -> None:
    scaler = cls("cpu", init_scale=8.0)
    (m1, o1), (m2, o2) = _model(1), _model(2)
    before = [m.weight.detach().clone() for m in (m1, m2)]
    _backward(scaler, m1, inject=float("inf"))
    _backward(scaler, m2)
    scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert torch.equal(m1.weight, before[0])
    assert not torch.equal(m2.weight, before[1])
    assert scaler.get_scale() == 4.0


@CLASSES
def test_update_takes_a_new_scale(cls: Any) -> None:
    scaler, (model, opt) = cls("cpu"), _model()
    for new in (1024.0, torch.tensor(8.0)):
        _backward(scaler, model)
        scaler.step(opt)
        scaler.update(new)
        assert scaler.get_scale() == float(new)


@CLASSES
def test_setters_change_the_policy(cls: Any) -> None:
    scaler, (model, opt) = cls("cpu", init_scale=8.0, growth_interval=3), _model()
    scaler.set_growth_factor(4.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(1)
    scales = []
    for inject in (None, float("nan"), None):
        opt.zero_grad()
        _backward(scaler, model, inject)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == [32.0, 8.0, 32.0]
    assert (scaler.get_growth_factor(), scaler.get_backoff_factor()) == (4.0, 0.25)


def test_setters_are_validated_before_anything_changes() -> None:
    scaler = GradScaler("cpu")
    with pytest.raises(sc.InvalidConfigError, match="growth_factor"):
        scaler.set_growth_factor(1.0)
    with pytest.raises(sc.InvalidConfigError, match="growth_interval"):
        scaler.set_growth_interval(0)
    assert scaler.get_growth_factor() == 2.0
    assert scaler.get_growth_interval() == 2000
    assert scaler.config.growth_factor == 2.0


@CLASSES
def test_sparse_fp16_duplicates_are_coalesced_before_the_check(cls: Any) -> None:
    """Two halves of 60000 at one index overflow float16 only once summed."""
    scaler, (_, opt) = cls("cpu"), _model()
    scaler.scale(torch.ones(()))  # initialises the scale
    i = torch.tensor([[0, 0]])
    for values, expected in (([1.0, 2.0], 0.0), ([6e4, 6e4], 1.0)):
        values_t = torch.tensor(values, dtype=torch.float16)
        grad = torch.sparse_coo_tensor(i, values_t, (2,), check_invariants=True)
        param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
        param.grad = grad
        opt.param_groups[0]["params"] = [param]
        found = scaler._unscale_grads_(opt, torch.ones(()), torch.zeros(()), True)
        assert [f.item() for f in found.values()] == [expected]
        assert param.grad.is_coalesced()


@CLASSES
def test_fused_optimizers_get_grad_scale_and_found_inf(cls: Any) -> None:
    seen: list[tuple[Any, Any]] = []

    class Fused(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure: Any = None) -> Any:
            seen.append((getattr(self, "grad_scale", None), self.found_inf.clone()))

    scaler, (model, _) = cls("cpu", init_scale=16.0), _model()
    opt = Fused(model.parameters(), lr=0.1)
    _backward(scaler, model, inject=float("inf"))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    _backward(scaler, model)
    scaler.unscale_(opt)  # already unscaled: grad_scale is None
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    _backward(scaler, model)
    scaler.step(opt)
    # Called on the skipped step too, as PyTorch's class calls it: skipped on found_inf.
    assert float(seen[0][0]) == 16.0
    assert seen[0][1].item() == 1.0
    assert seen[1][0] is None
    assert seen[1][1].item() == 0.0
    assert float(seen[2][0]) == 8.0
    assert seen[2][1].item() == 0.0
    assert not hasattr(opt, "grad_scale")
    assert not hasattr(opt, "found_inf")


def test_a_skipped_first_step_leaves_a_fused_sgd_as_new() -> None:
    """PyTorch's step calls a fused optimizer on a skipped step, which skips on
    ``found_inf`` but keeps the state it created: fused SGD's momentum buffers from
    ``torch.empty_like``, whose contents its next step takes for a momentum. This
    class does not call it when the skip is known: the next step is a first step."""
    results = []
    for cls in (torch.amp.GradScaler, GradScaler, None):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        scaler = (cls or GradScaler)("cpu", init_scale=2.0**10)
        for step, x in enumerate((torch.full((2, 4), math.inf), torch.ones(2, 4))):
            if cls is None and step == 0:
                continue  # the reference: a run that never saw the overflowing batch
            scaler.scale(model(x).sum()).backward()
            scaler.step(opt)
            if step == 0:
                results.append(model.weight in opt.state)
            scaler.update()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    theirs_kept_state, _, ours_kept_state, ours, fresh = results
    assert theirs_kept_state  # PyTorch's: state (uninitialised momentum) after a skip
    assert not ours_kept_state
    for a, b in zip(ours, fresh, strict=True):
        assert torch.equal(a, b)


@CLASSES
def test_state_dict_round_trips(cls: Any) -> None:
    scaler, (model, opt) = cls("cpu", init_scale=32.0, growth_interval=2), _model()
    for inject in (None, None, float("inf"), None):
        opt.zero_grad()
        _backward(scaler, model, inject)
        scaler.step(opt)
        scaler.update()
    saved = scaler.state_dict()
    fresh = cls("cpu")
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    assert {k: saved[k] for k in ("scale", "_growth_tracker")} == {
        "scale": 32.0,
        "_growth_tracker": 1,
    }


def test_state_dicts_cross_load_both_ways() -> None:
    ours, theirs = GradScaler("cpu", init_scale=64.0), torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())  # the extra key is ignored by PyTorch
    assert theirs.state_dict() == {k: v for k, v in ours.state_dict().items() if k != "scaler_core"}
    pytorch_saved = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=7).state_dict()
    loaded = GradScaler("cpu", config=sc.preset("megatron"))
    loaded.load_state_dict(pytorch_saved)
    assert loaded.state.scale == 8.0
    assert loaded.config.growth_interval == 7
    assert loaded.config.hysteresis == sc.preset("megatron").hysteresis  # ours stays ours


def test_its_own_state_dict_restores_the_whole_state() -> None:
    scaler, (model, opt) = GradScaler("cpu", config=sc.preset("megatron")), _model()
    for inject in (None, float("inf"), None):
        opt.zero_grad()
        _backward(scaler, model, inject)
        scaler.step(opt)
        scaler.update()
    fresh = GradScaler("cpu")
    fresh.load_state_dict(copy.deepcopy(scaler.state_dict()))
    assert fresh.state == scaler.state
    assert fresh.config == sc.preset("megatron")


def test_a_malformed_state_dict_loads_nothing() -> None:
    scaler = GradScaler("cpu", init_scale=4.0)
    saved = scaler.state_dict()
    saved["scaler_core"] = {**saved["scaler_core"], "scale": -1.0}
    with pytest.raises(sc.InvalidStateError):
        scaler.load_state_dict(saved)
    assert scaler.get_scale() == 4.0


@CLASSES
def test_pickles_between_iterations(cls: Any) -> None:
    scaler, (model, opt) = cls("cpu", init_scale=2.0, growth_interval=1), _model()
    assert pickle.loads(pickle.dumps(scaler)).get_scale() == 2.0  # unused
    _backward(scaler, model)
    scaler.step(opt)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.get_scale() == 4.0
    assert clone._get_growth_tracker() == 0
    assert clone.state_dict() == scaler.state_dict()
    assert clone._scale is None  # re-created lazily, as PyTorch's


def test_a_pickled_scaler_keeps_its_config_and_state() -> None:
    scaler, (model, opt) = GradScaler("cpu", config=sc.preset("megatron")), _model()
    _backward(scaler, model, inject=float("inf"))
    scaler.step(opt)
    scaler.update()
    clone = pickle.loads(pickle.dumps(scaler))
    assert clone.state == scaler.state
    assert clone.config == scaler.config


# ---------------------------------------------------------- what PyTorch's lacks
def test_any_config_or_preset_drives_the_scale() -> None:
    config = sc.preset("megatron")
    scaler, (model, opt) = GradScaler("cpu", config=config), _model()
    expected = sc.init(config)
    for step in range(12):
        inject = float("inf") if step % 3 == 0 else None
        opt.zero_grad()
        _backward(scaler, model, inject)
        scaler.step(opt)
        scaler.update()
        expected = sc.update(expected, inject is not None)
        assert scaler.state == expected


def test_config_and_pytorchs_numbers_together_are_refused() -> None:
    with pytest.raises(sc.InvalidArgumentError, match="pass the numbers in the config only"):
        GradScaler("cpu", init_scale=8.0, config=sc.ScalerConfig())
    with pytest.raises(sc.InvalidArgumentError, match="must be a ScalerConfig"):
        GradScaler("cpu", config={"init_scale": 8.0})  # type: ignore[arg-type]


def test_a_collapse_raises_where_pytorchs_goes_subnormal() -> None:
    config = sc.ScalerConfig(init_scale=2.0**-126, backoff_factor=0.5, growth_interval=10)
    ours, (m1, o1) = GradScaler("cpu", config=config), _model()
    theirs, (m2, o2) = torch.amp.GradScaler("cpu", init_scale=2.0**-126), _model()
    for scaler, model, opt in ((ours, m1, o1), (theirs, m2, o2)):
        _backward(scaler, model, inject=float("nan"))
        scaler.step(opt)
    theirs.update()
    assert 0 < theirs.get_scale() < 2.0**-126  # PyTorch's: silently subnormal
    with pytest.raises(sc.ScaleCollapseError, match="not a normal float32"):
        ours.update()
    assert ours.get_scale() == 2.0**-126  # left as it was
    ours.abandon_step()  # the way on: drop this iteration's checks
    o1.zero_grad()
    _backward(ours, m1)
    ours.step(o1)
    ours.update()
    assert ours.state.consecutive_skips == 0


def test_stepped_tells_whether_the_optimizer_ran() -> None:
    scaler, (model, opt) = GradScaler("cpu"), _model()
    with pytest.raises(sc.InvalidArgumentError, match=r"call scaler.step\(optimizer\) first"):
        scaler.stepped(opt)
    for inject, ran in ((float("inf"), False), (None, True)):
        opt.zero_grad()
        _backward(scaler, model, inject)
        scaler.step(opt)
        assert scaler.stepped(opt) is ran
        scaler.update()
    assert scaler.state.skipped_steps == 1


def test_the_state_reports_skip_accounting() -> None:
    scaler, (model, opt) = GradScaler("cpu", init_scale=8.0), _model()
    assert scaler.state.scale == 8.0  # before the first scale()
    for inject in (float("inf"), float("nan"), None):
        opt.zero_grad()
        _backward(scaler, model, inject)
        scaler.step(opt)
        scaler.update()
    state = scaler.state
    assert (state.scale, state.skipped_steps, state.consecutive_skips) == (2.0, 2, 0)


def test_an_unscale_that_overflows_below_one_skips_where_pytorchs_steps() -> None:
    """PyTorch checks the scaled gradients; below 1 the unscale itself can overflow."""
    results = {}
    for cls in (torch.amp.GradScaler, GradScaler):
        scaler, (model, opt) = cls("cpu", init_scale=2.0**-8), _model()
        _backward(scaler, model)
        model.weight.grad.fill_(3e36)  # finite; 3e36 * 256 is not
        scaler.step(opt)
        scaler.update()
        results[cls] = bool(torch.isfinite(model.weight).all())
    assert results == {torch.amp.GradScaler: False, GradScaler: True}


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.SGD])
def test_a_fused_optimizer_is_skipped_when_its_own_unscale_would_overflow(opt_cls: Any) -> None:
    results = {}
    for cls in (torch.amp.GradScaler, GradScaler):
        w = torch.nn.Parameter(torch.ones(3))
        opt = opt_cls([w], lr=0.1, fused=True)
        scaler = cls("cpu", init_scale=2.0**-8)
        scaler.scale(w.sum()).backward()
        assert w.grad is not None
        w.grad.fill_(3e36)
        scaler.step(opt)
        scaler.update()
        results[cls] = bool(torch.isfinite(w).all())
    assert results == {torch.amp.GradScaler: False, GradScaler: True}


def test_found_inf_stays_one_when_both_checks_find_it() -> None:
    """Fused optimizers skip only where found_inf == 1: two hits must not make 2."""
    scaler, (model, opt) = GradScaler("cpu", init_scale=0.25), _model()
    _backward(scaler, model, inject=float("inf"))
    scaler.unscale_(opt)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert [f.item() for f in found.values()] == [1.0]


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan"), -2.0, 1e-45, "8"])
def test_a_new_scale_that_is_no_scale_is_refused(bad: Any) -> None:
    """PyTorch's class takes update(0.0) and trains on with a zero scale."""
    scaler, (model, opt) = GradScaler("cpu", init_scale=8.0), _model()
    _backward(scaler, model)
    scaler.step(opt)
    with pytest.raises(sc.InvalidArgumentError, match=r"new_scale=.*normal float32"):
        scaler.update(bad)
    assert scaler.get_scale() == 8.0
    scaler.update(1024)  # an int is a scale too (PyTorch's class fails on it)
    assert scaler.get_scale() == 1024.0


def test_the_state_dict_carries_the_spike_fields_and_a_version_1_payload_loads() -> None:
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    one_step(scaler, float("inf"))
    one_step(scaler, 1.0)
    saved = scaler.state_dict()
    payload = saved["scaler_core"]
    assert payload["version"] == 2
    assert payload["state"]["last_kind"] == sc.StepKind.COUNT.code
    assert {"norm_mean", "norm_var", "norm_count"} <= set(payload["state"])
    assert payload["config"]["spike_threshold"] is None
    old = version_1(payload)  # as scaler-core wrote it before spike skipping existed
    fresh = GradScaler("cpu")
    fresh.load_state_dict({**saved, "scaler_core": old})
    assert fresh.state.scale == scaler.state.scale == 2.0**9
    assert (fresh.state.steps, fresh.state.skipped_steps) == (2, 1)
    assert fresh.state.last_step is None
    one_step(fresh, 1.0)  # the float32 statistics tensors live next to the counters
    assert fresh.state.last_step is sc.StepKind.COUNT
    extra = fresh._held.extra
    assert extra is not None
    assert extra["norm_mean"].dtype == torch.float32
    assert extra["norm_count"].dtype == torch.int32


def test_the_drop_in_refuses_spike_skipping_with_the_way_out() -> None:
    config = sc.ScalerConfig(spike_threshold=6.0)
    with pytest.raises(sc.InvalidArgumentError, match=r"spike_threshold=6\.0.*functional API"):
        GradScaler("cpu", config=config)
    scaler = GradScaler("cpu")
    saved = scaler.state_dict()
    saved["scaler_core"] = sc.to_dict(sc.init(config))
    before = scaler.state
    with pytest.raises(sc.InvalidArgumentError, match="spike_threshold"):
        scaler.load_state_dict(saved)
    assert scaler.state == before


@CLASSES
def test_a_second_step_of_a_fused_optimizer_raises_pytorchs_error(cls: Any) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = cls("cpu", init_scale=2.0**10)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"^step\(\) has already been called since the last"):
        scaler.step(opt)


# ------------------------------------------------ PyTorch's fused-step behaviour
def _fused_run(cls: Any, make: Any, route: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Steps of a fused optimizer with overflows at the first step and later ones, a
    growth every 2 clean steps: what a framework can look at after each."""
    from scaler_core.backends import torch_kernels

    if route == "device":  # an accelerator's route, driven with CPU tensors
        monkeypatch.setattr(torch_kernels, "reads_free", lambda device: False)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = make(model.parameters())
    calls: list[int] = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    scaler = cls("cpu", init_scale=2.0**10, growth_interval=2)
    out: dict[str, Any] = {"calls": [], "stepped": [], "scales": [], "state_after_first": None}
    for step in range(7):
        x = torch.ones(2, 4) * (math.inf if step in (0, 3) else 1.0 + step)
        scaler.scale(model(x).pow(2).sum()).backward()
        scaler.step(opt)
        out["calls"].append(len(calls))
        if isinstance(scaler, GradScaler):
            out["stepped"].append(scaler.stepped(opt))
        scaler.update()
        out["scales"].append(scaler.get_scale())
        if step == 0:
            out["state_after_first"] = copy.deepcopy(opt.state_dict())
        opt.zero_grad()
    monkeypatch.undo()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["state"] = opt.state_dict()
    return out


@pytest.mark.parametrize("route", ["host", "device"])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True, amsgrad=True),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),  # no momentum: no buffers
    ],
    ids=["adamw", "adam-amsgrad", "adagrad", "sgd"],
)
def test_a_fused_optimizer_is_called_on_every_step_as_pytorchs(
    make: Any, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyTorch's class calls a fused optimizer's step on a skipped step too, with the flag
    as ``found_inf``; so does this one, on the CPU and on an accelerator's route (it used
    not to call it where the skip was known on the host: accelerate then reported the
    step skipped, and the HF Trainer held its LR schedule back). The state a skipped
    first step creates, the parameters, the state after every step and the scales are
    PyTorch's bit for bit; ``stepped()`` still tells the skips."""
    theirs = _fused_run(torch.amp.GradScaler, make, "host", monkeypatch)
    ours = _fused_run(GradScaler, make, route, monkeypatch)
    assert ours["calls"] == theirs["calls"] == [1, 2, 3, 4, 5, 6, 7]
    assert ours["stepped"] == [s not in (0, 3) for s in range(7)]
    assert ours["scales"] == theirs["scales"]
    assert max(ours["scales"]) > 2.0**9  # it grew after the backoffs
    assert_same_optimizer_state(
        ours["state_after_first"]["state"], theirs["state_after_first"]["state"]
    )
    for a, b in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(a, b)
    assert_same_optimizer_state(ours["state"]["state"], theirs["state"]["state"])


@pytest.mark.parametrize("route", ["host", "device"])
def test_a_fused_sgd_with_momentum_skipped_first_is_not_called_on_any_route(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one exception, the same on both routes: PyTorch's call would keep momentum
    buffers of uninitialised memory. After its first real step it is called as usual."""
    ours = _fused_run(
        GradScaler,
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
        route,
        monkeypatch,
    )
    assert ours["calls"] == [0, 1, 2, 3, 4, 5, 6]  # not called at step 0, called at step 3
    assert ours["stepped"] == [s not in (0, 3) for s in range(7)]
    assert ours["state_after_first"]["state"] == {}
