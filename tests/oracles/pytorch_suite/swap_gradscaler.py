"""A pytest plugin: PyTorch's ``GradScaler`` names point at ``scaler_core.torch.GradScaler``.

Loaded with ``-p``, before any test module is imported, so a test file that
writes ``torch.amp.GradScaler(...)`` or ``torch.GradScaler(...)`` (PyTorch's own
``test/test_torch.py`` does both) gets scaler-core's class instead.
"""

from __future__ import annotations

from typing import Any


def pytest_configure(config: Any) -> None:
    import torch
    import torch.amp.grad_scaler

    from scaler_core.torch import GradScaler

    torch.amp.GradScaler = GradScaler  # type: ignore[misc]
    torch.amp.grad_scaler.GradScaler = GradScaler  # type: ignore[misc]
    torch.GradScaler = GradScaler  # type: ignore[attr-defined, misc]
