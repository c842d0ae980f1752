"""Lightning and Fabric take ``scaler_core.torch.GradScaler`` where they take PyTorch's.

Every loop trains twice from the same seed and batches, once with PyTorch's
``torch.amp.GradScaler("cpu", ...)`` (what Lightning builds by default) and once with
``scaler_core.torch.GradScaler("cpu", ...)``, both handed over the same way
(``MixedPrecision("16-mixed", "cpu", scaler=...)``), and the scale after every batch,
the parameters and the optimizer state must agree to the bit. Each run checks inside
the loop that the forward ran in float16 (the plugin given explicitly autocasts the
CPU to float16: no shim is needed), that an injected inf was skipped and that the
scale grew. The loops: the Trainer with automatic optimization (clipping by norm and
accumulation; a fused AdamW), with manual optimization, a Fabric loop, and resumes
through Lightning's checkpoint (``ckpt_path=``) and Fabric's ``save``/``load``.

Then the traps, each shown to act the same on both scalers: ``Trainer(precision=
"16-mixed")`` on a CPU trains in bfloat16 without a scaler; a fused optimizer refuses
Lightning's clipping; manual optimization's ``clip_gradients`` in ``training_step``
sees scaled gradients; Fabric's ``clip_gradients`` raises on every overflow unless
``error_if_nonfinite=False``; and Lightning's FSDP refuses any scaler. Skipped
without ``lightning``.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")
with warnings.catch_warnings():  # a third-party deprecation at import must not fail the test
    warnings.simplefilter("ignore")
    pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (pip install lightning)")
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import FSDPPrecision as FabricFSDPPrecision
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
    from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
    from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp.sharded_grad_scaler import (
        ShardedGradScaler as TorchShardedGradScaler,
    )

from scaler_core.torch import GradScaler, ShardedGradScaler  # noqa: E402

pytestmark = pytest.mark.torch
OVERFLOW_AT = {3, 9, 10}
KWARGS = {"init_scale": 2.0**10, "growth_interval": 2}
SCALERS = {"scaler_core": GradScaler, "torch": torch.amp.GradScaler}

# Lightning 2.6.6's own pytree helper (``lightning/pytorch/utilities/_pytree.py``)
# still uses ``LeafSpec``, which PyTorch 2.13 deprecates; every ``Trainer.fit`` meets it.
QUIET = (
    pytest.mark.filterwarnings(
        "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"
    ),
)


def quiet(test: Any) -> Any:
    for mark in QUIET:
        test = mark(test)
    return test


class _Model(pl.LightningModule):  # type: ignore[misc]
    """A small regression net: it records its hidden activation's dtype, the scale
    after every batch, and gets an inf in a gradient at the optimizer steps of
    ``OVERFLOW_AT`` (every micro-batch of that step)."""

    def __init__(self, *, fused: bool = False, manual: bool = False, clip: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.fused = fused
        self.automatic_optimization = not manual
        self.clip = clip
        self.scales: list[float] = []
        self.dtypes: set[torch.dtype] = set()
        self.scaled_grads: list[torch.Tensor] = []
        self.unscaled_grads: list[torch.Tensor] = []
        self.net[0].register_forward_hook(lambda _m, _i, out: self.dtypes.add(out.dtype))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        # The trap: clipping here would clip the *scaled* gradients.
        self.scaled_grads.append(self.net[0].weight.grad.clone())
        opt.step()  # unscales, calls on_before_optimizer_step, steps and updates
        return None

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.automatic_optimization:
            self.unscaled_grads.append(self.net[0].weight.grad.clone())
            self.clip_gradients(
                optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm"
            )

    def on_after_backward(self) -> None:
        if self.global_step in OVERFLOW_AT:
            self.net[0].weight.grad[0, 0] = math.inf

    def on_train_batch_end(self, *args: Any) -> None:
        self.scales.append(self.trainer.precision_plugin.scaler.get_scale())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)


def _data(n: int = 64) -> Any:
    torch.manual_seed(0)
    x = torch.randn(n, 8)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x[:, :1] * 2), batch_size=4, num_workers=0
    )


def _trainer(scaler: Any, tmp_path: Path, **kwargs: Any) -> Any:
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


def _fit(
    name: str, tmp_path: Path, model_kwargs: dict[str, Any], **trainer_kwargs: Any
) -> tuple[_Model, Any, Any]:
    scaler = SCALERS[name]("cpu", **KWARGS)
    data = _data()
    torch.manual_seed(1)
    model = _Model(**model_kwargs)
    trainer = _trainer(scaler, tmp_path / name, **trainer_kwargs)
    trainer.fit(model, data)
    assert trainer.precision_plugin.scaler is scaler
    return model, trainer, scaler


def _assert_equal(a: Any, b: Any) -> None:
    """Tensors equal to the bit (and of one dtype), through dicts and lists."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, (a, b)
        assert torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal(x, y)
    else:
        assert a == b


def _assert_real(scales: list[float], dtypes: set[Any], ours: GradScaler, skips: int) -> None:
    """float16 ran, the injected infs were skipped, and the scale grew."""
    assert dtypes == {torch.float16}
    assert ours.state.skipped_steps == skips
    ratios = [b / a for a, b in zip([KWARGS["init_scale"], *scales], scales, strict=False)]
    assert 0.5 in ratios, scales  # a backoff
    assert 2.0 in ratios, scales  # a growth


def _compare(fit: Any, tmp_path: Path, skips: int, **kwargs: Any) -> list[_Model]:
    models, trainers, scalers = zip(
        *(fit(name, tmp_path, **kwargs) for name in SCALERS), strict=True
    )
    assert models[0].scales == models[1].scales
    _assert_equal(models[0].state_dict(), models[1].state_dict())
    _assert_equal(trainers[0].optimizers[0].state_dict(), trainers[1].optimizers[0].state_dict())
    _assert_real(models[0].scales, models[0].dtypes, scalers[0], skips)
    assert models[1].dtypes == {torch.float16}
    return list(models)


# --- the recipe, in the Trainer ---------------------------------------------------


@quiet
def test_automatic_optimization_with_clipping_and_accumulation(tmp_path: Path) -> None:
    models = _compare(
        _fit,
        tmp_path,
        skips=len(OVERFLOW_AT),
        model_kwargs={},
        max_epochs=2,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
    )
    assert len(models[0].scales) == 32  # 2 epochs of 16 batches, 16 optimizer steps


@quiet
def test_automatic_optimization_with_a_fused_adamw(tmp_path: Path) -> None:
    models = _compare(
        _fit,
        tmp_path,
        skips=len(OVERFLOW_AT),
        model_kwargs={"fused": True},
        max_epochs=2,
        accumulate_grad_batches=2,
    )
    assert models[0].trainer.optimizers[0].defaults["fused"] is True


@quiet
def test_manual_optimization_clipping_in_on_before_optimizer_step(tmp_path: Path) -> None:
    models = _compare(
        _fit,
        tmp_path,
        skips=len(OVERFLOW_AT),
        model_kwargs={"manual": True, "clip": 0.5},
        max_epochs=1,
    )
    model = models[0]
    # The trap: in training_step the gradients are still scaled; Lightning unscales
    # them inside opt.step(), before on_before_optimizer_step, where clipping belongs.
    for scale, scaled, unscaled in zip(
        [KWARGS["init_scale"], *model.scales],
        model.scaled_grads,
        model.unscaled_grads,
        strict=False,
    ):
        finite = scaled.isfinite()
        assert torch.equal(scaled[finite], unscaled[finite] * scale)


# --- the recipe, in Fabric --------------------------------------------------------


def _fabric_run(
    name: str,
    tmp_path: Path,
    steps: range,
    resume: bool = False,
    clip: dict[str, Any] | None = None,
) -> tuple[Any, Any, GradScaler | Any, list[float], set[Any]]:
    scaler = SCALERS[name]("cpu", **KWARGS)
    fabric = Fabric(
        accelerator="cpu",
        devices=1,
        plugins=[FabricMixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    dtypes: set[torch.dtype] = set()
    net[0].register_forward_hook(lambda _m, _i, out: dtypes.add(out.dtype))
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    path = tmp_path / f"fabric-{name}.ckpt"
    state = {"model": model, "optimizer": opt, "scaler": scaler}
    if resume:
        assert fabric.load(path, state) == {}
    batches = list(_data())
    scales = []
    for step in steps:
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        if step in OVERFLOW_AT:
            net[0].weight.grad[0, 0] = math.inf
        fabric.clip_gradients(
            model, opt, **(clip or {"max_norm": 0.5, "error_if_nonfinite": False})
        )
        opt.step()
        scales.append(scaler.get_scale())
    fabric.save(path, state)
    return model, opt, scaler, scales, dtypes


def test_fabric_loop_and_save_load(tmp_path: Path) -> None:
    runs = {}
    for name in SCALERS:
        whole = _fabric_run(name, tmp_path / "whole", range(16))
        first = _fabric_run(name, tmp_path / "split", range(8))
        second = _fabric_run(name, tmp_path / "split", range(8, 16), resume=True)
        assert whole[3] == first[3] + second[3]
        _assert_equal(whole[0].state_dict(), second[0].state_dict())
        _assert_equal(whole[1].state_dict(), second[1].state_dict())
        assert second[4] == {torch.float16}
        runs[name] = whole
    ours, theirs = runs["scaler_core"], runs["torch"]
    assert ours[3] == theirs[3]
    _assert_equal(ours[0].state_dict(), theirs[0].state_dict())
    _assert_equal(ours[1].state_dict(), theirs[1].state_dict())
    _assert_real(ours[3], ours[4], ours[2], len(OVERFLOW_AT))
    # Fabric saves only what the state names: the scaler is in it because we put it there.
    saved = torch.load(tmp_path / "whole" / "fabric-scaler_core.ckpt", weights_only=True)
    assert saved["scaler"] == ours[2].state_dict()


@pytest.mark.parametrize("name", list(SCALERS))
def test_fabric_clip_gradients_raises_on_an_overflow_by_default(tmp_path: Path, name: str) -> None:
    with pytest.raises(
        RuntimeError,
        match=r"The total norm of order 2\.0 for gradients from `parameters` is non-finite",
    ):
        _fabric_run(name, tmp_path, range(16), clip={"max_norm": 0.5})


# --- checkpoints through the Trainer ----------------------------------------------


def _fit_resumed(name: str, tmp_path: Path, model_kwargs: dict[str, Any], **kwargs: Any) -> Any:
    """One epoch, a checkpoint, and a fresh Trainer, model and scaler resuming from it."""
    first, trainer, first_scaler = _fit(
        name, tmp_path / "first", model_kwargs, max_epochs=1, **kwargs
    )
    path = tmp_path / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["MixedPrecision"] == first_scaler.state_dict()
    scaler = SCALERS[name]("cpu", **KWARGS)
    torch.manual_seed(2)  # other weights: the checkpoint must bring them back
    model = _Model(**model_kwargs)
    trainer = _trainer(scaler, tmp_path / name, max_epochs=2, **kwargs)
    trainer.fit(model, _data(), ckpt_path=path)
    model.scales[:0] = first.scales
    model.dtypes |= first.dtypes
    return model, trainer, scaler


@quiet
def test_trainer_resume_from_ckpt_path_is_bit_for_bit(tmp_path: Path) -> None:
    kwargs: dict[str, Any] = {
        "model_kwargs": {},
        "gradient_clip_val": 0.5,
        "accumulate_grad_batches": 2,
    }
    resumed = _compare(_fit_resumed, tmp_path / "resumed", skips=len(OVERFLOW_AT), **kwargs)
    whole = _compare(_fit, tmp_path / "whole", skips=len(OVERFLOW_AT), max_epochs=2, **kwargs)
    assert resumed[0].scales == whole[0].scales
    _assert_equal(resumed[0].state_dict(), whole[0].state_dict())
    _assert_equal(
        resumed[0].trainer.optimizers[0].state_dict(), whole[0].trainer.optimizers[0].state_dict()
    )


# --- the traps --------------------------------------------------------------------


def test_trap_precision_16_mixed_on_a_cpu_is_bfloat16_without_a_scaler(tmp_path: Path) -> None:
    with pytest.warns(
        UserWarning, match="AMP with fp16 is not supported on CPU. Using `precision='bf16-mixed'`"
    ):
        trainer = pl.Trainer(
            accelerator="cpu", precision="16-mixed", logger=False, default_root_dir=tmp_path
        )
    plugin = trainer.precision_plugin
    assert (plugin.precision, plugin.scaler) == ("bf16-mixed", None)
    with plugin.forward_context():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
        fabric = Fabric(accelerator="cpu", precision="16-mixed")
    assert fabric._precision.precision == "bf16-mixed"
    assert fabric._precision.scaler is None
    # The plugin given explicitly keeps float16 on the CPU, and the scaler it is given.
    explicit = MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))
    with explicit.forward_context():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float16
    # Both at once is refused.
    with pytest.raises(ValueError, match="Received both `precision=16-mixed` and `plugins="):
        pl.Trainer(accelerator="cpu", precision="16-mixed", plugins=[explicit])


@quiet
@pytest.mark.parametrize("name", list(SCALERS))
def test_trap_a_fused_optimizer_refuses_lightnings_clipping(tmp_path: Path, name: str) -> None:
    with pytest.raises(
        RuntimeError, match="does not allow for gradient clipping because it performs unscaling"
    ):
        _fit(name, tmp_path, {"fused": True}, max_epochs=1, gradient_clip_val=0.5)


@pytest.mark.parametrize("sharded", [TorchShardedGradScaler, ShardedGradScaler, GradScaler])
def test_trap_fsdp_refuses_any_scaler(sharded: Any) -> None:
    scaler = sharded("cpu", **KWARGS)
    for plugin in (FSDPPrecision, FabricFSDPPrecision):
        # Lightning 2.6.6 reads self.precision (still the class default "32-true")
        # before setting it, so every scaler is refused, PyTorch's own included.
        with pytest.raises(
            ValueError, match=r"^`precision='16-mixed'` does not use a scaler, found"
        ):
            plugin("16-mixed", scaler=scaler)
    with pytest.raises(
        TypeError, match="The FSDP strategy can only work with the `FSDPPrecision` plugin"
    ):
        FSDPStrategy(precision_plugin=MixedPrecision("16-mixed", "cpu", scaler=scaler))
    with pytest.raises(
        TypeError, match="The FSDP strategy can only work with the `FSDPPrecision` plugin"
    ):
        FabricFSDPStrategy(precision=FabricMixedPrecision("16-mixed", "cpu", scaler=scaler))


@pytest.mark.filterwarnings(
    "ignore:torch.cuda.amp.GradScaler is enabled, but CUDA is not available"
)
@pytest.mark.parametrize("plugin_class", [FSDPPrecision, FabricFSDPPrecision])
def test_fsdp_workaround_assign_the_scaler_after_construction(plugin_class: Any) -> None:
    plugin = plugin_class("16-mixed")
    # What the plugin builds itself is PyTorch's, for "cuda": disabled on a CPU.
    assert type(plugin.scaler) is TorchShardedGradScaler
    assert not plugin.scaler.is_enabled()
    ours = ShardedGradScaler("cpu", **KWARGS)
    plugin.scaler = ours
    assert plugin.state_dict() == ours.state_dict()
    plugin.load_state_dict({**ours.state_dict(), "scale": 8.0})
    assert ours.get_scale() == 8.0


# One gloo rank in a fresh interpreter (Fabric starts a process group). Fabric refuses
# FSDP on a CPU (``type(strategy) is FSDPStrategy`` and accelerator "cpu"), so the
# shim, the same for both runs, is a subclass of the strategy and the model wrapped
# beforehand with ``device_id=cpu`` (Lightning leaves a wrapped model as it is), with
# the plugin's own ``mixed_precision_config`` (float16 parameters, so float16 runs;
# the plugin's autocast is for "cuda" and switches itself off on a CPU).
_FSDP_RUN = """
import math, sys, warnings
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import FSDPPrecision
from lightning.fabric.strategies import FSDPStrategy
from scaler_core.torch import ShardedGradScaler

warnings.filterwarnings("ignore", "torch.cuda.amp.GradScaler is enabled, but CUDA")
warnings.filterwarnings("ignore", "CUDA is not available or torch_xla is imported")
warnings.filterwarnings("ignore", "FSDP is switching to use `NO_SHARD`")
OVERFLOW_AT = {3, 9}


class CpuFSDP(FSDPStrategy):
    pass


def run(scaler_class):
    plugin = FSDPPrecision("16-mixed")
    plugin.scaler = scaler_class("cpu", init_scale=2.0**10, growth_interval=2)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=CpuFSDP(precision=plugin))
    fabric.launch()
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    dtypes = set()
    net[0].register_forward_hook(lambda _m, _i, out: dtypes.add(out.dtype))
    net = FullyShardedDataParallel(
        net, device_id=torch.device("cpu"), mixed_precision=plugin.mixed_precision_config
    )
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    torch.manual_seed(0)
    x = torch.randn(48, 8)
    scales = []
    for step in range(12):
        batch = x[4 * step : 4 * step + 4]
        opt.zero_grad()
        fabric.backward(torch.nn.functional.mse_loss(model(batch), batch[:, :1] * 2))
        if step in OVERFLOW_AT:
            next(model.parameters()).grad[0] = math.inf
        opt.step()
        scales.append(plugin.scaler.get_scale())
    out = {
        "scales": scales,
        "dtypes": sorted(str(d) for d in dtypes),
        "params": [p.detach().clone() for p in model.parameters()],
        "optimizer": opt.state_dict(),
        "scaler": plugin.scaler.state_dict(),
    }
    dist.destroy_process_group()
    return out


torch.save({"torch": run(TorchSharded), "scaler_core": run(ShardedGradScaler)}, sys.argv[1])
"""


def test_fsdp_workaround_in_fabric_on_one_gloo_rank(tmp_path: Path, run_python: Any) -> None:
    out = tmp_path / "fsdp.pt"
    run_python(f"import sys; sys.argv = ['fsdp', {str(out)!r}]\n" + _FSDP_RUN)
    runs = torch.load(out, weights_only=True)
    ours, theirs = runs["scaler_core"], runs["torch"]
    assert ours["scales"] == theirs["scales"]
    _assert_equal(ours["params"], theirs["params"])
    _assert_equal(ours["optimizer"], theirs["optimizer"])
    assert ours["dtypes"] == theirs["dtypes"] == ["torch.float16"]
    ratios = [
        b / a for a, b in zip([KWARGS["init_scale"], *ours["scales"]], ours["scales"], strict=False)
    ]
    assert 0.5 in ratios
    assert 2.0 in ratios
    assert ours["scaler"]["scaler_core"]["state"]["skipped_steps"] == 2
    assert {k: ours["scaler"][k] for k in theirs["scaler"]} == theirs["scaler"]
