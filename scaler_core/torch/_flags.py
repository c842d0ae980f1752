"""The drop-in's found flags: where an optimizer's flags live and what is ORed into them.

PyTorch's ``GradScaler`` keeps one float flag (0.0 or 1.0) per device per optimizer
(``found_inf_per_device``); fused optimizers skip where theirs is 1.0. Every flag a
step is decided from passes through :func:`forbid`; they are combined into one
by :func:`~scaler_core.backends.torch_kernels.any_found`, read on the host by
:func:`read_any` where a read is due.
"""

from __future__ import annotations

from typing import Any

import torch

from ..backends import torch_kernels as kernels
from ._groups import Group, all_reduce_flags

__all__ = ["below_one", "flag_devices", "forbid", "output_check", "read_any"]


def flag_devices(
    buckets: dict[torch.device, Any], scale_device: torch.device, always: bool
) -> list[torch.device]:
    """The devices that get a found flag: the gradients', or the scale's when the
    optimizer has no gradient here and a flag is still due (``always``): with a
    process group (this rank must join every exchange the others make, in the same
    order), or for FSDP1's ``ShardedGradScaler``, whose ranks may hold no shard of an
    optimizer's parameters."""
    if buckets or not always:
        return list(buckets)
    return [scale_device]


def forbid(
    found: dict[torch.device, torch.Tensor], failed: torch.Tensor | None, group: Group | None
) -> None:
    """OR into an optimizer's found flags, in place, what forbids its step.

    ``failed`` (on the device route) is a failure recorded by an earlier ``update``:
    after it no step may move a parameter until the user deals with it (loads a
    checkpoint); ORed on the device, with no synchronisation. Then the flags of the
    other ranks of ``group``: exactly one all-reduce per call, whatever this rank
    holds (every rank's call gets a flag, see :func:`flag_devices`), so the ranks'
    exchanges pair up in order.
    """
    if failed is not None:
        for device, flag in found.items():
            held = failed.to(device, dtype=flag.dtype, non_blocking=True)
            torch.maximum(flag, held, out=flag)
    if group is not None:
        all_reduce_flags(list(found.values()), group)


def read_any(found: dict[torch.device, torch.Tensor]) -> bool:
    """Whether any of an optimizer's flags is set, read on the host (one read)."""
    return bool(found) and kernels.any_found(found.values(), next(iter(found)), read=True)


def output_check(inv_scale: torch.Tensor, floor: float | None) -> bool | None:
    """Whether the unscaled values need their own check: only where the scale may be
    below 1 (no ``floor`` of at least 1). Decided on the host where the inverse is
    read for free, else ``None``: on the device, without a synchronisation."""
    if not below_one(floor):
        return False
    if kernels.reads_free(inv_scale.device):
        return bool(inv_scale.item() > 1.0)
    return None


def below_one(floor: float | None) -> bool:
    """Whether a scale with this ``floor`` (``min_scale``) may fall below 1, where an
    unscale multiplies by more than 1 and can overflow."""
    return floor is None or floor < 1.0
