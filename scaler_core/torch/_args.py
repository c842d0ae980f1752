"""The drop-in's arguments, checked before anything changes, and what it asks of an optimizer.

Each check raises :class:`~scaler_core.InvalidArgumentError` naming the argument,
its value and the fix, or PyTorch's own error where PyTorch's class raises one.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .._config import ScalerConfig, shown
from .._errors import InvalidArgumentError
from .._f32 import f32, is_normal_f32

__all__ = [
    "L2",
    "TORCH_DEFAULTS",
    "as_f32",
    "as_float",
    "new_scale_of",
    "no_spikes",
    "norm_type_of",
    "numbers_of",
    "subset_of",
]

#: ``torch.amp.GradScaler``'s defaults: ``init_scale``, ``growth_factor``,
#: ``backoff_factor``, ``growth_interval``.
TORCH_DEFAULTS = (2.0**16, 2.0, 0.5, 2000)
#: The norm the fused clip computes (``clip_grad_norm_``'s default ``norm_type``).
L2 = 2.0


def numbers_of(config: object, given: tuple[float, float, float, int]) -> tuple[Any, ...]:
    """PyTorch's four numbers taken from ``config`` (``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``), where ``given`` are the ones passed.

    Raises:
        InvalidArgumentError: ``config`` is not a ScalerConfig, or numbers were given
            beside it.
    """
    if not isinstance(config, ScalerConfig):
        raise InvalidArgumentError(
            f"config={config!r}, but it must be a ScalerConfig (or a preset's)"
        )
    if given != TORCH_DEFAULTS:
        raise InvalidArgumentError(
            "config= was given with init_scale, growth_factor, backoff_factor or "
            "growth_interval; pass the numbers in the config only"
        )
    return (config.init_scale, config.growth_factor, config.backoff_factor, config.growth_interval)


def no_spikes(config: ScalerConfig) -> None:
    """Refuse spike skipping: PyTorch's ``step`` decides the skip before any norm is known."""
    if config.spike_threshold is not None:
        raise InvalidArgumentError(
            f"spike_threshold={config.spike_threshold!r}, but scaler_core.torch.GradScaler "
            f"does not do spike skipping (torch.amp.GradScaler's step() decides the skip from "
            f"the found flags alone); use spike_threshold=None here, or the functional API "
            f"(scaler_core.update(state, found, grad_norm=...))"
        )


def as_float(value: Any) -> Any:
    """``float(value)``, or ``value`` itself where no float holds it (an int past float's
    range): then the config's check names it, rather than a raw ``OverflowError``."""
    try:
        return float(value)
    except OverflowError:
        return value


def as_f32(value: Any) -> Any:
    """``value`` rounded to float32, as PyTorch stores a scale (see :func:`as_float`)."""
    wide = as_float(value)
    return f32(wide) if isinstance(wide, float) else wide


def norm_type_of(norm_type: Any) -> float:
    """``norm_type`` as ``clip_grad_norm_`` reads it (a number, or ``"inf"``), checked.

    Raises:
        InvalidArgumentError: Not a positive number (``inf`` included).
    """
    must = "a positive number or inf (2.0 for the L2 norm, float('inf') for the largest |g|)"
    if isinstance(norm_type, str) and norm_type.strip().lower() == "inf":
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, numbers.Real):
        raise InvalidArgumentError(f"norm_type={norm_type!r}, but it must be {must}")
    value = float(norm_type)
    if not value > 0.0:  # NaN, zero and negative orders
        raise InvalidArgumentError(f"norm_type={norm_type!r}, but it must be {must}")
    return value


def subset_of(parameters: Any, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parameters`` (a tensor or an iterable of them) as a list, each one of the
    optimizer's ``params`` (another's gradient would be clipped while still scaled).

    Raises:
        InvalidArgumentError: A tensor is not one of the optimizer's parameters.
    """
    chosen = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owned = {id(p) for p in params}
    for i, p in enumerate(chosen):
        if id(p) not in owned:
            what = f"a {type(p).__name__}" + (
                f" of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else ""
            )
            raise InvalidArgumentError(
                f"parameters[{i}] is {what} that is not a parameter of the optimizer, but "
                f"unscale_and_clip_ unscales the optimizer's gradients only; pass a subset of "
                f"its parameters, or call unscale_ and clip_grad_norm_ yourself"
            )
    return chosen


def new_scale_of(
    new_scale: object, config: ScalerConfig, device_type: str, reads_free: Any
) -> float | torch.Tensor:
    """``new_scale`` (``update``'s argument) checked as far as the host can see it, as
    what to fill the scale with: PyTorch's checks of a tensor first (its messages),
    then the float32 value the scale would hold, against every scale's rule and
    ``config``'s bounds. A tensor on a device whose values ``reads_free`` says cost a
    synchronisation is taken unread, as PyTorch takes it.

    Raises:
        AssertionError: PyTorch's, for a tensor on another device type, of more than
            one element, or requiring grad.
        InvalidArgumentError: No scale, out of the config's bounds, or not a static
            config's scale.
    """
    if isinstance(new_scale, torch.Tensor):
        reason = (
            "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
            "torch.FloatTensor with requires_grad=False."
        )
        if new_scale.device.type != device_type:
            raise AssertionError(reason)  # PyTorch's error
        if new_scale.numel() != 1:
            raise AssertionError(reason)  # PyTorch's error
        if new_scale.requires_grad is True:
            raise AssertionError(reason)  # PyTorch's error
        if not reads_free(new_scale.device):
            return new_scale  # read, it would synchronise: taken as PyTorch takes it
        # The value PyTorch's copy_ would store (and its error for a bad shape).
        held = torch.empty((), dtype=torch.float32).copy_(new_scale).item()
        fill: float | torch.Tensor = new_scale
    elif isinstance(new_scale, numbers.Real) and not isinstance(new_scale, bool):
        try:
            fill = float(new_scale)
        except OverflowError:  # an int no float holds: no scale either
            fill = math.inf
        held = f32(fill) if math.isfinite(fill) else fill
    else:
        raise InvalidArgumentError(
            f"new_scale={shown(new_scale)}, but it must be a float, an int or a one-element "
            f"tensor holding a positive, finite, normal float32 value; pass a float such "
            f"as 1024.0"
        )
    exact = not isinstance(new_scale, torch.Tensor) and held == new_scale
    seen = shown(new_scale) if exact else f"{shown(new_scale)} (float32: {held!r})"
    if not is_normal_f32(held):
        raise InvalidArgumentError(
            f"new_scale={seen}, but it must be a positive, finite, normal float32 "
            f"value (as every scale); pass a float such as 1024.0"
        )
    low, high = config.min_scale, config.max_scale
    if (low is not None and held < low) or (high is not None and held > high):
        raise InvalidArgumentError(
            f"new_scale={seen}, but it must lie within this scaler's config bounds "
            f"[min_scale={low!r}, max_scale={high!r}]; pass a scale in that range"
        )
    if not config.dynamic and held != config.init_scale:
        raise InvalidArgumentError(
            f"new_scale={seen}, but this scaler's config is static (its scale stays "
            f"init_scale={config.init_scale!r}); pass {config.init_scale!r}, or use a "
            f"dynamic config"
        )
    return fill
