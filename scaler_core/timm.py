"""timm integration: ``NativeScaler``, a drop-in for ``timm.utils.NativeScaler``.

timm's training script (``train.py``) and its helpers drive the loss scaler through
one object: ``loss_scaler(loss, optimizer, clip_grad=..., clip_mode=..., parameters=...,
need_update=...)`` scales the loss, runs the backward pass and, on an update step,
unscales and clips the gradients (``timm.utils.dispatch_clip_grad``: ``'norm'``,
``'value'`` or ``'agc'``), steps the optimizer and updates the scale;
``CheckpointSaver`` stores ``loss_scaler.state_dict()`` under
``loss_scaler.state_dict_key`` (``"amp_scaler"``) and ``resume_checkpoint`` loads it.

:class:`NativeScaler` *is* timm's class (a subclass: its ``__call__``, clipping and
checkpoint methods are timm's own, run unchanged), with the ``torch.amp.GradScaler``
inside replaced by :class:`scaler_core.torch.GradScaler`. Change one import::

    from scaler_core.timm import NativeScaler  # was: from timm.utils import NativeScaler

With PyTorch's defaults it trains bit for bit as timm's does, and its checkpoints load
into timm's and back. On top:

* ``config=`` takes any :class:`~scaler_core.ScalerConfig` or preset (floors, ceilings,
  hysteresis, skip limits), and the scale fails closed (see
  :class:`scaler_core.torch.GradScaler`);
* :meth:`NativeScaler.stepped` says whether the last call stepped the optimizer, so
  the EMA and the LR schedule can hold on a skipped step (timm's class says nothing:
  its ``train.py`` counts a skipped step as an update);
* ``scaler.scaler`` is the :class:`scaler_core.torch.GradScaler` inside, with its
  ``state`` and skip accounting.

Importing this module imports torch and timm (and, through timm, torchvision).

>>> import torch
>>> import timm.utils
>>> from scaler_core.timm import NativeScaler
>>> scaler = NativeScaler("cpu", init_scale=2.0**10)
>>> w = torch.nn.Parameter(torch.ones(2))
>>> optimizer = torch.optim.SGD([w], lr=0.1)
>>> scaler(w.sum() * float("inf"), optimizer, clip_grad=1.0, parameters=[w])
>>> scaler.stepped(), scaler.scaler.get_scale(), isinstance(scaler, timm.utils.NativeScaler)
(False, 512.0, True)
"""

from __future__ import annotations

from typing import Any

import torch
from timm.utils.cuda import NativeScaler as _TimmNativeScaler

from ._config import ScalerConfig
from ._errors import InvalidArgumentError
from .torch import GradScaler

__all__ = ["NativeScaler"]


class NativeScaler(_TimmNativeScaler):  # type: ignore[misc, unused-ignore]
    """``timm.utils.NativeScaler`` built on :class:`scaler_core.torch.GradScaler`.

    timm's class builds ``torch.amp.GradScaler(device=device)`` with PyTorch's
    defaults; this one builds scaler-core's with the same defaults, or with the
    numbers or the config given here. Everything else is timm's own code:
    ``__call__`` (scale, backward, and with ``need_update`` an optional
    ``unscale_`` and ``dispatch_clip_grad``, then ``step`` and ``update``),
    ``state_dict`` (the inner scaler's), ``load_state_dict`` and
    ``state_dict_key``. A checkpoint timm's class saved loads here (the knobs
    PyTorch has no field for stay this scaler's), and one saved here loads into
    timm's class (PyTorch's scaler ignores the extra ``"scaler_core"`` entry).

    Args:
        device: As timm's: the device type of the scale (``"cuda"``, ``"cpu"``, ...).
            A ``"cuda"`` scaler without CUDA is disabled, with PyTorch's warning, as
            timm's is.
        init_scale: As ``torch.amp.GradScaler``'s (timm's class always uses 2**16).
        growth_factor: As ``torch.amp.GradScaler``'s.
        backoff_factor: As ``torch.amp.GradScaler``'s.
        growth_interval: As ``torch.amp.GradScaler``'s.
        enabled: As ``torch.amp.GradScaler``'s: ``False`` makes it a plain
            backward, clip and step.
        config: A :class:`~scaler_core.ScalerConfig` or preset instead of the four
            numbers (which must then keep their defaults).
        process_group: As :class:`scaler_core.torch.GradScaler`'s: a
            ``torch.distributed`` group whose ranks must skip together.
        on_step: As :class:`scaler_core.torch.GradScaler`'s: called once per
            update with a :class:`~scaler_core.StepReport`.
        report_leaves: As :class:`scaler_core.torch.GradScaler`'s.

    Raises:
        InvalidArgumentError: As :class:`scaler_core.torch.GradScaler` raises it: a
            ``config`` that is no ScalerConfig or comes with the numbers, spike
            skipping, a bad ``on_step`` or ``report_leaves``.
        InvalidConfigError: The numbers make no valid config.

    >>> import scaler_core as sc
    >>> scaler = NativeScaler("cpu", config=sc.preset("megatron"))
    >>> scaler.state_dict_key, scaler.scaler.config == sc.preset("megatron")
    ('amp_scaler', True)
    """

    #: Where timm's ``CheckpointSaver`` puts ``state_dict()`` (and ``resume_checkpoint``
    #: looks for it): timm's key, so checkpoints of either class load into the other.
    state_dict_key = "amp_scaler"

    def __init__(  # noqa: PLR0913 - timm's device, then GradScaler's options as keywords
        self,
        device: str = "cuda",
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        config: ScalerConfig | None = None,
        process_group: Any = None,
        on_step: Any = None,
        report_leaves: bool = False,
    ) -> None:
        # timm's __init__ only builds the inner scaler (PyTorch's); this builds ours
        # in its place, under the attribute name timm's methods use.
        self._scaler: GradScaler = GradScaler(
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
        self._called = False
        self._stepped_optimizer: torch.optim.Optimizer | None = None

    @property
    def scaler(self) -> GradScaler:
        """The :class:`scaler_core.torch.GradScaler` inside (timm's class keeps its
        ``torch.amp.GradScaler`` as ``_scaler``, which this one keeps too)."""
        return self._scaler

    def __call__(  # noqa: PLR0913, PLR0917 - timm's seven arguments, in its order
        self,
        loss: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        clip_grad: float | None = None,
        clip_mode: str = "norm",
        parameters: Any = None,
        create_graph: bool = False,
        need_update: bool = True,
    ) -> None:
        """timm's call, unchanged: backward the scaled loss; with ``need_update``,
        clip (``unscale_`` then ``dispatch_clip_grad``) if ``clip_grad`` is given,
        then ``step`` (skipped if a gradient held inf/NaN) and ``update``.

        Returns None, as timm's does; ask :meth:`stepped` whether the step ran.

        Args:
            loss: The loss, unscaled.
            optimizer: The optimizer to step.
            clip_grad: As timm's: the max norm (``'norm'``), value (``'value'``) or
                clip factor (``'agc'``), or ``None`` for no clipping.
            clip_mode: As timm's: ``'norm'``, ``'value'`` or ``'agc'``.
            parameters: As timm's: the parameters to clip (needed with ``clip_grad``).
            create_graph: As timm's: passed to ``backward``.
            need_update: As timm's: ``False`` for a gradient-accumulation micro-batch
                (backward only, no step).
        """
        self._called, self._stepped_optimizer = False, None
        super().__call__(  # type: ignore[no-untyped-call, unused-ignore]
            loss,
            optimizer,
            clip_grad=clip_grad,
            clip_mode=clip_mode,
            parameters=parameters,
            create_graph=create_graph,
            need_update=need_update,
        )
        self._called = True
        self._stepped_optimizer = optimizer if need_update else None

    def stepped(self) -> bool:
        """Whether the last call ran ``optimizer.step()``: ``False`` when the step was
        skipped (a gradient held inf or NaN) and for a ``need_update=False`` call.

        Gate the EMA update and the LR scheduler's ``step_update`` on it, so that
        both hold on a skipped step. For a fused optimizer (``fused=True``), whose
        skip is decided on the device, it reads the flag to the host.

        Returns:
            True if the optimizer stepped in the last call.

        Raises:
            InvalidArgumentError: No call of this scaler has completed yet.
        """
        if not self._called:
            raise InvalidArgumentError(
                "stepped() was called before any call of this NativeScaler completed; "
                "call scaler(loss, optimizer, ...) first"
            )
        if self._stepped_optimizer is None:
            return False
        return self._scaler.stepped(self._stepped_optimizer)
