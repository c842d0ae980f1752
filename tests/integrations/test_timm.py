"""``scaler_core.timm.NativeScaler`` in timm's training loop, against timm's own class.

The loop is timm's ``train.py`` (``train_one_epoch`` and the epoch loop around it) in
small: a ``timm.create_model`` ViT (``test_vit``, 32x32 inputs, random init), an
optimizer from ``timm.optim.create_optimizer_v2``, ``loss_scaler(loss, optimizer,
clip_grad=..., clip_mode=..., parameters=model_parameters(...), need_update=...)``,
``ModelEmaV3.update(model, step=num_updates)``, the cosine scheduler's ``step_update``
after each update and ``step`` after each epoch, ``CheckpointSaver.save_checkpoint``
after each epoch, and ``resume_checkpoint`` (and ``load_checkpoint`` for the EMA) to
resume. Each run is made twice from the same seed and batches, once with timm's
``NativeScaler`` and once with scaler-core's, and the scales after every update, the
parameters, the optimizer state, the EMA weights and the learning rates must agree
to the bit; checkpoints of each class resume the other's run.

timm's ``train.py`` builds its scaler only for float16 on CUDA
(``NativeScaler(device=device.type)`` when ``device.type == 'cuda'``): here both
runs build it for ``"cpu"`` and autocast to float16 on the CPU, which torch 2.13
does, and the test checks the forward ran in float16. timm's class builds
``torch.amp.GradScaler`` with PyTorch's defaults; both runs get
``init_scale=2**12, growth_interval=3`` (timm's inner scaler is replaced by
PyTorch's built with them), so that the scale grows within the run; an inf is
injected into a gradient (a hook on the patch embedding's weight) at two updates,
so that steps are skipped.

Where timm is not installed, the copy ``.ci/oracles`` puts beside the test environment
(``$SCALER_CORE_ORACLES/timm``, default ``.oracles/timm`` in the checkout; timm and
torchvision alone) is put on ``sys.path``: PyPI's torchvision installed in the test
environment itself would break other libraries' imports there (below).

CPU-only setups: PyPI's torchvision is a CUDA build, whose C ops do not load beside
a CPU build of torch; its import then stops at ``torchvision/_meta_registrations.py``,
which registers fakes (``torch.library.register_fake``) for two ops its library did
not define: ``torchvision::nms`` and ``torchvision::qnms``. :func:`_torchvision_ops`
defines the two schemas, only where the library does not load, before timm imports
torchvision (timm needs none of its C ops here).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import os
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")


def _torchvision_ops() -> Any:
    """Define ``torchvision::nms`` and ``torchvision::qnms`` where torchvision's C ops do
    not load (a CUDA build of torchvision beside a CPU build of torch), so that
    ``import torchvision`` gets past its fake registrations; returns the
    ``torch.library.Library`` holding them (kept alive: the schemas go with it), or
    None where nothing was needed."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None  # no torchvision: importorskip("timm") says so
    libs = [p for d in spec.submodule_search_locations for p in Path(d).glob("_C.*")]
    if libs and hasattr(torch.ops, "torchvision") and hasattr(torch.ops.torchvision, "nms"):
        return None  # loaded already
    try:
        if libs:
            torch.ops.load_library(str(libs[0]))
            return None  # its ops load: nothing to do
    except (ImportError, OSError):  # what torchvision's own loader catches
        pass
    lib = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return lib


def _oracle_copy() -> None:
    """Put the copy of timm that ``.ci/oracles`` builds on ``sys.path`` (see above), where
    timm is not installed and the copy is there."""
    if importlib.util.find_spec("timm") is not None:
        return
    root = Path(__file__).resolve().parents[2]
    copy = Path(os.environ.get("SCALER_CORE_ORACLES", root / ".oracles")) / "timm"
    if (copy / "timm").is_dir():
        sys.path.append(str(copy))


_oracle_copy()
_TORCHVISION_SCHEMAS = _torchvision_ops()
timm = pytest.importorskip(
    "timm", reason="needs timm: run .ci/oracles (or pip install timm torchvision)"
)
from common_torch import assert_same_optimizer_state  # noqa: E402
from timm.models import load_checkpoint, model_parameters, resume_checkpoint  # noqa: E402
from timm.optim import create_optimizer_v2  # noqa: E402
from timm.scheduler import create_scheduler_v2  # noqa: E402
from timm.utils import CheckpointSaver, ModelEmaV3  # noqa: E402
from timm.utils import NativeScaler as TimmNativeScaler  # noqa: E402

import scaler_core as sc  # noqa: E402
from scaler_core.timm import NativeScaler  # noqa: E402
from scaler_core.torch import GradScaler  # noqa: E402

pytestmark = pytest.mark.torch

EPOCHS = 2
UPDATES_PER_EPOCH = 5
INF_AT = {2, 7}  # updates (counted over the run) whose gradients get an inf
NUMBERS = {"init_scale": 2.0**12, "growth_interval": 3}
BATCH = 8


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model's runs take a fraction of a second each, where
    two threads on a busy machine wait on each other for seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration of timm's loop (``train.py``'s arguments)."""

    opt: str
    clip_mode: str | None = None
    clip_grad: float | None = None
    accum_steps: int = 1
    opt_kwargs: tuple[tuple[str, Any], ...] = ()


VARIANTS = {
    "adamw-norm": Variant("adamw", "norm", 1.0),
    "fused_adamw-norm": Variant("adamw", "norm", 1.0, opt_kwargs=(("fused", True),)),
    "lamb-agc-accum2": Variant("lamb", "agc", 0.02, accum_steps=2),
    "adamw-noclip": Variant("adamw"),
}


def _scaler(kind: str, **numbers: Any) -> Any:
    """timm's ``NativeScaler`` or ours, for the CPU, with the run's numbers."""
    numbers = numbers or NUMBERS
    if kind == "ours":
        return NativeScaler("cpu", **numbers)
    theirs = TimmNativeScaler(device="cpu")
    assert type(theirs._scaler) is torch.amp.GradScaler
    theirs._scaler = torch.amp.GradScaler("cpu", **numbers)  # timm passes no numbers
    return theirs


class _Run:
    """timm's ``train.py`` in small: model, optimizer, EMA, scheduler, saver, resume."""

    def __init__(
        self,
        variant: Variant,
        loss_scaler: Any,
        out_dir: Path,
        resume: Path | None = None,
    ) -> None:
        torch.manual_seed(0)
        self.variant = variant
        self.model = timm.create_model("test_vit", pretrained=False, num_classes=4, img_size=32)
        self.optimizer = create_optimizer_v2(
            self.model, opt=variant.opt, lr=1e-3, weight_decay=0.05, **dict(variant.opt_kwargs)
        )
        self.loss_scaler = loss_scaler
        self.model_ema = ModelEmaV3(self.model, decay=0.9)
        self.start_epoch = 0
        if resume is not None:  # as train.py resumes: model, optimizer, scaler, then the EMA
            self.start_epoch = resume_checkpoint(
                self.model,
                str(resume),
                optimizer=self.optimizer,
                loss_scaler=self.loss_scaler,
                log_info=False,
            )
            load_checkpoint(self.model_ema.module, str(resume), use_ema=True)
        self.lr_scheduler, _ = create_scheduler_v2(
            self.optimizer,
            sched="cosine",
            num_epochs=EPOCHS,
            min_lr=1e-5,
            step_on_epochs=False,
            updates_per_epoch=UPDATES_PER_EPOCH,
        )
        if self.start_epoch > 0:
            self.lr_scheduler.step_update(self.start_epoch * UPDATES_PER_EPOCH)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.saver = CheckpointSaver(
            model=self.model,
            optimizer=self.optimizer,
            model_ema=self.model_ema,
            amp_scaler=self.loss_scaler,
            checkpoint_dir=str(out_dir),
            recovery_dir=str(out_dir),
            max_history=2,
        )
        self.out_dir = out_dir
        self.inject = False
        self.dtypes: set[torch.dtype] = set()
        self.scales: list[float] = []
        self.lrs: list[float] = []
        self.skipped: list[bool] = []
        self.model.patch_embed.proj.weight.register_hook(self._inf)
        generator = torch.Generator().manual_seed(1)
        total = EPOCHS * UPDATES_PER_EPOCH * variant.accum_steps
        self.x = torch.randn(total, BATCH, 3, 32, 32, generator=generator)
        self.y = torch.randint(0, 4, (total, BATCH), generator=generator)

    def _inf(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.inject:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = math.inf
        return grad

    def train(self, stop_epoch: int = EPOCHS, gate: bool = False) -> None:
        """``train_one_epoch`` per epoch, then the scheduler's and the saver's epoch
        steps. ``gate``: with scaler-core's scaler, the EMA and the scheduler skip
        the updates whose optimizer step was skipped (the recipe of docs)."""
        accum = self.variant.accum_steps
        amp_autocast = partial(torch.autocast, device_type="cpu", dtype=torch.float16)
        loss_fn = torch.nn.CrossEntropyLoss()
        self.optimizer.zero_grad()
        for epoch in range(self.start_epoch, stop_epoch):
            num_updates = epoch * UPDATES_PER_EPOCH
            for update_idx in range(UPDATES_PER_EPOCH):
                update = epoch * UPDATES_PER_EPOCH + update_idx
                for micro in range(accum):
                    batch = update * accum + micro
                    need_update = micro == accum - 1
                    with amp_autocast():
                        output = self.model(self.x[batch])
                        loss = loss_fn(output, self.y[batch])
                    self.dtypes.add(output.dtype)
                    if accum > 1:
                        loss /= accum
                    self.inject = update in INF_AT and micro == 0
                    self.loss_scaler(
                        loss,
                        self.optimizer,
                        clip_grad=self.variant.clip_grad,
                        clip_mode=self.variant.clip_mode or "norm",
                        parameters=model_parameters(
                            self.model, exclude_head="agc" in (self.variant.clip_mode or "")
                        ),
                        create_graph=False,
                        need_update=need_update,
                    )
                    self.inject = False
                self.optimizer.zero_grad()
                self.scales.append(self.loss_scaler._scaler.get_scale())
                if gate:
                    self.skipped.append(not self.loss_scaler.stepped())
                    if self.skipped[-1]:
                        self.lrs.append(self.optimizer.param_groups[0]["lr"])
                        continue
                num_updates += 1
                self.model_ema.update(self.model, step=num_updates)
                self.lr_scheduler.step_update(num_updates=num_updates, metric=loss.item())
                self.lrs.append(self.optimizer.param_groups[0]["lr"])
            self.lr_scheduler.step(epoch + 1)
            self.saver.save_checkpoint(epoch)

    def result(self) -> dict[str, Any]:
        return {
            "params": [p.detach().clone() for p in self.model.parameters()],
            "ema": [p.detach().clone() for p in self.model_ema.module.parameters()],
            "state": self.optimizer.state_dict()["state"],
            "scales": self.scales,
            "lrs": self.lrs,
            "dtypes": self.dtypes,
            "scaler": self.loss_scaler.state_dict(),
        }


def _assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["dtypes"] == theirs["dtypes"] == {torch.float16}  # autocast really ran
    assert ours["scales"] == theirs["scales"]
    assert ours["lrs"] == theirs["lrs"]
    for name in ("params", "ema"):
        for p, q in zip(ours[name], theirs[name], strict=True):
            assert torch.equal(p, q), name
    assert_same_optimizer_state(ours["state"], theirs["state"])
    pytorchs = {k: v for k, v in ours["scaler"].items() if k != "scaler_core"}
    assert pytorchs == theirs["scaler"]


def _skips_and_growths(scales: list[float]) -> tuple[list[int], list[int]]:
    before = [NUMBERS["init_scale"], *scales[:-1]]
    skips = [i for i, (a, b) in enumerate(zip(before, scales, strict=True)) if b < a]
    growths = [i for i, (a, b) in enumerate(zip(before, scales, strict=True)) if b > a]
    return skips, growths


@pytest.mark.parametrize("name", list(VARIANTS))
def test_trains_as_timms_native_scaler(tmp_path: Path, name: str) -> None:
    """Two epochs of timm's loop, bit for bit with timm's class: an inf at updates 2
    and 7 skips them (the scale backs off), three clean updates grow the scale."""
    variant = VARIANTS[name]
    theirs = _Run(variant, _scaler("theirs"), tmp_path / "theirs")
    theirs.train()
    ours = _Run(variant, _scaler("ours"), tmp_path / "ours")
    ours.train()
    _assert_same(ours.result(), theirs.result())
    assert bool(ours.optimizer.defaults.get("fused")) == ("fused" in name)
    skips, growths = _skips_and_growths(ours.scales)
    assert skips == sorted(INF_AT)
    assert growths == [5]  # 3, 4, 5 clean after the backoff at 2
    state = ours.loss_scaler.scaler.state
    assert (state.steps, state.skipped_steps) == (EPOCHS * UPDATES_PER_EPOCH, len(INF_AT))
    assert isinstance(ours.loss_scaler, TimmNativeScaler)
    assert type(ours.loss_scaler._scaler) is GradScaler
    assert ours.loss_scaler.state_dict_key == theirs.loss_scaler.state_dict_key == "amp_scaler"


@pytest.mark.parametrize("name", ["adamw-norm", "fused_adamw-norm"])
@pytest.mark.parametrize("first", ["theirs", "ours"])
def test_checkpoints_resume_across_the_two_classes(tmp_path: Path, name: str, first: str) -> None:
    """Epoch 0 with one class, ``CheckpointSaver.save_checkpoint`` (its growth tracker
    at 2 of 3), ``resume_checkpoint`` into the other class for epoch 1: the same run,
    to the bit, as timm's class training both epochs without a stop."""
    variant = VARIANTS[name]
    whole = _Run(variant, _scaler("theirs"), tmp_path / "whole")
    whole.train()
    head = _Run(variant, _scaler(first), tmp_path / "head")
    head.train(stop_epoch=1)
    checkpoint = tmp_path / "head" / "last.pth.tar"
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["amp_scaler"]["_growth_tracker"] == 2
    assert ("scaler_core" in saved["amp_scaler"]) == (first == "ours")
    second = "ours" if first == "theirs" else "theirs"
    # A fresh scaler with the defaults: the checkpoint brings the scale and the numbers.
    tail = _Run(variant, _scaler(second, init_scale=2.0**16), tmp_path / "tail", checkpoint)
    assert tail.start_epoch == 1
    tail.train()
    result, expected = tail.result(), whole.result()
    expected["scales"] = expected["scales"][UPDATES_PER_EPOCH:]
    expected["lrs"] = expected["lrs"][UPDATES_PER_EPOCH:]
    assert tail.scales[0] != 2.0**16
    _assert_same(result, expected)  # PyTorch's five entries of the scaler's dict too


@pytest.mark.parametrize("name", ["adamw-norm", "fused_adamw-norm"])
def test_ema_and_lr_hold_on_skipped_steps_with_ours(tmp_path: Path, name: str) -> None:
    """With ``stepped()`` the loop leaves the EMA and the schedule alone on a skipped
    step: the EMA weights are bit for bit what they were and the LR does not move.
    timm's class says nothing, so timm's loop moves both: the EMA leans toward the
    unchanged model and the cosine schedule spends an update on a step not taken.
    Under a hysteresis policy (``preset("megatron")``, 2) the first overflow does
    not even back off the scale, so watching the scale would not tell either."""
    config = sc.preset("megatron", initial_scale=2.0**12, growth_interval=3)
    ours = _Run(VARIANTS[name], NativeScaler("cpu", config=config), tmp_path / "ours")
    emas: list[list[torch.Tensor]] = []
    update = ours.model_ema.update

    def record(model: Any, step: int | None = None) -> None:
        update(model, step=step)
        emas.append([p.detach().clone() for p in ours.model_ema.module.parameters()])

    ours.model_ema.update = record  # type: ignore[method-assign]
    ours.train(gate=True)
    assert [i for i, s in enumerate(ours.skipped) if s] == sorted(INF_AT)
    assert len(emas) == EPOCHS * UPDATES_PER_EPOCH - len(INF_AT)  # updated on steps taken only
    assert ours.scales[2] == 2.0**12  # hysteresis: skipped, the scale unchanged
    for i in sorted(INF_AT):
        assert ours.lrs[i] == ours.lrs[i - 1]  # the LR held
    taken = [i for i, s in enumerate(ours.skipped) if not s]
    assert all(ours.lrs[a] > ours.lrs[b] for a, b in itertools.pairwise(taken))

    # timm's class in timm's loop: the skipped update still moves the EMA and the LR.
    theirs = _Run(VARIANTS[name], _scaler("theirs"), tmp_path / "theirs")
    theirs.train(stop_epoch=1)
    assert theirs.lrs[2] < theirs.lrs[1]  # a step not taken spent the schedule


def test_stepped_and_the_call(tmp_path: Path) -> None:
    """``stepped()`` before a call refuses; after a micro-batch (``need_update=False``)
    it is False; the call returns None, as timm's does."""
    scaler = NativeScaler("cpu", init_scale=2.0**10)
    w = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([w], lr=0.1)
    with pytest.raises(sc.InvalidArgumentError, match=r"stepped\(\) was called before any call"):
        scaler.stepped()
    assert scaler(w.sum(), optimizer, need_update=False) is None
    assert scaler.stepped() is False
    assert scaler(w.sum(), optimizer, clip_grad=1.0, parameters=[w]) is None
    assert scaler.stepped() is True
    assert scaler.scaler.state.steps == 1


def test_config_and_refusals() -> None:
    scaler = NativeScaler("cpu", config=sc.preset("deepspeed"))
    assert scaler.scaler.config == sc.preset("deepspeed")
    with pytest.raises(sc.InvalidArgumentError, match="config= was given with init_scale"):
        NativeScaler("cpu", init_scale=8.0, config=sc.preset("deepspeed"))
    with pytest.raises(sc.InvalidConfigError, match="growth_interval=0"):
        NativeScaler("cpu", growth_interval=0)
    with pytest.raises(sc.InvalidArgumentError, match="spike_threshold"):
        NativeScaler("cpu", config=sc.ScalerConfig(spike_threshold=10.0))
