"""``scaler_core.accelerate.install``: scaler-core's scaler where accelerate builds its own.

Each loop trains twice from the same seed and batches, once with the scaler accelerate
built (PyTorch's class) and once after ``install``, and the parameters, the optimizer
state, the scales and the skips must agree to the bit. accelerate runs as on a GPU
(``torch_scripts/accelerate_gpu_path.py``): on the CPU it builds no scaler and trains
``mixed_precision="fp16"`` in float32, so the test turns on, with accelerate's own
builders, the float16 autocast and scaler it turns on on a GPU, and checks inside
the loop that the forward ran in float16. The loops: a plain ``Accelerator``, the HF
``Trainer``, and FSDP1 and FSDP2 on two gloo ranks (``torch_scripts/accelerate_fsdp.py``).
Then what ``install`` refuses, each refusal leaving the accelerator as it was, and the
examples of docs/pytorch.md, which need a GPU, run the same way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")
accelerate = pytest.importorskip("accelerate", reason="needs accelerate (pip install accelerate)")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DistributedType, GradScalerKwargs, get_grad_scaler  # noqa: E402
from common_torch import assert_same_optimizer_state  # noqa: E402

import scaler_core as sc  # noqa: E402
from scaler_core.accelerate import install  # noqa: E402
from scaler_core.torch import GradScaler, ShardedGradScaler  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("fresh_accelerate")]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
INF_AT = {6, 9}  # injected; the first steps overflow by themselves (init_scale 2**17)
KWARGS = {"init_scale": 2.0**17, "growth_interval": 2}


class _Net(torch.nn.Module):
    """A small regression net that records its hidden activation's dtype, and whose
    first weight's gradient gets an inf at the calls of ``INF_AT``."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)
        self.dtypes: set[torch.dtype] = set()
        self.calls = 0
        self.hidden.weight.register_hook(self._inject)

    def _inject(self, grad: torch.Tensor) -> torch.Tensor:
        if self.calls - 1 in INF_AT:
            grad = grad.clone()
            grad[0, 0] = math.inf
        return grad

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        self.calls += 1
        h = self.hidden(x)
        self.dtypes.add(h.dtype)
        pred = self.out(torch.tanh(h)).float()
        if labels is None:
            return pred
        return {"loss": torch.nn.functional.mse_loss(pred, labels), "logits": pred}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(STEPS * 8, 8, generator=torch.Generator().manual_seed(1))
    return x, x[:, :1] * 2 - x[:, 1:2]


def _accelerator(as_on_a_gpu: Any, **kwargs: Any) -> Any:
    accelerator = accelerate.Accelerator(
        mixed_precision="fp16", cpu=True, kwargs_handlers=[GradScalerKwargs(**kwargs)]
    )
    as_on_a_gpu(accelerator)
    return accelerator


def _loop(as_on_a_gpu: Any, ours: bool) -> dict[str, Any]:
    """The training loop of accelerate's README, with clipping, on a fresh accelerator."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = _accelerator(as_on_a_gpu, **KWARGS)
    installed = install(accelerator) if ours else None
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    x, y = _data()
    scales, skipped = [], []
    for step in range(STEPS):
        batch = slice(8 * step, 8 * step + 8)
        loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        scales.append(accelerator.scaler.get_scale())
        skipped.append(accelerator.optimizer_step_was_skipped)
    assert installed is None or accelerator.scaler is installed is opt.scaler
    return {
        "scaler": accelerator.scaler,
        "params": [p.detach().clone() for p in model.parameters()],
        "state": opt.state_dict()["state"],
        "scales": scales,
        "skipped": skipped,
        "dtypes": model.dtypes,
    }


def _assert_trained_alike(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["dtypes"] == theirs["dtypes"] == {torch.float16}  # autocast really ran
    assert ours["scales"] == theirs["scales"]
    assert ours.get("skipped") == theirs.get("skipped")
    for p, q in zip(ours["params"], theirs["params"], strict=True):
        assert torch.equal(p, q)
    assert_same_optimizer_state(ours["state"], theirs["state"])


def test_install_trains_as_accelerates_own_scaler(as_on_a_gpu: Any) -> None:
    """The plain Accelerator (one process; DDP builds the same scaler): overflows of its
    own at 2**17, injected infs, growth every 2 steps, clipping (``unscale_``)."""
    theirs = _loop(as_on_a_gpu, ours=False)
    ours = _loop(as_on_a_gpu, ours=True)
    assert type(theirs["scaler"]) is torch.amp.GradScaler
    assert type(ours["scaler"]) is GradScaler
    _assert_trained_alike(ours, theirs)
    skipped = [step for step, s in enumerate(ours["skipped"]) if s]
    assert skipped[:2] == [0, 1]  # 2**17, then 2**16: float16 overflows by itself
    assert set(skipped) >= INF_AT
    assert max(ours["scales"]) > ours["scales"][1]  # it grew
    state = ours["scaler"].state
    assert (state.steps, state.skipped_steps) == (STEPS, len(skipped))


def _fit(tmp_path: Path, as_on_a_gpu: Any, ours: bool) -> tuple[Any, dict[str, Any]]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    scales: list[float] = []
    stepped: list[bool] = []
    lrs: list[float] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            scaler = trainer.accelerator.scaler
            scales.append(scaler.get_scale())
            lrs.append(trainer.lr_scheduler.get_last_lr()[0])
            if isinstance(scaler, GradScaler):  # the optimizer inside the AcceleratedOptimizer
                stepped.append(scaler.stepped(trainer.optimizer.optimizer))

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = _Net()
    x, y = _data()
    args = TrainingArguments(
        output_dir=str(tmp_path / ("ours" if ours else "theirs")),
        fp16=True,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=8,
        learning_rate=1e-2,  # and the default schedule: linear decay, stepped per update
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=[{"x": a, "labels": b} for a, b in zip(x, y, strict=True)],
        callbacks=[Record()],
    )
    # The Trainer passes accelerate no GradScalerKwargs: as if it had (kwargs_handlers=).
    trainer.accelerator.scaler_handler = GradScalerKwargs(**KWARGS)
    as_on_a_gpu(trainer.accelerator)
    if ours:
        assert install(trainer) is trainer.accelerator.scaler
    trainer.train()
    return trainer, {
        "scaler": trainer.accelerator.scaler,
        "params": [p.detach().clone() for p in model.parameters()],
        "state": trainer.optimizer.state_dict()["state"],
        "scales": scales,
        "lrs": lrs,
        "dtypes": model.dtypes,
        "fused": trainer.optimizer.optimizer.defaults["fused"],
        "stepped": stepped,
    }


def test_install_in_the_trainer_trains_as_its_own_scaler(tmp_path: Path, as_on_a_gpu: Any) -> None:
    """The HF Trainer (``TrainingArguments(fp16=True)``, its clip at ``max_grad_norm=1``,
    its default fused AdamW, which skips inside its kernel, and its default linear LR
    schedule): ``install(trainer)`` before ``train()``, bit for bit, the learning rate
    of every step included; after ``train()``, refused.

    (With a fused optimizer accelerate's ``optimizer_step_was_skipped`` is false on every
    step with PyTorch's scaler, whose ``step`` calls a fused ``step`` on every step, so
    the Trainer steps its schedule on every update. scaler-core's did not call a step it
    knew was skipped: the schedule fell one update behind per skip. The skips are read
    from the scales, each one a backoff, and from ``stepped()``.)"""
    pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")
    _, theirs = _fit(tmp_path, as_on_a_gpu, ours=False)
    trainer, ours = _fit(tmp_path, as_on_a_gpu, ours=True)
    assert type(theirs["scaler"]) is torch.amp.GradScaler
    assert type(ours["scaler"]) is GradScaler
    _assert_trained_alike(ours, theirs)
    assert ours["fused"]
    assert ours["lrs"] == theirs["lrs"]
    assert len(set(ours["lrs"])) == STEPS  # the schedule moved on every update, skips too
    scales = [KWARGS["init_scale"], *ours["scales"]]
    skipped = [step for step in range(STEPS) if scales[step + 1] < scales[step]]
    assert skipped[:2] == [0, 1]
    assert set(skipped) >= INF_AT
    assert ours["scaler"].state.skipped_steps == len(skipped)
    assert [not ran for ran in ours["stepped"]] == [step in skipped for step in range(STEPS)]
    with pytest.raises(sc.LifecycleError, match=r"prepare\(\) already wrapped 1 optimizer"):
        install(trainer)
    assert trainer.accelerator.scaler is ours["scaler"]


@pytest.mark.parametrize("version", [1, 2])
def test_install_under_fsdp_trains_as_accelerates_own_scaler(
    torch_ranks: Any, version: int
) -> None:
    """Two gloo ranks, accelerate's FSDP wrapping and float16 autocast, an inf in rank 1's
    shard at two steps: FSDP1 gets scaler-core's ShardedGradScaler in place of PyTorch's,
    FSDP2 its GradScaler in place of ``torch.amp.GradScaler`` (accelerate 1.16 builds the
    plain class for FSDP2); both ranks skip together, bit for bit as before."""
    kind = {
        1: (
            "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
            "scaler_core.torch.ShardedGradScaler",
        ),
        2: ("torch.amp.grad_scaler.GradScaler", "scaler_core.torch.GradScaler"),
    }[version]
    runs = torch_ranks("accelerate_fsdp.py", str(version))
    for rank, run in enumerate(runs):
        theirs, ours = run["torch"], run["ours"]
        assert (theirs["scaler"], ours["scaler"]) == kind
        assert ours["opt_scaler"]  # the optimizer steps with it
        assert theirs["opt_scaler"]
        assert ours["model"] == ("FullyShardedDataParallel" if version == 1 else "FSDPSequential")
        assert ours["dtypes"] == theirs["dtypes"] == {"torch.float16"}
        assert ours["scales"] == theirs["scales"]
        assert ours["skipped"] == theirs["skipped"]
        assert [i for i, s in enumerate(ours["skipped"]) if s] == [2, 6], rank  # rank 1's infs
        assert len(set(ours["scales"])) > 1
        for p, q in zip(ours["params"], theirs["params"], strict=True):
            assert torch.equal(p, q)
        for p, q in zip(ours["state"], theirs["state"], strict=True):
            assert torch.equal(p, q)


def test_set_by_hand_after_prepare_the_update_is_off_and_install_refuses(
    as_on_a_gpu: Any,
) -> None:
    """What ``install`` prevents: ``prepare()`` gave the optimizer accelerate's scaler, so
    a scaler set by hand afterwards scales the loss (2**15) while the old one unscales
    it (2**5): the update is 1024 times too large, and nothing says so."""
    accelerator = _accelerator(as_on_a_gpu, init_scale=2.0**5)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    theirs = accelerator.scaler
    with pytest.raises(sc.LifecycleError, match=r"call install\(\) right after creating"):
        install(accelerator)
    assert accelerator.scaler is theirs is opt.scaler  # nothing changed

    x = torch.full((2, 4), 0.01)
    steps = []
    for step in range(2):
        if step == 1:
            accelerator.scaler = GradScaler("cpu", init_scale=2.0**15)  # by hand
        before = model.weight.detach().clone()
        accelerator.backward(model(x).mean())
        opt.step()
        opt.zero_grad()
        assert not opt.step_was_skipped
        steps.append((model.weight.detach() - before)[0, 0].item())
    assert steps[1] / steps[0] == pytest.approx(1024, rel=1e-2)  # float16 rounding aside


def test_install_carries_accelerates_numbers_and_device(as_on_a_gpu: Any) -> None:
    kwargs = {"init_scale": 2.0**9, "growth_factor": 3.0, "backoff_factor": 0.25}
    accelerator = _accelerator(as_on_a_gpu, growth_interval=7, **kwargs)
    new = install(accelerator)
    assert accelerator.scaler is new
    assert type(new) is GradScaler
    assert new._device == "cpu"
    assert new.config == sc.ScalerConfig(growth_interval=7, **kwargs)


def test_install_takes_a_config_in_place_of_the_numbers(as_on_a_gpu: Any) -> None:
    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    as_on_a_gpu(accelerator)
    reports: list[sc.StepReport] = []
    new = install(accelerator, sc.preset("megatron"), on_step=reports.append)
    assert new.config == sc.preset("megatron")
    w = torch.nn.Parameter(torch.ones(2))
    _, opt = accelerator.prepare(torch.nn.Linear(1, 1), torch.optim.SGD([w], lr=0.1))
    accelerator.backward(w.sum())
    opt.step()
    assert [r.kind for r in reports] == [sc.StepKind.COUNT]


def test_an_fsdp1_scaler_becomes_scaler_cores_sharded_one(as_on_a_gpu: Any) -> None:
    """What accelerate builds for FSDP1 (``get_grad_scaler(DistributedType.FSDP)``:
    PyTorch's ShardedGradScaler) becomes scaler-core's, numbers, device and process
    group (PyTorch's default, ``None``: the default group) carried over."""
    accelerator = accelerate.Accelerator(mixed_precision="fp16", cpu=True)
    as_on_a_gpu(accelerator)
    accelerator.scaler = get_grad_scaler(
        DistributedType.FSDP, device="cpu", init_scale=2.0**7, backoff_factor=0.125
    )
    new = install(accelerator)
    assert type(new) is ShardedGradScaler
    assert new.config == sc.ScalerConfig(init_scale=2.0**7, backoff_factor=0.125)
    assert new.process_group is None  # PyTorch's: the default group, looked up per step
    assert new._group().handle is None  # what torch.distributed takes for the default group


def _refusals(as_on_a_gpu: Any) -> Iterator[tuple[str, Any, dict[str, Any], type, str]]:
    """(case, accelerator, install's keywords, error, message pattern)."""
    fp16 = 'use Accelerator\\(mixed_precision="fp16"\\)'
    yield (
        "not an accelerator",
        "accelerator",
        {},
        sc.InvalidArgumentError,
        "target='accelerator', but it must be an accelerate.Accelerator or a transformers",
    )
    for precision in ("no", "bf16"):
        acc = accelerate.Accelerator(mixed_precision=precision, cpu=True)
        yield precision, acc, {}, sc.InvalidArgumentError, f"mixed_precision='{precision}'.*{fp16}"
        AcceleratorState._reset_state(True)
    acc = accelerate.Accelerator(mixed_precision="fp16", cpu=True)  # as accelerate is on a CPU
    yield "the CPU", acc, {}, sc.InvalidArgumentError, "on the CPU it trains .* in float32"
    acc = _accelerator(as_on_a_gpu)
    yield (
        "a config of another type",
        acc,
        {"config": {"init_scale": 8.0}},
        sc.InvalidArgumentError,
        "config=\\{'init_scale': 8.0\\}, but it must be a ScalerConfig",
    )
    yield (
        "spike skipping",
        acc,
        {"config": sc.ScalerConfig(spike_threshold=10.0)},
        sc.InvalidArgumentError,
        "spike_threshold=10.0",
    )
    yield "a bad on_step", acc, {"on_step": 3}, sc.InvalidArgumentError, "on_step=3"
    AcceleratorState._reset_state(True)
    acc = _accelerator(as_on_a_gpu, init_scale=8.0)
    yield (
        "config and GradScalerKwargs",
        acc,
        {"config": sc.ScalerConfig()},
        sc.InvalidArgumentError,
        "GradScalerKwargs sets init_scale=8.0; set the scaler's numbers in one place",
    )
    AcceleratorState._reset_state(True)
    acc = _accelerator(as_on_a_gpu, enabled=False)
    yield "disabled", acc, {}, sc.InvalidArgumentError, "accelerate's scaler is disabled"
    AcceleratorState._reset_state(True)
    acc = _accelerator(as_on_a_gpu)
    acc.backward(torch.ones(1, requires_grad=True).sum())
    yield "a loss scaled", acc, {}, sc.LifecycleError, "has already scaled a loss"
    AcceleratorState._reset_state(True)
    acc = _accelerator(as_on_a_gpu)
    install(acc)
    yield "installed before", acc, {}, sc.InvalidArgumentError, "already scaler-core's"


def test_install_refuses_what_would_not_do_what_it_says_and_changes_nothing(
    as_on_a_gpu: Any,
) -> None:
    seen = []
    for case, target, kwargs, error, pattern in _refusals(as_on_a_gpu):
        before = getattr(target, "scaler", None)
        with pytest.raises(error, match=pattern):
            install(target, **kwargs)
        assert getattr(target, "scaler", None) is before, case
        seen.append(case)
    assert len(seen) == 11


def test_the_pages_examples_run_as_on_a_gpu(run_python: Any) -> None:
    """The examples of docs/pytorch.md that need a GPU (accelerate builds no scaler on
    the CPU) run on the CPU with accelerate turned on as on a GPU for every Accelerator."""
    page = (ROOT / "docs" / "pytorch.md").read_text(encoding="utf-8")
    blocks = re.findall(
        r"<!-- readme-test: requires gpu accelerate[^>]*-->\n```python\n(.*?)```", page, re.S
    )
    assert len(blocks) == 2
    prelude = (
        "import sys\n"
        f"sys.path.insert(0, {str(ROOT / 'tests/integrations/torch_scripts')!r})\n"
        "import accelerate\n"
        "from accelerate_gpu_path import as_on_a_gpu\n"
        "init = accelerate.Accelerator.__init__\n"
        "def on_a_gpu(self, *args, **kwargs):\n"
        "    init(self, *args, **kwargs)\n"
        "    as_on_a_gpu(self)\n"
        "accelerate.Accelerator.__init__ = on_a_gpu\n"
    )
    for block in blocks:
        run_python(prelude + block, env={"HF_HUB_OFFLINE": "1"})
