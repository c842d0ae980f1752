"""Optimizers that unscale in their own pass (PyTorch's ``fused=True`` ones).

Such an optimizer takes ``grad_scale`` and ``found_inf`` as attributes for one
``step``: it divides each gradient by ``grad_scale`` inside its update and skips
the update where ``found_inf`` is 1.0. PyTorch's ``GradScaler.step`` calls it on
every step, skipped or not; so does the drop-in, but where that call leaves a
defect (:func:`skip_known`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["skip_known", "step_fused", "takes_grad_scale"]


def takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` unscales in its own pass, taking ``grad_scale`` and
    ``found_inf`` as attributes (not the deprecated ``grad_scaler`` keyword)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
        "grad_scaler" not in inspect.signature(optimizer.step).parameters
    )


def step_fused(
    optimizer: torch.optim.Optimizer,
    divisor: torch.Tensor | None,
    found_inf: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``optimizer.step(*args, **kwargs)`` with ``divisor`` (times a ``grad_scale`` the
    user set, as PyTorch's step multiplies it in) as its ``grad_scale`` (``None``: the
    gradients are unscaled already, the user's kept) and ``found_inf`` (1.0 or 0.0:
    its kernels skip only on 1.0); both attributes removed afterwards."""
    given = getattr(optimizer, "grad_scale", None)
    if divisor is not None:  # a new tensor, as PyTorch's: the scale changes in update
        divisor = divisor * (1 if given is None else given)
    optimizer.grad_scale = given if divisor is None else divisor  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]


def skip_known(optimizer: torch.optim.Optimizer, found: torch.Tensor) -> bool:
    """Whether a fused optimizer's skipped step is not called: only where PyTorch's
    call leaves a defect, and then on every device alike.

    That is a fused SGD with momentum before its first step (a parameter with a
    gradient and no momentum buffer yet): skipped on its ``found_inf``, it still
    keeps the momentum buffers it made with ``torch.empty_like``, and its next step
    takes their uninitialised memory for a momentum (PyTorch's ``GradScaler.step``
    calls it so). There the flag is read (on an accelerator one synchronisation a
    step, until the buffers exist) and a skipped step is not called. Every other
    fused step is called, as PyTorch's is, and skips inside its kernel.
    """
    return _momentum_unborn(optimizer) and bool(found.item())


def _momentum_unborn(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is an SGD with momentum holding a gradient whose parameter
    has no momentum buffer yet (its next step is its first for that parameter)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    state = optimizer.state
    for group in optimizer.param_groups:
        if group.get("momentum", 0) == 0:
            continue
        for param in group["params"]:
            if param.grad is not None and state.get(param, {}).get("momentum_buffer") is None:
                return True
    return False
