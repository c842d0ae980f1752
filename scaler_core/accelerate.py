"""accelerate and the HF Trainer: scaler-core's scaler where accelerate builds its own.

accelerate builds its loss scaler in ``Accelerator(mixed_precision="fp16")`` and
``prepare()`` hands it to every optimizer it wraps (an ``AcceleratedOptimizer``
keeps it as ``.scaler`` and runs ``scaler.step`` and ``scaler.update`` with it).
:func:`install` replaces that scaler, before ``prepare()``, with scaler-core's
class of the same kind::

    accelerator = Accelerator(mixed_precision="fp16")
    install(accelerator)  # or install(trainer), before trainer.train()
    model, optimizer = accelerator.prepare(model, optimizer)

* ``torch.amp.GradScaler`` (one process, DDP, and FSDP2, for which accelerate
  builds the plain class too) becomes :class:`scaler_core.torch.GradScaler`;
* PyTorch's FSDP1 ``ShardedGradScaler`` becomes
  :class:`scaler_core.torch.ShardedGradScaler`, with its process group.

The numbers accelerate built its scaler with (its defaults, or those of a
``GradScalerKwargs`` handler) carry over, so with PyTorch's defaults training is
bit for bit what it was; or pass a :class:`~scaler_core.ScalerConfig` (a preset).

Setting ``accelerator.scaler`` by hand after ``prepare()`` leaves each prepared
optimizer with the old scaler: the new one scales the loss, the old one unscales
it, and once both have run a step the update is off by the ratio of their scales
(1024x for scales of 2**15 and 2**5), silently. :func:`install` refuses that, and
every other call that would not do what it says, before it changes anything.

Importing this module imports torch (through :mod:`scaler_core.torch`), never
accelerate or transformers: the target's type is looked up among the modules
already imported.

>>> import scaler_core as sc
>>> from scaler_core.accelerate import install
>>> try:
...     install("my accelerator")
... except sc.InvalidArgumentError as exc:
...     print(exc)
target='my accelerator', but it must be an accelerate.Accelerator or a transformers.Trainer
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ._config import ScalerConfig
from ._errors import InvalidArgumentError, LifecycleError
from .torch import GradScaler, ShardedGradScaler

__all__ = ["install"]

#: The module of PyTorch's FSDP1 scaler (looked up, never imported: accelerate imports it).
_SHARDED = "torch.distributed.fsdp.sharded_grad_scaler"
#: ``GradScalerKwargs`` fields that set the scaler's numbers (``config=`` sets them too).
_NUMBERS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


def install(
    target: Any,
    config: ScalerConfig | None = None,
    *,
    on_step: Any = None,
    report_leaves: bool = False,
) -> GradScaler:
    """Replace the scaler accelerate built with scaler-core's, before ``prepare()``.

    Call it right after creating the ``Accelerator`` (or the ``Trainer``), before
    ``prepare()`` (``trainer.train()``) wraps an optimizer: ``prepare()`` hands the
    accelerator's scaler to each optimizer it wraps. The new scaler is of the kind
    accelerate built (:class:`scaler_core.torch.GradScaler` for
    ``torch.amp.GradScaler``, :class:`scaler_core.torch.ShardedGradScaler` for
    PyTorch's FSDP1 ``ShardedGradScaler``), on the same device, with the same
    numbers (init scale, factors, interval) unless ``config`` is given, and, for
    FSDP1, the same process group.

    Args:
        target: An ``accelerate.Accelerator``, or a ``transformers.Trainer`` (its
            ``.accelerator`` is used).
        config: A :class:`~scaler_core.ScalerConfig` or preset instead of the
            numbers accelerate built its scaler with.
        on_step: As :class:`scaler_core.torch.GradScaler`'s: called once per
            update with a :class:`~scaler_core.StepReport`.
        report_leaves: As :class:`scaler_core.torch.GradScaler`'s.

    Returns:
        The new scaler, also set as ``accelerator.scaler``.

    Raises:
        InvalidArgumentError: ``target`` is neither an ``Accelerator`` nor a
            ``Trainer``; accelerate built no scaler (``mixed_precision`` is not
            ``"fp16"``, DeepSpeed or Megatron-LM scale the loss themselves, or the
            device is the CPU, where accelerate trains fp16 in float32), a disabled
            one, one of another library (torch_xla, a vendor's), or the scaler is
            scaler-core's already (installed once); ``config`` is
            not a ScalerConfig, has spike skipping on, or is given together with a
            ``GradScalerKwargs`` that sets the numbers; a bad ``on_step`` or
            ``report_leaves``.
        InvalidConfigError: accelerate's numbers make no valid config.
        LifecycleError: ``prepare()`` already wrapped an optimizer, or the scaler
            has already scaled a loss.

    Nothing is changed when it raises.
    """
    accelerator = _accelerator(target)
    old = _scaler_of(accelerator)
    handler = getattr(accelerator, "scaler_handler", None)
    given = handler.to_kwargs() if handler is not None else {}
    if config is not None and any(name in given for name in _NUMBERS):
        numbers = ", ".join(f"{name}={given[name]!r}" for name in _NUMBERS if name in given)
        raise InvalidArgumentError(
            f"config= was given, and the Accelerator's GradScalerKwargs sets {numbers}; "
            f"set the scaler's numbers in one place (the config, or GradScalerKwargs)"
        )
    options: dict[str, Any] = {"enabled": True, "on_step": on_step, "report_leaves": report_leaves}
    if config is not None:
        options["config"] = config
    else:
        options.update(
            init_scale=old.get_scale(),  # its init scale: it has scaled no loss yet
            growth_factor=old.get_growth_factor(),
            backoff_factor=old.get_backoff_factor(),
            growth_interval=old.get_growth_interval(),
        )
    device = old._device  # PyTorch's class has no getter for it
    new: GradScaler
    if _is_sharded(old):
        # PyTorch's None is the default group, as it is ours.
        new = ShardedGradScaler(
            device, process_group=getattr(old, "process_group", None), **options
        )
    else:
        new = GradScaler(device, **options)
    accelerator.scaler = new
    return new


def _accelerator(target: Any) -> Any:
    """The ``accelerate.Accelerator`` of ``target`` (itself, or a Trainer's)."""
    accelerate = sys.modules.get("accelerate")
    if accelerate is not None and isinstance(target, accelerate.Accelerator):
        return target
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(target, transformers.Trainer):
        accelerator = getattr(target, "accelerator", None)
        if accelerate is not None and isinstance(accelerator, accelerate.Accelerator):
            return accelerator
        raise InvalidArgumentError(
            f"the Trainer's accelerator is {accelerator!r}, but it must be an "
            f"accelerate.Accelerator (the Trainer builds one in __init__)"
        )
    raise InvalidArgumentError(
        f"target={target!r}, but it must be an accelerate.Accelerator or a transformers.Trainer"
    )


def _scaler_of(accelerator: Any) -> torch.amp.GradScaler:
    """The scaler ``accelerator`` built, once it is known that replacing it is safe."""
    prepared = list(getattr(accelerator, "_optimizers", ()))
    if prepared:
        holding = sum(getattr(opt, "scaler", None) is not None for opt in prepared)
        raise LifecycleError(
            f"prepare() already wrapped {len(prepared)} optimizer(s), {holding} of them "
            f"holding the accelerator's scaler (AcceleratedOptimizer.scaler): a new scaler "
            f"would scale the loss while the old one unscales it and steps, so the update "
            f"would be off by the ratio of their scales; call install() right after "
            f"creating the Accelerator (for a Trainer: before trainer.train())"
        )
    old: torch.amp.GradScaler | None = accelerator.scaler
    if old is None:
        raise InvalidArgumentError(_why_no_scaler(accelerator))
    if isinstance(old, GradScaler):
        raise InvalidArgumentError(
            f"accelerator.scaler is already scaler-core's ({type(old).__qualname__}); "
            f"install() replaces the scaler accelerate built, once"
        )
    if not (type(old) is torch.amp.GradScaler or _is_sharded(old)):
        raise InvalidArgumentError(
            f"accelerate built a {type(old).__module__}.{type(old).__qualname__}, but "
            f"scaler-core replaces torch.amp.GradScaler and PyTorch's FSDP1 "
            f"ShardedGradScaler only"
        )
    if not old.is_enabled():
        raise InvalidArgumentError(
            "accelerate's scaler is disabled (GradScalerKwargs(enabled=False), or a CUDA "
            "scaler without CUDA): there is no loss scaling to replace"
        )
    if old._scale is not None:  # PyTorch's scale tensor, made by the first scale()
        raise LifecycleError(
            f"accelerate's scaler has already scaled a loss (its scale is {old.get_scale()!r}); "
            f"call install() before training starts, right after creating the Accelerator"
        )
    return old


def _why_no_scaler(accelerator: Any) -> str:
    """Why accelerate built no scaler (accelerate 1.16, ``Accelerator.__init__``)."""
    precision = getattr(accelerator, "mixed_precision", None)
    if precision != "fp16":
        return (
            f"accelerate built no scaler: mixed_precision={precision!r}, and loss scaling is "
            f'for float16; use Accelerator(mixed_precision="fp16") '
            f"(TrainingArguments(fp16=True) for a Trainer)"
        )
    kind = str(getattr(accelerator, "distributed_type", ""))
    if kind.endswith(("DEEPSPEED", "MEGATRON_LM")):
        return (
            f"accelerate built no scaler: under {kind.rsplit('.', 1)[-1]} the engine scales "
            f"the loss itself (configure its loss scaling there)"
        )
    device = getattr(getattr(accelerator, "device", None), "type", None)
    if device == "cpu":
        return (
            'accelerate built no scaler: on the CPU it trains mixed_precision="fp16" in '
            "float32, with neither float16 autocast nor a scaler; run on a GPU (or another "
            "accelerator with float16 autocast)"
        )
    return f"accelerate built no scaler (mixed_precision='fp16', device {device!r})"


def _is_sharded(scaler: Any) -> bool:
    """Whether ``scaler`` is PyTorch's own FSDP1 ``ShardedGradScaler``."""
    module = sys.modules.get(_SHARDED)
    return module is not None and type(scaler) is module.ShardedGradScaler
