"""The drop-in's process groups: which ranks skip together, and their collectives.

With a ``process_group`` each rank's found flags are OR-ed over the group (one
all-reduce per call, whatever the rank holds, so the ranks' exchanges pair up in
order) and the clip's norm is the one over the group. ``torch.distributed`` is
imported only when a group is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch

from .._errors import InvalidArgumentError
from ..backends import torch_kernels as kernels

__all__ = [
    "DEFAULT_GROUP",
    "Group",
    "all_reduce_flags",
    "check_shards",
    "clip_to_group_norm",
    "clip_with_norm_of",
    "global_norm",
    "world",
]


class _DefaultGroup:
    """The default process group, looked up each time it is used (``dist.group.WORLD``
    once it exists). It pickles by name, so a copied or unpickled scaler still ORs its
    flags over the default group of the process it lands in."""

    def __repr__(self) -> str:
        return "WORLD"

    def __reduce__(self) -> str:
        return "DEFAULT_GROUP"


DEFAULT_GROUP = _DefaultGroup()


class Group(NamedTuple):
    """A process group to combine over, as ``torch.distributed`` takes it (``handle``
    ``None``: the default group)."""

    handle: Any

    @classmethod
    def of(cls, given: Any, *, default: bool = False) -> Group | None:
        """The group a scaler was given (``None``: none, or with ``default`` the
        default group, as PyTorch's ``ShardedGradScaler`` reads ``None``)."""
        if given is None and not default:
            return None
        return cls(None if given is None or given is DEFAULT_GROUP else given)


def world() -> Any:
    """``dist.group.WORLD`` if a default group exists, else ``None`` (no group to be)."""
    import torch.distributed as dist  # noqa: PLC0415 - only data-parallel users need it

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def all_reduce_flags(flags: list[torch.Tensor], group: Group) -> None:
    """OR (max) every rank's ``flags`` in place over ``group``: exactly one all-reduce,
    however many devices this rank's flags are on (their maximum is exchanged and
    written back to each)."""
    import torch.distributed as dist  # noqa: PLC0415 - only data-parallel users need it

    if len(flags) == 1:
        dist.all_reduce(flags[0], op=dist.ReduceOp.MAX, group=group.handle)
        return
    home = flags[0].device
    one = torch.stack([f.to(home, torch.float32, non_blocking=True) for f in flags]).amax()
    dist.all_reduce(one, op=dist.ReduceOp.MAX, group=group.handle)
    for flag in flags:
        flag.copy_(one.to(flag.device, non_blocking=True))


def global_norm(norm: torch.Tensor, norm_type: float, group: Group | None) -> torch.Tensor:
    """``norm`` (of this rank's gradients) as the norm over every rank's, the same on
    each: their maximum for ``inf``, else ``(sum of norm**p) ** (1/p)``, as
    ``FullyShardedDataParallel.clip_grad_norm_`` combines its shards' (the powers
    summed in float64). Unchanged without a group."""
    if group is None:
        return norm
    import torch.distributed as dist  # noqa: PLC0415 - only data-parallel users need it

    if math.isinf(norm_type):
        total = norm.clone()
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group.handle)
        return total
    powers = norm.double() ** norm_type
    dist.all_reduce(powers, op=dist.ReduceOp.SUM, group=group.handle)
    return (powers ** (1.0 / norm_type)).to(norm.dtype)


def check_shards(
    params: list[torch.Tensor], check_shard: Callable[[int, torch.Tensor], None]
) -> None:
    """Refuse, before anything changes, a clip by the norm over a group that would count
    a gradient twice: a DTensor gradient (FSDP2's norm is global over its mesh
    already), or what ``check_shard(index, param)`` refuses. Every rank runs the same
    checks on the same parameters, so they refuse alike (none is left waiting in a
    collective)."""
    dtensor = kernels.dtensor_type()
    for i, param in enumerate(params):
        if dtensor is not None and isinstance(param.grad, dtensor):
            raise InvalidArgumentError(
                f"parameter {i} has a DTensor gradient (FSDP2), whose norm is global over "
                f"its mesh already, but this scaler's process_group would sum it over the "
                f"ranks again; build the scaler without process_group under FSDP2 (its "
                f"DTensor gradients combine the flags and norms themselves)"
            )
        check_shard(i, param)


def clip_with_norm_of(norm_type: float, error_if_nonfinite: bool) -> Callable[..., Any]:
    """PyTorch's ``clip_grads_with_norm_``, which a clip by the norm over a group needs.

    Raises:
        InvalidArgumentError: PyTorch is older than 2.6 (it has none).
    """
    clip_with_norm = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if clip_with_norm is None:  # PyTorch < 2.6
        raise InvalidArgumentError(
            f"norm_type={norm_type!r}, error_if_nonfinite={error_if_nonfinite!r} or "
            f"parameters= with a process group needs torch.nn.utils.clip_grads_with_norm_ "
            f"(PyTorch >= 2.6; this is {torch.__version__}); use the defaults (the L2 "
            f"norm over all parameters), or upgrade PyTorch"
        )
    return cast(Callable[..., Any], clip_with_norm)


def clip_to_group_norm(
    clip_with_norm: Callable[..., Any],
    chosen: list[torch.Tensor],
    args: tuple[float, float, bool, bool | None],
    group: Group,
    device: torch.device,
) -> torch.Tensor:
    """Clip the (unscaled) gradients of ``chosen`` by the norm over ``group``, as
    ``FullyShardedDataParallel.clip_grad_norm_`` forms it: every rank's norm of its
    gradients combined (:func:`global_norm`, on ``device``), the same on each rank,
    then ``clip_with_norm``; ``error_if_nonfinite`` tested on that norm, so every rank
    raises alike. ``args`` are ``clip_grad_norm_``'s: ``(max_norm, norm_type,
    error_if_nonfinite, foreach)``. Returns the norm."""
    max_norm, norm_type, error_if_nonfinite, foreach = args
    grads = [p.grad for p in chosen if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    total = global_norm(local.to(device), norm_type, group)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(  # PyTorch's error (clip_grad_norm_)
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            f"non-finite, so it cannot be clipped. To disable this error and scale the "
            f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    clip_with_norm(chosen, max_norm, total, foreach)
    return total
