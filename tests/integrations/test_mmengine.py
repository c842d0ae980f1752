"""``scaler_core.mmengine``: scaler-core's scaler in mmengine's ``AmpOptimWrapper``.

Each run trains in mmengine's own ``Runner`` (iteration-based loop, gradient
accumulation, clipping, a ``MultiStepLR`` schedule, ``CheckpointHook``) twice from
the same seed and batches: once with mmengine's ``AmpOptimWrapper``, once with
``ScalerCoreAmpOptimWrapper`` from the same config, and the scales after every
optimizer step, the parameters and the optimizer state must agree to the bit. Then
each resumes, through mmengine's own checkpoint (``resume=True``), from the
checkpoint written halfway, and ours also from mmengine's wrapper's checkpoint;
every resumed run must end where the uninterrupted one did.

mmengine runs as on a GPU (the fixture ``as_on_a_gpu``): ``AmpOptimWrapper``
refuses to be built without an accelerator, builds ``torch.cuda.amp.GradScaler``,
and its ``autocast`` takes bfloat16 alone on the CPU. The fixture answers its
device check as a GPU would, builds that scaler on the CPU
(``torch.amp.GradScaler("cpu")``, the same class), and replays the ``cuda`` branch
of ``mmengine.runner.amp.autocast`` with the CPU's float16 autocast; it acts the
same on both runs, and the model checks that its forward ran in float16.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

torch = pytest.importorskip("torch", reason="the mmengine integration needs PyTorch")
pytest.importorskip("mmengine", reason="needs mmengine (pip install mmengine)")
# First, as it silences the torch.jit.script deprecation mmengine.optim's import raises.
from scaler_core.mmengine import NAME, ScalerCoreAmpOptimWrapper  # noqa: E402, I001
from common_torch import assert_same_optimizer_state  # noqa: E402
from mmengine.hooks import Hook  # noqa: E402
from mmengine.logging import MMLogger  # noqa: E402
from mmengine.model import BaseModel  # noqa: E402
from mmengine.optim import AmpOptimWrapper  # noqa: E402
from mmengine.optim.optimizer import amp_optimizer_wrapper  # noqa: E402
from mmengine.registry import OPTIM_WRAPPERS  # noqa: E402
from mmengine.runner import Runner  # noqa: E402
from mmengine.runner import amp as mmengine_amp  # noqa: E402

import scaler_core as sc  # noqa: E402
from scaler_core.torch import STATE_KEY, GradScaler, ShardedGradScaler  # noqa: E402

pytestmark = pytest.mark.torch

ITERS = 12  # 6 optimizer steps with accumulative_counts=2
HALF = 6  # the checkpoint resumed from (after 3 steps)
INF_AT = {6}  # runner.iter whose gradient gets an inf: step 4 (iters 6 and 7) is skipped
DYNAMIC = {"init_scale": 2.0**10, "growth_interval": 2}
_names = itertools.count()


@pytest.fixture
def as_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmengine's AmpOptimWrapper and autocast as on a GPU, for both wrappers alike."""

    def scaler_as_on_a_gpu(**kwargs: Any) -> torch.amp.GradScaler:
        # torch.cuda.amp.GradScaler(**kwargs) is torch.amp.GradScaler("cuda", **kwargs)
        return torch.amp.GradScaler("cpu", **kwargs)

    @contextmanager
    def autocast_as_on_a_gpu(
        device_type: str | None = None,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> Iterator[None]:
        # mmengine/runner/amp.py (0.10.7), autocast, the device_type == "cuda" branch:
        # the dtype defaults to the GPU's autocast dtype, float16.
        if cache_enabled is None:
            cache_enabled = torch.is_autocast_cache_enabled()
        if dtype is None:
            dtype = torch.float16
        with torch.autocast("cpu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled):
            yield

    monkeypatch.setattr(amp_optimizer_wrapper, "is_cuda_available", lambda: True)
    monkeypatch.setattr(amp_optimizer_wrapper, "GradScaler", scaler_as_on_a_gpu)
    monkeypatch.setattr(mmengine_amp, "autocast", autocast_as_on_a_gpu)


class _Net(BaseModel):  # type: ignore[misc]
    """A small regression net that records its hidden activation's dtype, and whose
    first weight's gradient gets an inf while ``inject`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)
        self.dtypes: set[torch.dtype] = set()
        self.inject = False
        self.hidden.weight.register_hook(self._inject)

    def _inject(self, grad: torch.Tensor) -> torch.Tensor:
        if self.inject:
            grad = grad.clone()
            grad[0, 0] = math.inf
        return grad

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, mode: str = "loss") -> Any:
        h = self.hidden(inputs)
        self.dtypes.add(h.dtype)
        pred = self.out(torch.tanh(h)).float()
        return {"loss": torch.nn.functional.mse_loss(pred, labels)}


class _Data(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self) -> None:
        self.x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        self.y = self.x[:, :1] * 2 - self.x[:, 1:2]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.x[index], "labels": self.y[index]}


class _Record(Hook):  # type: ignore[misc]
    """Injects the inf, and records the scale (and ours, ``step_taken``) after each step."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.taken: list[bool] = []

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        runner.model.inject = runner.iter in INF_AT

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None
    ) -> None:
        wrapper = runner.optim_wrapper
        if wrapper.should_update():  # update_params stepped this iteration
            self.scales.append(wrapper.loss_scaler.get_scale())
            if isinstance(wrapper, ScalerCoreAmpOptimWrapper):
                self.taken.append(wrapper.step_taken)


@contextmanager
def _unpickling(resuming: bool) -> Iterator[None]:
    """mmengine 0.10.7 loads its checkpoints with ``torch.load``'s default, which PyTorch
    2.6 made ``weights_only=True``; they hold mmengine's and NumPy's objects (its message
    hub's ``HistoryBuffer``), ours none other. PyTorch's switch back, as users resume."""
    if not resuming:
        yield
        return
    warnings.filterwarnings(
        "ignore",
        message="Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD",
        category=UserWarning,
    )
    with mock.patch.dict(os.environ, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}):
        yield


def _train(
    work_dir: Path,
    wrapper: str,
    loss_scale: Any,
    optimizer: str,
    load_from: Path | None = None,
) -> dict[str, Any]:
    """Train ``ITERS`` iterations in mmengine's Runner (resuming from ``load_from``)."""
    torch.manual_seed(0)
    model = _Net()
    record = _Record()
    name = f"mmengine_test_{next(_names)}"  # mmengine keeps its loggers and hubs by name
    runner = Runner(
        model=model,
        work_dir=str(work_dir),
        experiment_name=name,
        train_dataloader={
            "dataset": _Data(),
            "sampler": {"type": "InfiniteSampler", "shuffle": True},
            "batch_size": 4,
            "collate_fn": {"type": "default_collate"},
            "num_workers": 0,
        },
        train_cfg={"by_epoch": False, "max_iters": ITERS},
        optim_wrapper={
            "type": wrapper,
            "optimizer": {"type": optimizer, "lr": 0.05},
            "loss_scale": copy.deepcopy(loss_scale),
            "accumulative_counts": 2,
            "clip_grad": {"max_norm": 1.0},
        },
        param_scheduler={
            "type": "MultiStepLR",
            "by_epoch": False,
            "milestones": [4, 8],
            "gamma": 0.5,
        },
        default_hooks={
            "checkpoint": {"type": "CheckpointHook", "interval": HALF, "by_epoch": False},
            "logger": {"type": "LoggerHook", "interval": 1000},
        },
        custom_hooks=[record],
        randomness={"seed": 0},
        load_from=None if load_from is None else str(load_from),
        resume=load_from is not None,
        log_level="ERROR",
        default_scope="mmengine",
    )
    try:
        with warnings.catch_warnings(), _unpickling(load_from is not None):
            runner.train()
    finally:
        for handler in MMLogger.get_instance(name).handlers:
            handler.close()
    optim_wrapper = runner.optim_wrapper
    return {
        "wrapper": optim_wrapper,
        "scales": record.scales,
        "taken": record.taken,
        "params": [p.detach().clone() for p in model.parameters()],
        "optimizer": optim_wrapper.optimizer.state_dict(),
        "dtypes": model.dtypes,
        "checkpoint": work_dir / f"iter_{HALF}.pth",
    }


def _assert_trained_alike(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["dtypes"] == theirs["dtypes"] == {torch.float16}  # autocast really ran
    assert ours["scales"] == theirs["scales"]
    for p, q in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(p, q)
    a, b = ours["optimizer"], theirs["optimizer"]
    assert a["param_groups"] == b["param_groups"]  # the schedule's lr included
    assert_same_optimizer_state(a["state"], b["state"])


CASES = {
    "dynamic-adamw": (DYNAMIC, "AdamW", [2.0**10, 2.0**11, 2.0**11, 2.0**10, 2.0**10, 2.0**11]),
    "static-sgd": (512.0, "SGD", [512.0] * 6),
}


# mmengine's schedule steps every iteration, and with accumulative_counts=2 the first
# iteration steps no optimizer: mmengine warns, with either wrapper.
@pytest.mark.filterwarnings("ignore:Detected call of `scheduler.step\\(\\)` before:UserWarning")
@pytest.mark.parametrize("case", sorted(CASES))
def test_trains_as_mmengines_own_wrapper(tmp_path: Path, as_on_a_gpu: None, case: str) -> None:
    """Uninterrupted, resumed from its own checkpoint, and ours resumed from mmengine's."""
    loss_scale, optimizer, scales = CASES[case]
    theirs = _train(tmp_path / "theirs", "AmpOptimWrapper", loss_scale, optimizer)
    ours = _train(tmp_path / "ours", NAME, loss_scale, optimizer)
    assert type(theirs["wrapper"]) is AmpOptimWrapper
    assert type(theirs["wrapper"].loss_scaler) is torch.amp.GradScaler
    assert type(ours["wrapper"]) is ScalerCoreAmpOptimWrapper
    assert type(ours["wrapper"].loss_scaler) is GradScaler
    _assert_trained_alike(ours, theirs)
    assert ours["scales"] == scales  # the growths and the backoff of the skip
    assert ours["taken"] == [True, True, True, False, True, True]  # step 4 skipped
    state = ours["wrapper"].loss_scaler.state
    assert (state.steps, state.skipped_steps) == (6, 1)

    theirs_resumed = _train(
        tmp_path / "theirs_resumed", "AmpOptimWrapper", loss_scale, optimizer, theirs["checkpoint"]
    )
    ours_resumed = _train(
        tmp_path / "ours_resumed", NAME, loss_scale, optimizer, ours["checkpoint"]
    )
    ours_from_theirs = _train(
        tmp_path / "ours_from_theirs", NAME, loss_scale, optimizer, theirs["checkpoint"]
    )
    theirs_from_ours = _train(
        tmp_path / "theirs_from_ours", "AmpOptimWrapper", loss_scale, optimizer, ours["checkpoint"]
    )
    for run in (theirs_resumed, ours_resumed, ours_from_theirs, theirs_from_ours):
        _assert_trained_alike(run, theirs | {"scales": theirs["scales"][3:]})
    assert ours_resumed["taken"] == ours_from_theirs["taken"] == [False, True, True]
    # Ours kept its skip accounting through the checkpoint; from mmengine's checkpoint it
    # counts from the resume.
    state = ours_resumed["wrapper"].loss_scaler.state
    assert (state.steps, state.skipped_steps) == (6, 1)
    state = ours_from_theirs["wrapper"].loss_scaler.state
    assert (state.steps, state.skipped_steps) == (3, 1)
    saved = torch.load(ours["checkpoint"], weights_only=False)["optimizer"]["loss_scaler"]
    assert saved["scale"] == scales[2]
    assert STATE_KEY in saved
    # Our scaler's entry asks torch.load for nothing mmengine's checkpoint does not.
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint
    assert unsafe(ours["checkpoint"]) == unsafe(theirs["checkpoint"])


def _wrapper(**kwargs: Any) -> Any:
    """A wrapper built from a config by mmengine's registry, on a tiny linear model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    cfg = {"type": NAME, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), **kwargs}
    return OPTIM_WRAPPERS.build(cfg), model


def test_registered_on_import_and_again_on_reimport(run_python: Any) -> None:
    """In a fresh interpreter (a reload here would leave this module's class stale):
    importing registers; importing again, or reloading, does not fail."""
    code = """
import importlib, warnings
warnings.simplefilter("error")
warnings.filterwarnings("ignore", message=r"`torch\\.jit", category=DeprecationWarning)
from mmengine.registry import OPTIM_WRAPPERS
assert "ScalerCoreAmpOptimWrapper" not in OPTIM_WRAPPERS.module_dict
import scaler_core.mmengine as m
import scaler_core.mmengine
assert OPTIM_WRAPPERS.get("ScalerCoreAmpOptimWrapper") is m.ScalerCoreAmpOptimWrapper
old = m.ScalerCoreAmpOptimWrapper
importlib.reload(m)
assert m.ScalerCoreAmpOptimWrapper is not old
assert OPTIM_WRAPPERS.get("ScalerCoreAmpOptimWrapper") is m.ScalerCoreAmpOptimWrapper
print("ok")
"""
    assert run_python(code).splitlines()[-1] == "ok"


def test_another_class_under_the_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import scaler_core.mmengine as module

    class Other(AmpOptimWrapper):  # type: ignore[misc]
        pass

    monkeypatch.setitem(OPTIM_WRAPPERS.module_dict, NAME, Other)
    with pytest.raises(sc.InvalidArgumentError, match="already holds 'ScalerCoreAmpOptimWrapper'"):
        module._register()
    assert OPTIM_WRAPPERS.module_dict[NAME] is Other  # left as it was


def test_config_or_preset(as_on_a_gpu: None) -> None:
    """``config=`` takes a preset's name or a ScalerConfig; the policy reaches the step."""
    wrapper, model = _wrapper(config="megatron", dtype="float16")
    assert type(wrapper.loss_scaler) is GradScaler
    assert wrapper.loss_scaler.config == sc.preset("megatron")
    assert wrapper.cast_dtype is torch.float16
    with pytest.raises(sc.LifecycleError, match="before the first step"):
        _ = wrapper.step_taken
    before = model.weight.detach().clone()
    loss = model(torch.full((2, 4), math.inf)).sum()  # every gradient inf
    wrapper.update_params(loss)
    assert wrapper.step_taken is False
    assert torch.equal(model.weight, before)
    state = wrapper.loss_scaler.state  # Megatron's hysteresis: the first overflow keeps the scale
    assert (state.scale, state.skipped_steps, state.hysteresis_tracker) == (2.0**32, 1, 1)
    saved = wrapper.state_dict()
    again, _ = _wrapper(config=sc.preset("megatron"))
    again.load_state_dict(saved)
    assert again.loss_scaler.state == state
    sharded, _ = _wrapper(config="megatron", use_fsdp=True)
    assert type(sharded.loss_scaler) is ShardedGradScaler


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_scale": 512.0, "config": "megatron"}, "set the scaler's numbers in one place"),
        ({"loss_scale": {"growth_interval": 5}, "config": "megatron"}, "in one place"),
        ({"config": 3}, "config=3, but it must be a ScalerConfig or a preset's name"),
        ({"loss_scale": 512}, 'loss_scale must be of type float, dict, or "dynamic", but got 512'),
        ({"loss_scale": {"device": "cpu"}}, r"holds \['device'\], but a loss_scale dict takes"),
        ({"dtype": "float8"}, "dtype='float8', but it must be one of"),
    ],
)
def test_refusals(as_on_a_gpu: None, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(sc.InvalidArgumentError, match=match):
        _wrapper(**kwargs)


def test_refusals_are_mmengines_errors_too(as_on_a_gpu: None) -> None:
    """mmengine raises TypeError for a bad ``loss_scale``: so does ours (a subclass)."""
    for build in (NAME, "AmpOptimWrapper"):
        optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
        with pytest.raises(TypeError, match="loss_scale must be of type float"):
            OPTIM_WRAPPERS.build({"type": build, "optimizer": optimizer, "loss_scale": 512})


def test_refuses_the_cpu_as_mmengine_does() -> None:
    """Without an accelerator (no shim) mmengine's refuses to be built, and ours too."""
    if amp_optimizer_wrapper.is_cuda_available():
        pytest.skip("an accelerator is there")
    with pytest.raises(AssertionError, match="only available training on gpu"):
        OPTIM_WRAPPERS.build(
            {"type": "AmpOptimWrapper", "optimizer": torch.optim.SGD(_Net().parameters(), lr=0.1)}
        )
    with pytest.raises(sc.InvalidArgumentError, match="trains on cuda, npu, mlu or musa only"):
        _wrapper()
