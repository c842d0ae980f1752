"""``scaler_core.megatron``: scaler-core's scaler in the seat of Megatron's ``DynamicGradScaler``.

The oracle is megatron-core's own ``DynamicGradScaler`` (and its optimizers), run here on
the CPU. Megatron builds its tensors with ``device='cuda'`` and checks its parameters'
type names (``torch.cuda.HalfTensor``); :class:`CudaOnCpu` (a ``TorchFunctionMode``, as
``tests/oracles/anchor_worker.py`` uses for the scaler alone) turns that device into the
CPU, answers ``Tensor.type()`` with the CUDA name and makes ``Tensor.cuda()`` a no-op,
applied alike to both runs of every comparison. The preset itself against Megatron's class
is ``tests/oracles/test_presets_anchors.py``; here it is the new class: its tensors, its
``update``, its ``state_dict`` read by Megatron's class and Megatron's read by it, mid-run,
both ways; the hysteresis tracker past its last credit; the growth Megatron takes to inf;
and ``install`` on a real ``Float16OptimizerWithFloat16Params`` (one gloo rank) training
float16 against the same optimizer with Megatron's scaler, through Megatron's own
optimizer checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import math
import random
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the megatron integration needs PyTorch")
with warnings.catch_warnings():  # megatron.core's imports warn (no TE/apex; torch.jit)
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core", reason="needs megatron-core (dependency group oracles)")
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.grad_scaler import (
        ConstantGradScaler,
        DynamicGradScaler,
    )
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        Float16OptimizerWithFloat16Params,
        FP32Optimizer,
    )
from torch.overrides import TorchFunctionMode  # noqa: E402

import scaler_core as sc  # noqa: E402
from scaler_core.megatron import STATE_KEY, GradScaler, install  # noqa: E402

pytestmark = pytest.mark.torch

Params = dict[str, Any]
DEFAULTS: Params = {
    "initial_scale": 2.0**32,
    "min_scale": 1.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 1000,
    "hysteresis": 2,
}


class CudaOnCpu(TorchFunctionMode):
    """Megatron's CUDA-only spots, on the CPU: ``device='cuda'`` is the CPU,
    ``Tensor.type()`` names the CUDA type, ``Tensor.cuda()`` stays put."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device")) == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # DynamicGradScaler.load_state_dict asks for the current CUDA device.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def theirs(**params: Any) -> Any:
    """Megatron's own scaler, built on the CPU."""
    with CudaOnCpu():
        return DynamicGradScaler(**{**DEFAULTS, **params})


def their_load(scaler: Any, state_dict: dict[str, Any]) -> None:
    with CudaOnCpu():
        scaler.load_state_dict(state_dict)


def bits(t: Any) -> list[int]:
    return t.view(torch.int32).tolist()


def assert_same(ours: GradScaler, mega: Any, where: object) -> None:
    """Scale and inverse scale to the bit, as tensors of Megatron's kind, and the trackers."""
    for name in ("scale", "inv_scale"):
        a, b = getattr(ours, name), getattr(mega, name)
        assert (a.dtype, tuple(a.shape), a.device) == (b.dtype, tuple(b.shape), b.device), where
        assert bits(a) == bits(b), (where, name, a, b)
    assert ours.state.growth_tracker == mega._growth_tracker, where
    assert ours.state.hysteresis_tracker == max(1, mega._hysteresis_tracker), where


# ------------------------------------------------------------------ the trajectory
def _flag(rng: random.Random, scale: float, start: float, p: float) -> bool:
    """An overflow as training makes them: at random (rate ``p``), and always once the
    scale passes a ceiling drawn around 2**8 above where it started, so the scale
    hovers in a band instead of drifting to either end of float32."""
    return rng.random() < p or math.log2(scale) > math.log2(start) + rng.uniform(4.0, 12.0)


STEPS_PER_RUN = 3000
CONFIGS: list[tuple[Params, float]] = [
    ({}, 0.0003),  # Megatron's defaults over thousands of steps
    ({"growth_interval": 3, "hysteresis": 1}, 0.2),
    ({"growth_interval": 5, "hysteresis": 3, "initial_scale": 8.0, "min_scale": 1.0}, 0.3),
    ({"growth_interval": 2, "hysteresis": 4, "backoff_factor": 0.9, "growth_factor": 1.5}, 0.25),
    ({"growth_interval": 4, "hysteresis": 2, "backoff_factor": 0.25, "growth_factor": 3.0}, 0.2),
    ({"growth_interval": 1, "hysteresis": 2, "initial_scale": 3.0, "min_scale": 0.75}, 0.5),
    ({"growth_interval": 7, "hysteresis": 2, "initial_scale": 2.0**100}, 0.05),
]


@pytest.mark.parametrize(("params", "p"), CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_trajectory_equals_megatron_with_resumes_both_ways(params: Params, p: float) -> None:
    rng = random.Random(f"megatron-{params}")
    start = {**DEFAULTS, **params}["initial_scale"]
    ours, mega = GradScaler(**params, device="cpu"), theirs(**params)
    assert_same(ours, mega, "start")
    kinds = Counter[str]()
    resumes = {
        rng.randrange(100, 1500): "ours->megatron",
        rng.randrange(1500, 2900): "megatron->ours",
    }
    for i in range(STEPS_PER_RUN):
        flag = _flag(rng, ours.state.scale, start, p)
        if resumes.get(i) == "ours->megatron":  # Megatron resumes from our dict
            mega = theirs(**params)
            their_load(mega, ours.state_dict())
        elif resumes.get(i) == "megatron->ours":  # we resume from Megatron's dict
            ours = GradScaler(**params, device="cpu")
            ours.load_state_dict(mega.state_dict())
            assert ours.state.steps == 0
        assert_same(ours, mega, (i, "before"))
        before = ours.state.scale
        ours.update(flag)
        mega.update(flag)
        kinds[ours.state.last_step.value] += 1
        if torch.isinf(mega.scale).item():  # Megatron grew past float32; we hold
            assert ours.state.last_step is sc.StepKind.GROWTH_BLOCKED
            assert ours.state.scale == before
            pytest.fail(f"{params}: grew to inf at {i}, not expected with these flags")
        assert_same(ours, mega, i)
    assert sum(kinds.values()) == STEPS_PER_RUN
    assert kinds["grow"], kinds
    if params:  # Megatron's defaults grow 3 times in 3000 steps and meet no overflow
        assert kinds["backoff"], kinds
        if params.get("hysteresis", 2) > 1:
            assert kinds["hysteresis"], kinds


def test_the_trajectories_meet_every_kind() -> None:
    """The configs above reach the floor, where Megatron's max() holds the scale."""
    ours, mega = GradScaler(initial_scale=2.0, min_scale=1.0, hysteresis=1, device="cpu"), None
    mega = theirs(initial_scale=2.0, min_scale=1.0, hysteresis=1)
    for flag in (True, True, True):
        ours.update(flag)
        mega.update(flag)
        assert_same(ours, mega, flag)
    assert ours.state.last_step is sc.StepKind.HOLD_AT_FLOOR
    assert ours.scale.item() == 1.0


# ------------------------------------------------------- hysteresis past its credit
@pytest.mark.parametrize("overflows", [2, 3, 4, 9])
def test_megatron_tracker_past_its_last_credit_loads_as_one(overflows: int) -> None:
    mega = theirs(initial_scale=2.0**20, growth_interval=4, hysteresis=2)
    for _ in range(overflows):
        mega.update(True)
    assert mega._hysteresis_tracker == 2 - overflows  # 0, -1, ... -7: Megatron counts on
    ours = GradScaler(initial_scale=2.0**20, growth_interval=4, hysteresis=2, device="cpu")
    ours.load_state_dict(mega.state_dict())
    assert ours.state.hysteresis_tracker == 1
    # Same decisions from there: an overflow backs off at once, a growth refills both.
    for flag in [True, False, False, False, False, True, True, False]:
        ours.update(flag)
        mega.update(flag)
        assert_same(ours, mega, flag)
    # The growth refilled both to 2; two overflows took Megatron's to 0 and ours to 1.
    assert (mega._hysteresis_tracker, ours.state.hysteresis_tracker) == (0, 1)
    assert ours.state.last_step is sc.StepKind.COUNT


@pytest.mark.parametrize(
    ("tracker", "message"),
    [
        (3, r"\['hysteresis_tracker'\]=3"),
        (True, r"\]=True"),
        (1.0, r"\['hysteresis_tracker'\]=1.0"),
    ],
)
def test_a_tracker_out_of_range_is_refused_and_nothing_changes(tracker: Any, message: str) -> None:
    ours = GradScaler(initial_scale=2.0**20, hysteresis=2, device="cpu")
    ours.update(True)
    before = ours.state
    saved = {
        **theirs(initial_scale=2.0**20, hysteresis=2).state_dict(),
        "hysteresis_tracker": tracker,
    }
    with pytest.raises(sc.InvalidStateError, match=message):
        ours.load_state_dict(saved)
    assert ours.state is before


# --------------------------------------------------------------------- growth to inf
def test_megatron_grows_to_inf_where_we_hold() -> None:
    ours = GradScaler(initial_scale=2.0**127, growth_interval=1, device="cpu")
    mega = theirs(initial_scale=2.0**127, growth_interval=1)
    ours.update(False)
    mega.update(False)
    assert torch.isinf(mega.scale).all()  # Megatron's scale is now inf, for good:
    mega.update(True)
    mega.update(True)
    assert torch.isinf(mega.scale).all()  # inf * 0.5 is inf
    assert ours.state.last_step is sc.StepKind.GROWTH_BLOCKED
    assert bits(ours.scale) == bits(torch.tensor([2.0**127]))
    assert "past the largest float32" in sc.PRESETS["megatron"].differences
    ours.update(True)
    ours.update(True)
    assert ours.scale.item() == 2.0**126  # we train on
    # Megatron's inf checkpoint is refused, nothing loaded.
    before = ours.state
    with pytest.raises(sc.InvalidStateError, match=r"state_dict\['scale'\]=inf"):
        ours.load_state_dict(mega.state_dict())
    assert ours.state is before


def test_a_config_ceiling_is_kept() -> None:
    config = dataclasses.replace(
        sc.preset("megatron", initial_scale=2.0**10, growth_interval=1),
        max_scale=2.0**11,
        at_max_scale="clamp",
    )
    ours = GradScaler(config=config, device="cpu")
    for _ in range(3):
        ours.update(False)
    assert ours.scale.item() == 2.0**11


# ----------------------------------------------------------------- the state dict
def test_state_dict_round_trips_through_torch_save() -> None:
    ours = GradScaler(initial_scale=2.0**9, growth_interval=3, hysteresis=3, device="cpu")
    for flag in (True, False, True, True, False, False):
        ours.update(flag)
    buffer = io.BytesIO()
    torch.save(ours.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    other = GradScaler(device="cpu")  # another config: the saved one comes back
    other.load_state_dict(loaded)
    assert other.state == ours.state
    assert other.config == ours.config
    assert bits(other.scale) == bits(ours.scale)


def test_megatron_entries_win_over_the_payload() -> None:
    ours = GradScaler(initial_scale=2.0**9, hysteresis=3, device="cpu")
    ours.update(True)
    saved = ours.state_dict()
    saved["scale"] = torch.tensor([2.0**5])  # edited by hand, as Megatron's class loads it
    saved["hysteresis_tracker"] = -2
    other = GradScaler(device="cpu")
    other.load_state_dict(saved)
    assert other.scale.item() == 2.0**5
    assert other.state.hysteresis_tracker == 1
    assert other.state.steps == 1  # the rest from the payload
    assert other.config == ours.config


@pytest.mark.parametrize(
    ("saved", "message"),
    [
        ({}, "non-empty dict"),
        (
            {"scale": torch.tensor([1.0]), "growth_tracker": 0},
            r"missing keys \['hysteresis_tracker'\]",
        ),
        (
            {"scale": torch.tensor([1.0]), "growth_tracker": 0, "hysteresis_tracker": 2, "x": 1},
            "unknown keys",
        ),
        (
            {"scale": torch.tensor([1.0, 2.0]), "growth_tracker": 0, "hysteresis_tracker": 2},
            "one-element float tensor",
        ),
        (
            {"scale": torch.tensor([0.5]), "growth_tracker": 0, "hysteresis_tracker": 2},
            r"\['scale'\]=0.5",
        ),
        (
            {"scale": torch.tensor([8.0]), "growth_tracker": -1, "hysteresis_tracker": 2},
            "growth_tracker",
        ),
    ],
)
def test_bad_dicts_are_refused_and_nothing_changes(saved: dict[str, Any], message: str) -> None:
    ours = GradScaler(initial_scale=2.0**4, device="cpu")  # min_scale 1
    ours.update(True)
    before = ours.state
    with pytest.raises(sc.InvalidStateError, match=message):
        ours.load_state_dict(saved)
    assert ours.state is before


# ------------------------------------------------------------------ flags, tensors
@pytest.mark.parametrize(
    ("flag", "found"),
    [
        (True, True),
        (False, False),
        (np.bool_(True), True),
        (torch.tensor([0.0]), False),
        (torch.tensor([1.0]), True),
        (torch.tensor([float("nan")]), True),
        (torch.tensor(True), True),
    ],
    ids=["true", "false", "numpy", "zero", "one", "nan", "bool-tensor"],
)
def test_flags_as_megatron_passes_them(flag: Any, found: bool) -> None:
    ours = GradScaler(initial_scale=2.0**4, hysteresis=1, device="cpu")
    ours.update(flag)
    assert sc.step_skipped(ours.state) is found


@pytest.mark.parametrize(
    "flag", [1, 0.0, None, torch.tensor([0.0, 1.0]), torch.tensor([1])], ids=str
)
def test_other_flags_are_refused_and_nothing_changes(flag: Any) -> None:
    ours = GradScaler(device="cpu")
    before = ours.state
    with pytest.raises(sc.GradientTypeError, match="found_inf"):
        ours.update(flag)
    assert ours.state is before


def test_tensors_and_device_are_megatrons() -> None:
    ours = GradScaler()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert ours.device.type == expected == ours.scale.device.type
    assert (ours.scale.dtype, tuple(ours.scale.shape)) == (torch.float32, (1,))
    first = ours.scale
    ours.update(False)
    assert ours.scale is first  # unchanged scale: the same tensor
    ours = GradScaler(initial_scale=2.0**16, hysteresis=1, device="cpu")
    first = ours.scale
    ours.update(True)
    assert ours.scale is not first
    assert first.item() == 2.0**16


def test_constructor_refusals() -> None:
    with pytest.raises(sc.InvalidArgumentError, match="one place"):
        GradScaler(hysteresis=3, config=sc.preset("megatron"))
    with pytest.raises(sc.InvalidArgumentError, match="spike_threshold"):
        GradScaler(config=sc.preset("megatron", spike_threshold=6.0))
    with pytest.raises(sc.InvalidArgumentError, match="device="):
        GradScaler(device="not a device")
    with pytest.raises(sc.InvalidConfigError, match="min_scale"):
        GradScaler(initial_scale=1.0, min_scale=2.0)


# ------------------------------------------------------------------------ install
@pytest.fixture
def one_rank(tmp_path: Any) -> Iterator[Any]:
    """A one-rank gloo group, the group Megatron reduces its found flag over."""
    dist = torch.distributed
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


GROWTH_INTERVAL = 3
INF_AT = {5, 6, 12}  # hysteresis 2: the first overflow spends a credit, the second backs off
STEPS = 16
RESUME_AT = 9


def _optimizer(group: Any, *, chained: bool, fp16: bool = True, scaler: str = "dynamic") -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = model.half() if fp16 else model
    config = OptimizerConfig(
        optimizer="adam",
        lr=1e-2,
        fp16=fp16,
        bf16=not fp16,
        clip_grad=0.0,
        initial_loss_scale=2.0**12,
        loss_scale_window=GROWTH_INTERVAL,
        hysteresis=2,
    )
    with CudaOnCpu():
        grad_scaler = {
            "dynamic": lambda: DynamicGradScaler(
                initial_scale=2.0**12,
                min_scale=1.0,
                growth_factor=2.0,
                backoff_factor=0.5,
                growth_interval=GROWTH_INTERVAL,
                hysteresis=2,
            ),
            "constant": lambda: ConstantGradScaler(2.0**12),
            "none": lambda: None,
        }[scaler]()
        # The keys get_megatron_optimizer's param groups carry (its checkpoint matches them).
        group_keys = {
            "wd_mult": 1.0,
            "lr_mult": 1.0,
            "is_expert_parallel": False,
            "is_decoupled_lr": False,
        }
        adam = torch.optim.Adam([{"params": list(model.parameters()), **group_keys}], lr=1e-2)
        opt = Float16OptimizerWithFloat16Params(adam, config, grad_scaler, lambda *a: None)
    opt.grad_stats_parallel_group = group
    opt.model = model
    return ChainedOptimizer([opt]) if chained else opt


def _train(group: Any, *, ours: bool, chained: bool) -> dict[str, Any]:
    """16 float16 steps through Megatron's optimizer, with a resume from its own checkpoint."""
    opt = _optimizer(group, chained=chained)
    inner = opt.chained_optimizers[0] if chained else opt
    if ours:
        (new,) = install(opt)
        assert inner.grad_scaler is new
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)) for _ in range(STEPS)
    ]
    scales, steps, dtypes = [], [], set()
    for i, (x, y) in enumerate(data):
        if i == RESUME_AT:  # Megatron's own optimizer checkpoint, through torch.save
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            buffer.seek(0)
            opt = _optimizer(group, chained=chained)
            inner = opt.chained_optimizers[0] if chained else opt
            if ours:
                install(opt)
            with CudaOnCpu():  # Megatron's scaler loads its scale with .cuda()
                opt.load_state_dict(torch.load(buffer, weights_only=False))
        out = inner.model(x.half())
        dtypes.add(out.dtype)
        loss = ((out.float() - y) ** 2).mean()
        opt.scale_loss(loss).backward()
        if i in INF_AT:
            inner.model[0].weight.grad[0, 0] = float("inf")
        with CudaOnCpu():
            ok, _, _ = opt.step()
        opt.zero_grad()
        steps.append(ok)
        scales.append(bits(opt.get_loss_scale()))
    return {
        "scales": scales,
        "steps": steps,
        "dtypes": dtypes,
        "params": [p.detach().clone() for p in inner.model.parameters()],
        "main": [p.detach().clone() for g in inner.fp32_from_float16_groups for p in g],
        "adam": opt.state_dict(),
        "kind": type(inner.grad_scaler),
    }


def _same_tree(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(
            a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b
        ), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_install_trains_as_megatron_bit_for_bit(one_rank: Any) -> None:
    mega = _train(one_rank, ours=False, chained=False)
    ours = _train(one_rank, ours=True, chained=False)
    assert mega["kind"] is DynamicGradScaler
    assert ours["kind"] is GradScaler
    assert ours["dtypes"] == {torch.float16}  # the forward ran in float16
    assert ours["scales"] == mega["scales"]  # after every step
    assert ours["steps"] == mega["steps"]
    assert ours["steps"].count(False) == len(INF_AT)  # real skips
    grown = [torch.tensor(s, dtype=torch.int32).view(torch.float32).item() for s in ours["scales"]]
    assert max(grown) > 2.0**12
    assert min(grown) < max(grown)
    _same_tree(ours["params"], mega["params"], "params")
    _same_tree(ours["main"], mega["main"], "main params")
    gs_ours, gs_mega = dict(ours["adam"]["grad_scaler"]), dict(mega["adam"]["grad_scaler"])
    # Our counters went through Megatron's checkpoint: every step is counted.
    assert gs_ours.pop(STATE_KEY)["state"]["steps"] == STEPS
    gs_mega["hysteresis_tracker"] = max(1, gs_mega["hysteresis_tracker"])
    _same_tree(gs_ours, gs_mega, "grad_scaler")
    rest = [{k: v for k, v in r["adam"].items() if k != "grad_scaler"} for r in (ours, mega)]
    _same_tree(rest[0], rest[1], "optimizer")


def test_install_into_the_chained_optimizer(one_rank: Any) -> None:
    """get_megatron_optimizer returns a ChainedOptimizer; each optimizer it chains has a
    scaler of its own, and each is replaced (its loss scale is the first one's)."""
    parts = [_optimizer(one_rank, chained=False) for _ in range(2)]
    parts[1].grad_scaler.update(True)
    parts[1].grad_scaler.update(True)
    olds = [p.grad_scaler for p in parts]
    chained = ChainedOptimizer(parts)
    new = install(chained)
    assert [p.grad_scaler for p in parts] == list(new)
    assert len(new) == 2
    assert chained.get_loss_scale() is new[0].scale
    for ours, mega in zip(new, olds, strict=True):
        assert_same(ours, mega, "chained")


def test_install_carries_megatrons_numbers_and_state(one_rank: Any) -> None:
    opt = _optimizer(one_rank, chained=False)
    old = opt.grad_scaler
    for flag in (True, False, True, True):  # two backoffs, Megatron's tracker at -1
        old.update(flag)
    (new,) = install(opt)
    assert opt.grad_scaler is new
    assert new.device == old.scale.device
    assert new.config == sc.preset(
        "megatron", initial_scale=2.0**10, growth_interval=GROWTH_INTERVAL, hysteresis=2
    )
    assert_same(new, old, "handover")
    for flag in (True, False, False, False, True):
        new.update(flag)
        old.update(flag)
        assert_same(new, old, flag)


def test_install_refusals_change_nothing(one_rank: Any) -> None:
    with pytest.raises(sc.InvalidArgumentError, match="grad_scaler=None"):
        install(_optimizer(one_rank, chained=False, fp16=False, scaler="none"))
    with pytest.raises(sc.InvalidArgumentError, match="ConstantGradScaler"):
        install(_optimizer(one_rank, chained=False, scaler="constant"))
    with pytest.raises(sc.InvalidArgumentError, match="FP32Optimizer"):
        # Built without __init__ (it asks CUDA): install reads only its class.
        install(FP32Optimizer.__new__(FP32Optimizer))
    good = _optimizer(one_rank, chained=False)
    bad = _optimizer(one_rank, chained=False, scaler="constant")
    old = good.grad_scaler
    with pytest.raises(sc.InvalidArgumentError, match="chained optimizer 1"):
        install(ChainedOptimizer([good, bad]))
    assert good.grad_scaler is old  # nothing changed
    install(good)
    with pytest.raises(sc.InvalidArgumentError, match="already scaler-core's"):
        install(good)
    grown = _optimizer(one_rank, chained=False)
    grown.grad_scaler._scale = torch.tensor([float("inf")])
    old = grown.grad_scaler
    with pytest.raises(sc.InvalidStateError, match="past the largest float32"):
        install(grown)
    assert grown.grad_scaler is old
