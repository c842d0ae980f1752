"""Lightning takes ``scaler_core.torch.GradScaler`` where it takes PyTorch's.

A small model trains with Lightning's ``MixedPrecision("16-mixed", "cpu", scaler=...)``
once with each scaler, from the same seed, with an overflow injected at chosen
steps: the weights and the scale history come out equal to the bit, and our
scaler's state counts the skips. Skipped without ``lightning``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")
with warnings.catch_warnings():  # a third-party deprecation at import must not fail the test
    warnings.simplefilter("ignore")
    pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (pip install lightning)")
    from lightning.pytorch.plugins.precision import MixedPrecision

from scaler_core.torch import GradScaler  # noqa: E402

pytestmark = pytest.mark.torch
OVERFLOW_AT = {3, 9, 10}


class _Model(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.scales: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self.global_step in OVERFLOW_AT:
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_train_batch_end(self, *args: Any) -> None:
        self.scales.append(self.trainer.precision_plugin.scaler.get_scale())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(scaler: Any) -> tuple[_Model, Any]:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x[:, :1] * 2), batch_size=8, num_workers=0
    )
    model = _Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=3,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice (workers, logging) is not the point
        trainer.fit(model, data)
    return model, trainer


def test_lightning_trains_with_it_as_with_pytorchs() -> None:
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    model_ours, trainer = _fit(ours)
    model_theirs, _ = _fit(theirs)
    assert trainer.precision_plugin.scaler is ours
    assert model_ours.scales == model_theirs.scales
    assert len(set(model_ours.scales)) > 2
    for a, b in zip(model_ours.parameters(), model_theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    assert ours.state.skipped_steps == len(OVERFLOW_AT)
    assert ours.state.steps == 24  # 3 epochs of 8 batches
