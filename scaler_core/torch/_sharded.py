"""The drop-in for FSDP1's ``ShardedGradScaler``: :class:`GradScaler` with that class's
arguments and behaviour (float16 gradients, a flag on every rank, the default group)."""

from __future__ import annotations

from typing import Any, cast

import torch

from .._config import ScalerConfig
from .._errors import InvalidArgumentError
from ._groups import DEFAULT_GROUP, Group, world
from ._scaler import GradScaler

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """A drop-in for ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``
    (FSDP1): :class:`GradScaler`, with that class's arguments and behaviour.

    Its positional order is PyTorch's ``ShardedGradScaler``'s, which differs from
    ``GradScaler``'s: ``(device, init_scale, backoff_factor, growth_factor,
    growth_interval, enabled, process_group)``. The found flags are ORed over
    ``process_group`` (``None``, the default, means the default group, looked up at
    each step, as PyTorch's uses it; a copy or an unpickled scaler keeps it, and
    ``scaler.process_group`` holds it, as on PyTorch's); float16 gradients (FSDP's
    ``keep_low_precision_grads``) are unscaled, a sparse one coalesced in float32 first
    (as PyTorch's does); an optimizer with no gradient on this rank (FSDP1 with
    ``use_orig_params=True`` may leave a rank none of its parameters' shards) gets a
    flag on the scale's device, steps and joins the all-reduce; ``scale`` returns the
    scaled loss in the loss's own dtype, as PyTorch's does. :meth:`unscale_and_clip_`
    and :meth:`clip_and_step` clip by the norm over the group, as
    ``FullyShardedDataParallel.clip_grad_norm_`` does (see there). Everything else
    (failing closed, ``on_step``, ``config=``) is :class:`GradScaler`'s.

    >>> scaler = ShardedGradScaler("cpu", 2.0**10, 0.25)  # backoff_factor third
    >>> scaler.get_backoff_factor()
    0.25
    """

    _ALLOW_FP16 = True
    _FLAG_WITHOUT_GRADS = True

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
        *,
        config: ScalerConfig | None = None,
        on_step: Any = None,
        report_leaves: bool = False,
    ) -> None:
        super().__init__(
            device,
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            enabled,
            config=config,
            process_group=process_group,
            on_step=on_step,
            report_leaves=report_leaves,
        )

    @property
    def process_group(self) -> Any:
        """As PyTorch's: the group the flags are ORed over (``None``: the default group)."""
        given = self._process_group
        return world() if given is DEFAULT_GROUP else given

    @process_group.setter
    def process_group(self, group: Any) -> None:
        self._process_group = group

    def _group(self) -> Group:
        return cast(Group, Group.of(self._process_group, default=True))

    @staticmethod
    def _coalesce_half(grad: torch.Tensor) -> torch.Tensor:
        """Summed in float32, then float16 again, as PyTorch's class coalesces: a sum of
        many float16 duplicates would stop growing at 2048 (float16's spacing there is 2)."""
        return grad.type(torch.float32).coalesce().type(torch.float16)

    def _check_shard(self, index: int, param: torch.Tensor) -> None:
        """FSDP's shards only, each laid out over exactly the group's ranks: then every
        element is held by one rank, and the sum over the group counts it once."""
        if not getattr(param, "_fsdp_flattened", False):
            raise InvalidArgumentError(
                f"parameter {index} (shape {tuple(param.shape)}) is not one FSDP manages, but "
                f"ShardedGradScaler clips by the norm over its process group, which counts "
                f"each rank's FSDP shard once (a parameter each rank holds whole would count "
                f"once per rank); give the optimizer the FSDP module's parameters only, or "
                f"call scaler.unscale_(optimizer) and the module's own clip_grad_norm_"
            )
        padded = getattr(param, "_padded_unsharded_size", None)
        shard = getattr(param, "_sharded_size", None)
        if padded is None or shard is None or not shard.numel():
            return  # an original parameter (use_orig_params=True): FSDP's view of a shard
        import torch.distributed as dist  # noqa: PLC0415 - only data-parallel users need it

        ranks = dist.get_world_size(self._group().handle)
        if padded.numel() != shard.numel() * ranks:
            raise InvalidArgumentError(
                f"parameter {index} is FSDP's flat parameter sharded over "
                f"{padded.numel() // shard.numel()} rank(s) (NO_SHARD or HYBRID_SHARD), but "
                f"this scaler's process group has {ranks}, so the norm summed over it would "
                f"count the replicas again; call scaler.unscale_(optimizer) and the FSDP "
                f"module's own clip_grad_norm_, which knows its sharding"
            )

    def scale(self, outputs: Any) -> Any:
        """``outputs`` times the scale, each in its own dtype (as PyTorch's class returns
        it: a float16 loss stays float16)."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            return super().scale(outputs).type(outputs.dtype)

        def cast(scaled: Any, given: Any) -> Any:
            if isinstance(given, torch.Tensor):
                return scaled.type(given.dtype)
            if isinstance(given, (list, tuple)):
                return type(given)(cast(a, b) for a, b in zip(scaled, given, strict=True))
            return scaled

        given = list(outputs) if not isinstance(outputs, (list, tuple)) else outputs
        return cast(super().scale(given), given)
