"""mmengine: ``ScalerCoreAmpOptimWrapper``, ``AmpOptimWrapper`` with scaler-core's scaler.

mmengine's ``AmpOptimWrapper`` scales the loss with ``torch.cuda.amp.GradScaler``
(its ``loss_scaler``). Importing this module registers, in mmengine's
``OPTIM_WRAPPERS`` registry, a subclass whose ``loss_scaler`` is
:class:`scaler_core.torch.GradScaler`; a config picks it by its ``type``::

    import scaler_core.mmengine  # registers "ScalerCoreAmpOptimWrapper"

    optim_wrapper = dict(
        type="ScalerCoreAmpOptimWrapper",
        optimizer=dict(type="AdamW", lr=1e-3),
        loss_scale="dynamic",  # or 512.0 (static), or dict(init_scale=..., growth_interval=...)
        # config="megatron",   # or a preset / ScalerConfig instead of loss_scale
    )

Everything else is mmengine's code as it runs: ``update_params``, gradient
accumulation (``accumulative_counts``), clipping (``clip_grad``, after the scaler's
``unscale_``), ``step``, the autocast of ``optim_context``, and ``state_dict``, which
saves the scaler under ``"loss_scaler"`` (PyTorch's five entries, which mmengine's
own wrapper loads, plus the scaler-core state under ``"scaler_core"``, which it
ignores); a checkpoint of mmengine's own wrapper resumes here too. With PyTorch's
numbers training is bit for bit what ``AmpOptimWrapper`` trains. On top: a config or
preset (``config=``), fail-closed refusals, the skip accounting of
``wrapper.loss_scaler.state``, and :attr:`ScalerCoreAmpOptimWrapper.step_taken`.

Importing this module imports torch and mmengine (it registers into mmengine);
importing it twice registers once.

>>> from mmengine.registry import OPTIM_WRAPPERS
>>> from scaler_core.mmengine import ScalerCoreAmpOptimWrapper
>>> OPTIM_WRAPPERS.get("ScalerCoreAmpOptimWrapper") is ScalerCoreAmpOptimWrapper
True
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

# mmengine ships no type information (no py.typed): its names are Any here.
from mmengine.device import get_device
from mmengine.registry import OPTIM_WRAPPERS

with warnings.catch_warnings():
    # mmengine.optim imports torch.distributed.optim, whose torch.jit.script and
    # torch.jit.interface warn (PyTorch 2.13) that they are deprecated: PyTorch's own
    # code, nothing a user can change.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning
    )
    from mmengine.optim import AmpOptimWrapper, OptimWrapper
    from mmengine.optim.optimizer import amp_optimizer_wrapper as _amp

from ._config import ScalerConfig
from ._errors import InvalidArgumentError, LifecycleError
from ._presets import config_for
from .torch import GradScaler, ShardedGradScaler

__all__ = ["NAME", "ScalerCoreAmpOptimWrapper"]

#: The name the wrapper is registered under in mmengine's ``OPTIM_WRAPPERS``.
NAME = "ScalerCoreAmpOptimWrapper"
#: What ``loss_scale=dict(...)`` may hold: the arguments of mmengine's scaler class
#: (``torch.cuda.amp.GradScaler``), the device excepted.
_SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
#: The keys that set the scale's numbers, which ``config=`` sets too.
_NUMBERS = _SCALER_KEYS[:4]


class ScalerCoreAmpOptimWrapper(AmpOptimWrapper):  # type: ignore[misc]
    """mmengine's ``AmpOptimWrapper``, whose ``loss_scaler`` is scaler-core's.

    Takes ``AmpOptimWrapper``'s arguments, and builds from ``loss_scale`` the
    scaler mmengine would build, as a :class:`scaler_core.torch.GradScaler`
    (:class:`scaler_core.torch.ShardedGradScaler` with ``use_fsdp=True``) on
    mmengine's device (``mmengine.device.get_device()``). Every method is
    ``AmpOptimWrapper``'s; unlike it, constructing one emits no deprecation warning
    (mmengine 0.10 builds ``torch.cuda.amp.GradScaler``, deprecated since PyTorch 2.4).

    Args:
        loss_scale: As mmengine's: ``"dynamic"`` (PyTorch's defaults), a float (a
            static scale: set back to it after every step, each step still counted
            in ``loss_scaler.state``), or a dict of the scaler's arguments
            (``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``, ``enabled``).
        dtype: As mmengine's: the autocast dtype (``"float16"``, ...), ``None`` for
            the device's default.
        use_fsdp: As mmengine's: the FSDP1 scaler.
        config: A :class:`~scaler_core.ScalerConfig`, or the name of a preset
            (``"megatron"``, ``"deepspeed"``, ...), instead of the numbers of
            ``loss_scale`` (which must then be ``"dynamic"``, or a dict without them).
        **kwargs: As mmengine's: ``OptimWrapper``'s arguments (``optimizer``,
            ``accumulative_counts``, ``clip_grad``).

    Raises:
        InvalidArgumentError: ``loss_scale`` is none of the three (also a
            ``TypeError``, as mmengine raises), its dict holds a key the scaler does
            not take; ``dtype`` is not one of mmengine's; ``config`` is not a
            ScalerConfig or a preset's name, or is given with a static scale or the
            numbers of a dict; mmengine's device is none of the accelerators
            ``AmpOptimWrapper`` trains on (``cuda``, ``npu``, ``mlu``, ``musa``).
        InvalidConfigError: The numbers make no valid config, or the preset is
            unknown.

    Nothing is built when it raises.

    >>> import scaler_core as sc
    >>> try:
    ...     ScalerCoreAmpOptimWrapper(loss_scale=512.0, config="megatron")
    ... except sc.InvalidArgumentError as exc:
    ...     print(exc)  # doctest: +NORMALIZE_WHITESPACE
    config='megatron' was given with loss_scale=512.0; set the scaler's numbers in
    one place (config=, or loss_scale=)
    """

    def __init__(
        self,
        loss_scale: str | float | dict[str, Any] = "dynamic",
        dtype: str | torch.dtype | None = None,
        use_fsdp: bool = False,
        *,
        config: ScalerConfig | str | None = None,
        **kwargs: Any,
    ) -> None:
        # mmengine/optim/optimizer/amp_optimizer_wrapper.py (0.10.7), AmpOptimWrapper.__init__,
        # with its scaler made here: its own would be torch.cuda.amp.GradScaler, built only
        # to be replaced, with a FutureWarning. Each check runs before anything is built.
        options = _scaler_options(loss_scale, config)
        cast_dtype = _dtype(dtype)
        if not (
            _amp.is_cuda_available()
            or _amp.is_npu_available()
            or _amp.is_mlu_available()
            or _amp.is_musa_available()
        ):
            raise InvalidArgumentError(
                f"mmengine's device is {get_device()!r}, but {NAME}, as mmengine's "
                f"AmpOptimWrapper, trains on cuda, npu, mlu or musa only (mmengine's "
                f"autocast takes bfloat16 alone on the CPU); use OptimWrapper there"
            )
        scaler_type = ShardedGradScaler if use_fsdp else GradScaler
        scaler = scaler_type(get_device(), **options)
        OptimWrapper.__init__(self, **kwargs)
        self._scale_update_param = loss_scale if isinstance(loss_scale, float) else None
        self.loss_scaler = scaler
        self.cast_dtype = cast_dtype

    @property
    def step_taken(self) -> bool:
        """Whether the last :meth:`step` ran the optimizer's step (``False``: skipped).

        A step is skipped when the gradients held an inf or a NaN; read it after
        ``update_params`` when :meth:`should_update` said it would step (with
        ``accumulative_counts=N``, every N-th call). A host read of the flag on an
        accelerator.

        Raises:
            LifecycleError: No step has run since the wrapper was built (or its
                ``loss_scaler`` replaced).
        """
        scaler = self.loss_scaler
        if not isinstance(scaler, GradScaler):
            raise LifecycleError(
                f"loss_scaler is a {type(scaler).__qualname__}, not scaler-core's GradScaler "
                f"(it was replaced): step_taken reads scaler-core's"
            )
        try:
            return scaler.stepped(self.optimizer)
        except InvalidArgumentError:
            raise LifecycleError(
                f"step_taken was read before the first step(): with "
                f"accumulative_counts={self._accumulative_counts}, update_params() steps "
                f"once every {self._accumulative_counts} call(s) (see should_update())"
            ) from None


def _scaler_options(loss_scale: object, config: object) -> dict[str, Any]:
    """The scaler's arguments for ``loss_scale`` and ``config``, both checked first."""
    if isinstance(loss_scale, str) and loss_scale == "dynamic":
        options: dict[str, Any] = {}
    elif isinstance(loss_scale, float):
        options = {"init_scale": loss_scale}
    elif isinstance(loss_scale, dict):
        unknown = sorted(str(key) for key in loss_scale if key not in _SCALER_KEYS)
        if unknown:
            raise InvalidArgumentError(
                f"loss_scale={loss_scale!r} holds {unknown}, but a loss_scale dict takes "
                f"only {list(_SCALER_KEYS)} (the scaler's arguments; set a policy with config=)"
            )
        options = dict(loss_scale)
    else:  # mmengine raises a TypeError with this message; InvalidArgumentError is one
        raise InvalidArgumentError(
            f'loss_scale must be of type float, dict, or "dynamic", but got {loss_scale!r}'
        )
    if config is None:
        return options
    resolved = config_for(config, example='config="megatron"')
    if isinstance(loss_scale, float) or any(name in options for name in _NUMBERS):
        raise InvalidArgumentError(
            f"config={config!r} was given with loss_scale={loss_scale!r}; set the scaler's "
            f"numbers in one place (config=, or loss_scale=)"
        )
    options["config"] = resolved
    return options


def _dtype(dtype: object) -> torch.dtype | None:
    """mmengine's ``dtype`` argument, a name converted to the ``torch.dtype``."""
    valid = AmpOptimWrapper.valid_dtypes
    if isinstance(dtype, str):
        if dtype not in valid:
            raise InvalidArgumentError(f"dtype={dtype!r}, but it must be one of {list(valid)}")
        resolved: torch.dtype = getattr(torch, dtype)
        return resolved
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    raise InvalidArgumentError(
        f"dtype={dtype!r}, but it must be None, a torch.dtype or one of {list(valid)}"
    )


def _register() -> None:
    """Register the wrapper under :data:`NAME`, once, even if this module is imported again.

    A re-import (``importlib.reload``) makes a new class of the same module and
    name: it replaces the old one. Another class already holding the name is
    refused rather than silently replaced.
    """
    held = OPTIM_WRAPPERS.module_dict.get(NAME)
    ours = (ScalerCoreAmpOptimWrapper.__module__, ScalerCoreAmpOptimWrapper.__qualname__)
    if held is not None and (held.__module__, held.__qualname__) != ours:
        raise InvalidArgumentError(
            f"mmengine's OPTIM_WRAPPERS already holds {NAME!r} as "
            f"{held.__module__}.{held.__qualname__}; scaler_core.mmengine registers its "
            f"wrapper under that name: remove the other registration"
        )
    if held is not ScalerCoreAmpOptimWrapper:
        OPTIM_WRAPPERS.register_module(name=NAME, module=ScalerCoreAmpOptimWrapper, force=True)


_register()
