"""The drop-in's class: PyTorch's call order and hooks, asking its parts the rest.

:class:`GradScaler` is what a framework sees: ``torch.amp.GradScaler``'s methods,
attributes, errors and per-optimizer records. It keeps none of the rules itself:
the state over its two routes is :class:`~._held.HeldState`'s, an optimizer's
gradients as a step reads them are :class:`~._plan.Plans`', the per-device flags
are combined by :func:`~scaler_core.backends.torch_kernels.any_found`, process
groups are :mod:`._groups`' and the arguments' checks :mod:`._args`'.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any, cast

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from .. import _ops
from .._backend import get_backend
from .._config import ScalerConfig
from .._errors import InvalidArgumentError
from .._lifecycle import StepReport, check_hooks
from .._report import LeafReport, non_finite_leaves
from .._serialize import TORCH_STATE_KEY, load_dict, to_dict
from .._state import ScalerState
from ..backends import torch_kernels as kernels
from . import _args
from ._eager import eager_under_compile
from ._flags import below_one, flag_devices, forbid, output_check, read_any
from ._fused import skip_known, step_fused, takes_grad_scale
from ._groups import (
    DEFAULT_GROUP,
    Group,
    check_shards,
    clip_to_group_norm,
    clip_with_norm_of,
    global_norm,
    world,
)
from ._held import HeldState
from ._plan import Plans

__all__ = ["STATE_KEY", "GradScaler"]

#: The key of ``state_dict()`` holding the whole scaler-core state (PyTorch ignores it).
STATE_KEY = TORCH_STATE_KEY


@eager_under_compile
class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler``, with scaler-core's policies and guarantees.

    Args:
        device: As PyTorch's: the device type of the scale (``"cuda"``, ``"cpu"``, ...).
        init_scale: As PyTorch's (rounded to float32, as PyTorch stores it).
        growth_factor: As PyTorch's; any value above 1 (multiplied in float64 and
            rounded once, as PyTorch does).
        backoff_factor: As PyTorch's; any value in (0, 1).
        growth_interval: As PyTorch's.
        enabled: As PyTorch's: ``False`` makes every method a pass-through.
        config: A :class:`~scaler_core.ScalerConfig` or preset, instead of the four
            numbers above (which must then keep their defaults).
        process_group: A ``torch.distributed`` group whose ranks must skip together:
            each optimizer's found flag is all-reduced (max) over it, once per step.
        on_step: Called once per :meth:`update` with a
            :class:`~scaler_core.StepReport` (the step's kind, scale, flag, and the
            norm from :meth:`unscale_and_clip_`); nothing is read from the device
            to build it. Like ``process_group``, it is not pickled.
        report_leaves: On a step whose gradients hold NaN or inf, find which
            (:func:`scaler_core.non_finite_leaves`, paths ``grads[group][index]``
            in ``optimizer.param_groups`` order) and put them in the report. Costs
            one host read of each optimizer's flag per unscale (for a fused
            optimizer, per ``step``), and one more read of the gradients only on
            such steps.

    Raises:
        InvalidArgumentError: ``config`` is not a ScalerConfig, is given with
            PyTorch's numbers, or has spike skipping on (``spike_threshold``:
            PyTorch's ``step`` decides the skip from the found flags alone).
        InvalidConfigError: The numbers make no valid config (a growth interval
            of 0, an infinite scale).

    >>> import torch
    >>> from scaler_core.torch import GradScaler
    >>> scaler = GradScaler("cpu", init_scale=2.0**10)
    >>> isinstance(scaler, torch.amp.GradScaler), scaler.get_scale()
    (True, 1024.0)
    """

    #: Whether float16 gradients may be unscaled (PyTorch's ``unscale_`` refuses them;
    #: its ``ShardedGradScaler``, for FSDP's low-precision gradients, takes them).
    _ALLOW_FP16 = False
    #: Whether an optimizer with no gradient here still gets a found flag, on the scale's
    #: device (PyTorch's ``ShardedGradScaler``: under FSDP1 with ``use_orig_params=True`` a
    #: rank may hold no shard of an optimizer's parameters; it steps, and joins the flags'
    #: all-reduce, as every other rank does).
    _FLAG_WITHOUT_GRADS = False

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        config: ScalerConfig | None = None,
        process_group: Any = None,
        on_step: Any = None,
        report_leaves: bool = False,
    ) -> None:
        if config is not None:
            given = (init_scale, growth_factor, backoff_factor, growth_interval)
            init_scale, growth_factor, backoff_factor, growth_interval = _args.numbers_of(
                config, given
            )
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        self._process_group = process_group
        check_hooks(on_step, report_leaves)
        self._on_step = on_step
        self._report_leaves = report_leaves
        self._leaves: list[LeafReport] = []
        self._norm: torch.Tensor | None = None
        self._stepped: dict[int, Any] = {}
        self._plans = Plans()
        self._held: HeldState | None = None
        if not self._enabled:  # as PyTorch's: nothing is checked, nothing is held
            return
        if config is None:
            config = ScalerConfig(
                init_scale=_args.as_f32(init_scale),
                growth_factor=_args.as_float(growth_factor),
                backoff_factor=_args.as_float(backoff_factor),
                growth_interval=growth_interval,
            )
        _args.no_spikes(config)
        self._init_scale = config.init_scale
        self._held = HeldState.of(config)

    # ------------------------------------------------------------ what it holds
    @property
    def config(self) -> ScalerConfig:
        """The policy (PyTorch's four numbers, or the config given).

        Raises:
            InvalidArgumentError: The scaler is disabled (``enabled=False``).
        """
        return self._state_held().config

    def _state_held(self) -> HeldState:
        if not self._enabled or self._held is None:
            raise InvalidArgumentError(
                "this GradScaler is disabled (enabled=False): it holds no policy or state"
            )
        return self._held

    @property
    def state(self) -> ScalerState:
        """The current state, read to the host (raises a recorded collapse).

        A synchronisation on an accelerator, as :meth:`get_scale` is.

        Raises:
            InvalidArgumentError: The scaler is disabled.
            ScaleCollapseError: A collapse was recorded on the device.
        """
        held = self._state_held()
        initial = (self._init_scale, self._init_growth_tracker)
        return held.read(self._scale, self._growth_tracker, initial)

    def stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the last ``step(optimizer)`` ran ``optimizer.step()`` (it was not skipped).

        Follow it with the LR scheduler or an EMA update. A host read of the
        flag for a fused optimizer (its skip is decided on the device).

        Raises:
            InvalidArgumentError: ``step(optimizer)`` was never called.
        """
        ran = self._stepped.get(id(optimizer))
        if ran is None:
            raise InvalidArgumentError(
                "stepped(optimizer) was called for an optimizer this scaler never stepped; "
                "call scaler.step(optimizer) first"
            )
        return bool(ran) if isinstance(ran, bool) else not bool(ran.item())

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._state_held().attach(dev)

    # ------------------------------------------------------------ unscale, step
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """As PyTorch's (its errors, its result), with the inverse scale made once per
        value the scale takes (:meth:`HeldState.inverse`)."""
        if not self._enabled:
            return
        scale, optimizer_state = self._ready(optimizer)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        inverse = self._state_held().inverse(scale)
        optimizer_state["found_inf_per_device"] = self._unscale_grads_(
            optimizer, inverse, found_inf, False
        )
        optimizer_state["stage"] = OptState.UNSCALED

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """As PyTorch's (the same grouping, errors and sparse handling), with the rules'
        check of the unscaled values where the scale may be below 1."""
        buckets = self._step(optimizer, allow_fp16 or self._ALLOW_FP16).buckets
        devices = self._flag_devices(buckets, found_inf.device)
        found = {  # the zero flag given serves its own device
            dev: found_inf if dev == found_inf.device else found_inf.to(dev, copy=True)
            for dev in devices
        }
        check = output_check(inv_scale, self._state_held().config.min_scale)
        kernels.unscale_buckets(buckets, inv_scale, found, check)
        self._reduce(found)
        self._look_for_leaves(optimizer, found)
        return found

    def _step(self, optimizer: torch.optim.Optimizer, allow_fp16: bool) -> Any:
        """The optimizer's gradients, checked as PyTorch checks them (see :mod:`._plan`)."""
        return self._plans.of(optimizer, allow_fp16, self._coalesce_half)

    def _look_for_leaves(
        self, optimizer: torch.optim.Optimizer, found: dict[torch.device, torch.Tensor]
    ) -> None:
        """With ``report_leaves``, name the optimizer's non-finite gradients (if any),
        wherever a step's flags are made. A fused optimizer's overflow that only its own
        unscale would make (a scale below 1) names no leaf: the gradients are finite."""
        if self._report_leaves and read_any(found):
            grads = [[p.grad for p in group["params"]] for group in optimizer.param_groups]
            self._leaves.extend(non_finite_leaves(grads, backend=get_backend("torch")))

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """For a fused optimizer, which unscales in its own kernel: check what that
        unscale will meet, one read and nothing written. (PyTorch's checks with a
        dummy inverse of 1, so below a scale of 1 the kernel's overflow goes unseen.)"""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        buckets = self._step(optimizer, True).buckets
        devices = self._flag_devices(buckets, scale.device)
        found = {dev: torch.zeros((), dtype=torch.float32, device=dev) for dev in devices}
        inv = scale.double().reciprocal() if below_one(self.config.min_scale) else None
        kernels.check_for_fused(buckets, inv, found)
        self._reduce(found)
        self._look_for_leaves(optimizer, found)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return cast(dict[str, Any], found)  # PyTorch's annotation; the keys are devices

    @staticmethod
    def _coalesce_half(grad: torch.Tensor) -> torch.Tensor:
        """A sparse float16 gradient coalesced as ``torch.amp.GradScaler`` does: summed in
        float16 (:class:`ShardedGradScaler` sums in float32, as PyTorch's does)."""
        return grad.coalesce()

    def _flag_devices(
        self, buckets: dict[torch.device, Any], scale_device: torch.device
    ) -> list[torch.device]:
        """The devices that get a found flag (:func:`._flags.flag_devices`)."""
        always = self._FLAG_WITHOUT_GRADS or self._group() is not None
        return flag_devices(buckets, scale_device, always)

    def _reduce(self, found: dict[torch.device, torch.Tensor]) -> None:
        """OR into each optimizer's found flags, in place, what forbids its step
        (:func:`._flags.forbid`): every flag a step is decided from passes here."""
        failed = None if self._scale is None else self._state_held().held_failure(self._scale)
        forbid(found, failed, self._group())

    def _group(self) -> Group | None:
        """The process group the ranks' flags and clip norms are combined over, if any."""
        return Group.of(self._process_group)

    def _check_shards(self, params: list[torch.Tensor]) -> None:
        """Refuse, before anything changes, a clip whose norm over the group would be
        wrong: see :meth:`unscale_and_clip_` and :func:`._groups.check_shards`."""
        group = self._group()
        if group is not None:
            check_shards(params, self._check_shard)

    def _check_shard(self, index: int, param: torch.Tensor) -> None:
        """A parameter's gradient may be clipped by the norm over the group: any, for a
        group of ZeRO-style shards (:class:`ShardedGradScaler` checks FSDP's layout)."""

    def _maybe_opt_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        skip = read_any(optimizer_state["found_inf_per_device"])
        self._stepped[id(optimizer)] = not skip
        return None if skip else optimizer.step(*args, **kwargs)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """As PyTorch's: unscale (if not done), then ``optimizer.step()`` unless its
        gradients held inf/NaN; fused optimizers get ``grad_scale`` and ``found_inf``.

        A fused optimizer's step is called on every step, skipped or not, with the
        flag as its ``found_inf``, as PyTorch's calls it on every device (so a framework
        that counts the calls, such as accelerate's ``optimizer_step_was_skipped`` and
        the HF Trainer's LR schedule, sees what it sees with PyTorch's class);
        :meth:`stepped` tells whether it moved anything. The one exception is where
        PyTorch's call leaves a defect (:func:`._fused.skip_known`): a fused SGD with momentum
        skipped before its first step is not called, on the CPU and an accelerator alike.
        """
        if not (self._enabled and takes_grad_scale(optimizer)) or "closure" in kwargs:
            retval = super().step(optimizer, *args, **kwargs)  # PyTorch's, errors included
            if not self._enabled:
                self._stepped[id(optimizer)] = True
            return retval
        scale, _ = self._check_scale_growth_tracker("step")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError(  # PyTorch's error
                "step() has already been called since the last update()."
            )
        if optimizer_state["stage"] is OptState.READY:
            self._check_inf_per_device(optimizer)
            return self._fused_step(optimizer, optimizer_state, scale, *args, **kwargs)
        return self._fused_step(optimizer, optimizer_state, None, *args, **kwargs)

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_state: dict[str, Any],
        divisor: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Step an optimizer that unscales in its own pass (:func:`._fused.step_fused`),
        with the recorded flags as its ``found_inf``, unless the call would leave a
        defect (:func:`._fused.skip_known`)."""
        scale = cast(torch.Tensor, self._scale)
        found = kernels.any_found(optimizer_state["found_inf_per_device"].values(), scale.device)
        retval = None
        if skip_known(optimizer, found):
            self._stepped[id(optimizer)] = False
        else:
            found_inf = found.float()
            retval = step_fused(optimizer, divisor, found_inf, *args, **kwargs)
            self._stepped[id(optimizer)] = found_inf  # decided on the device: read if asked
        optimizer_state["stage"] = OptState.STEPPED
        return retval

    def unscale_and_clip_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        parameters: Any = None,
    ) -> torch.Tensor:
        """``unscale_(optimizer)`` and ``clip_grad_norm_(its params, max_norm, ...)`` in one call.

        Takes ``clip_grad_norm_``'s arguments after ``max_norm`` (``norm_type``,
        ``error_if_nonfinite``, ``foreach``) and, as ``parameters=``, the subset of the
        optimizer's parameters whose gradients to clip (all of them by default). With
        the defaults (the L2 norm over all of them, no error) the call is the fused
        path below; otherwise it is exactly PyTorch's recipe, ``unscale_`` then
        ``clip_grad_norm_`` with these arguments, with PyTorch's results and errors.

        Returns the total norm of the unscaled gradients, as ``clip_grad_norm_`` does,
        and records the optimizer's found flag as ``unscale_`` does (so ``step`` skips
        as usual). On CPU it reads the gradients once and writes them once (clipped
        with ``clip_grad_norm_``'s coefficient; on a skipped step unscaled and not
        clipped, as ``unscale_`` leaves them, which is what every route leaves). On an
        accelerator (and for sparse or DTensor gradients) it is ``unscale_``, the norm
        and one multiply, with no host synchronisation. A sparse gradient is clipped as
        its coalesced sum, and ``param.grad`` then holds the coalesced tensor; under
        FSDP2 the norm is the global one over all shards, the same on every rank.

        With a process group (``process_group=``, and always for
        :class:`ShardedGradScaler`) the norm clipped by is the one over the group,
        the same on every rank, as ``FullyShardedDataParallel.clip_grad_norm_``
        combines its shards' (:func:`._groups.clip_to_group_norm`); what that would
        count twice (DTensor gradients; for :class:`ShardedGradScaler`, parameters
        FSDP does not manage or does not shard over exactly the group's ranks) is
        refused before anything changes, on every rank alike. Other arguments than
        the defaults need PyTorch >= 2.6 with a group (``clip_grads_with_norm_``).

        The norm's squares are summed in float64 and rounded once (within one float32
        ulp of the exact norm; PyTorch's is of the gradients' own dtype, docs/pytorch.md
        "Clipping" gives the measured difference). For the same norm the clipped
        gradients are PyTorch's bit for bit.

        Raises:
            RuntimeError: As ``unscale_``: called twice for the optimizer in a step, or
                after ``step``. As ``clip_grad_norm_``: ``error_if_nonfinite`` and the
                total norm is NaN or inf (the gradients are unscaled by then, as in
                PyTorch's recipe; with a group, on every rank alike).
            InvalidArgumentError: ``max_norm`` is not a positive finite number,
                ``norm_type`` is not a positive number (``inf`` included), a tensor of
                ``parameters`` is not one of the optimizer's, or (with a process group)
                a gradient the norm over the group would count twice; before anything
                changes.
        """
        listed = None if parameters is None else _params_of(optimizer)
        chosen = None if listed is None else _args.subset_of(parameters, listed)
        p_norm = _args.norm_type_of(norm_type)
        clip = (max_norm, p_norm, error_if_nonfinite, foreach)  # clip_grad_norm_'s arguments
        if not self._enabled:
            everyone = _params_of(optimizer) if chosen is None else chosen
            return torch.nn.utils.clip_grad_norm_(everyone, *clip)
        everything = chosen is None or {id(p) for p in chosen} == {id(p) for p in listed or ()}
        if p_norm != _args.L2 or error_if_nonfinite or not everything:
            _ops.max_norm_of(max_norm)  # checked before anything changes, as below
            chosen = _params_of(optimizer) if chosen is None else chosen
            if self._group() is None:
                self.unscale_(optimizer)
                self._norm = torch.nn.utils.clip_grad_norm_(chosen, *clip)
            else:
                self._norm = self._clip_over_group(optimizer, chosen, clip)
            return self._norm
        scale, optimizer_state = self._ready(optimizer)
        step = self._step(optimizer, self._ALLOW_FP16)  # PyTorch's checks, nothing changed
        self._check_shards(step.params)
        grads = [g for g in step.grads if g is not None]
        out, found, norm = _ops.unscale_and_clip(
            cast(Any, get_backend("torch")).skipped_unscaled,
            grads,
            scale,
            max_norm,
            self._decide,
            reduce_norm=self._global_l2,
        )
        if out is not grads:  # a sparse gradient, coalesced: in its parameter's place
            owners = [p for p, g in zip(step.params, step.grads, strict=True) if g is not None]
            for param, grad in zip(owners, out, strict=True):
                if grad is not param.grad:
                    param.grad = grad
        optimizer_state["found_inf_per_device"] = {
            dev: found.to(dev, dtype=torch.float32, non_blocking=True)
            for dev in self._flag_devices(step.buckets, scale.device)
        }
        self._look_for_leaves(optimizer, optimizer_state["found_inf_per_device"])
        optimizer_state["stage"] = OptState.UNSCALED
        self._norm = cast(torch.Tensor, norm)
        return self._norm

    def clip_and_step(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
        *,
        parameters: Any = None,
    ) -> torch.Tensor:
        """``unscale_``, ``clip_grad_norm_`` and ``step`` in one call; returns the norm.

        The LLM recipe (``scaler.unscale_(opt)``, ``clip_grad_norm_(params, max_norm)``,
        ``scaler.step(opt)``) as ``norm = scaler.clip_and_step(opt, max_norm)``, then
        ``scaler.update()`` as usual. It takes :meth:`unscale_and_clip_`'s arguments.

        For an optimizer that unscales in its own pass (``fused=True``, or any with
        ``_step_supports_amp_scaling``), with the default clip (the L2 norm over all
        its parameters, no error), the clip is folded into that pass: the gradients
        are read once for the flag and the norm (on the CPU; twice on an accelerator,
        where PyTorch has no kernel for both) and written by nobody but the
        optimizer, which divides them by ``scale / coef`` (``coef`` being
        ``clip_grad_norm_``'s coefficient) and skips on the flag, as it does inside
        ``step``, with no host synchronisation on an accelerator. One rounding
        replaces two, so the gradient the optimizer uses can differ from the
        recipe's by an ulp, and the parameters after a step by a few (docs/pytorch.md
        gives the measured bound); with nothing clipped and a power-of-two scale it
        is the recipe bit for bit. Afterwards ``.grad`` holds what the optimizer
        used (PyTorch's fused kernels write the unscaled gradient back), unscaled
        and clipped; on a skipped step it keeps its scaled values. With a process
        group the norm is the one over the group, refused where it would count a
        gradient twice, as for :meth:`unscale_and_clip_`.

        Any other optimizer or clip: exactly :meth:`unscale_and_clip_`, then
        :meth:`step` (the gradients are left unscaled and clipped, or unscaled on
        a skipped step, as there). Disabled: ``clip_grad_norm_`` and the step.

        Raises:
            RuntimeError: As :meth:`unscale_and_clip_` (``unscale_`` or ``step`` already
                called for the optimizer in this step).
            InvalidArgumentError: As :meth:`unscale_and_clip_`, before anything changes.
        """
        folds = (
            self._enabled
            and takes_grad_scale(optimizer)
            and parameters is None
            and _args.norm_type_of(norm_type) == _args.L2
            and not error_if_nonfinite
        )
        if not folds:
            norm = self.unscale_and_clip_(
                optimizer, max_norm, norm_type, error_if_nonfinite, foreach, parameters=parameters
            )
            self.step(optimizer)
            return norm
        _ops.max_norm_of(max_norm)  # checked before anything changes
        scale, optimizer_state = self._ready(optimizer)
        step = self._step(optimizer, True)  # as PyTorch's step checks for a fused one
        self._check_shards(step.params)
        found, norm, divisor = _ops.fold_clip(
            get_backend("torch"),
            step.grads,
            scale,
            max_norm,
            self._decide,
            reduce_norm=self._global_l2,
        )
        per_device = {
            dev: found.to(dev, torch.float32, non_blocking=True)
            for dev in self._flag_devices(step.buckets, scale.device)
        }
        optimizer_state["found_inf_per_device"] = per_device
        self._look_for_leaves(optimizer, per_device)
        self._fused_step(optimizer, optimizer_state, divisor)
        self._norm = cast(torch.Tensor, norm)
        return self._norm

    def _ready(self, optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, dict[str, Any]]:
        """The scale and the optimizer's record, refusing (with PyTorch's ``unscale_``
        errors) an optimizer already unscaled or stepped in this step."""
        scale, _ = self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._per_optimizer_states[id(optimizer)]
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError(  # PyTorch's error
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")  # PyTorch's error
        return scale, optimizer_state

    def _global_l2(self, norm: torch.Tensor) -> torch.Tensor:
        """The clip's L2 norm over the process group (see :func:`._groups.global_norm`)."""
        return global_norm(norm, _args.L2, self._group())

    def _clip_over_group(
        self,
        optimizer: torch.optim.Optimizer,
        chosen: list[torch.Tensor],
        clip: tuple[float, float, bool, bool | None],
    ) -> torch.Tensor:
        """PyTorch's recipe (``unscale_``, then the clip with ``clip_grad_norm_``'s
        arguments) by the norm over the process group (:func:`._groups.clip_to_group_norm`)."""
        clip_with_norm = clip_with_norm_of(clip[1], clip[2])
        self._check_shards(_params_of(optimizer))
        self.unscale_(optimizer)
        device = cast(torch.Tensor, self._scale).device
        return clip_to_group_norm(clip_with_norm, chosen, clip, cast(Group, self._group()), device)

    def _decide(self, flag: torch.Tensor) -> torch.Tensor:
        """A measured flag as the step's decision (see :meth:`_reduce`), a bool tensor."""
        found = {flag.device: flag.float()}
        self._reduce(found)
        return found[flag.device] > 0

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The norm this step's :meth:`unscale_and_clip_` or :meth:`clip_and_step` returned:
        ``None`` before either is called in a step, and again after :meth:`update`
        (which hands it to ``on_step``'s report)."""
        return self._norm

    # ------------------------------------------------------------------ update
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As PyTorch's, through scaler-core's transition (every config, fail-closed).

        Without ``new_scale``: the step's found flags (OR-ed over the optimizers) drive
        the config's rules, as PyTorch's kernel drives its own. With ``new_scale`` (what
        PyTorch's takes, and any real number, checked as the float32 scale it would be
        before anything changes; a tensor on an accelerator taken unread): the scale is
        set to it and no rule of the config runs, but a checked step is still counted
        as under a static scale (``steps``, the skip counters, ``last_kind``
        ``STATIC_CLEAN`` or ``STATIC_SKIP``, ``max_consecutive_skips``). Either way
        ``on_step`` gets one report of the step, and its norm and leaves are dropped.

        Raises:
            ScaleCollapseError: (CPU) The step would collapse the scale or hit a floor
                set to raise; the scaler is left as it was, this step's checks kept
                (see :meth:`abandon_step`). On an accelerator the refusal is recorded
                and raised by the next host-side look, and every later ``step`` is
                skipped until :meth:`load_state_dict` loads a checkpoint.
            SkipLimitError: (CPU) More consecutive skips than the config allows.
            InvalidArgumentError: ``new_scale`` is no scale (0, negative, NaN, inf or
                subnormal as a float32, or not a number or tensor), lies outside the
                config's bounds, or differs from a static config's scale.
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        held = self._state_held()
        found_infs = [
            found_inf
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if new_scale is not None:
            value = _args.new_scale_of(  # checked before anything changes
                new_scale, held.config, self._device, kernels.reads_free
            )
            flag = held.step_flag(found_infs, scale)
            new = held.count(
                scale,
                tracker,
                flag,
                bool(found_infs),
                lambda: super(GradScaler, self).update(value),
            )
        else:
            if len(found_infs) == 0:
                message = "No inf checks were recorded prior to update."
                raise AssertionError(message)  # PyTorch's error
            flag = held.step_flag(found_infs, scale)
            new = held.advance(scale, tracker, flag)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        norm, self._norm = self._norm, None
        leaves, self._leaves = tuple(self._leaves), []
        if self._on_step is not None:
            self._on_step(StepReport(new, flag, norm, leaves))

    def abandon_step(self) -> None:
        """Drop this iteration's checks and keep the state: the way out after
        :meth:`update` refused a step (then resume from a checkpoint, or go on)."""
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._leaves, self._norm = [], None

    # ------------------------------------------------------------------- reading
    def get_scale(self) -> float:
        """As PyTorch's; raises a collapse recorded on an accelerator."""
        if self._enabled:
            self._state_held().raise_recorded(self._scale, self._growth_tracker)
        return super().get_scale()

    def set_growth_factor(self, new_factor: float) -> None:
        """As PyTorch's; validated (a factor must stay above 1)."""
        if self._enabled:
            self._state_held().set_config(growth_factor=_args.as_float(new_factor))
        super().set_growth_factor(new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """As PyTorch's; validated (a factor must stay in (0, 1))."""
        if self._enabled:
            self._state_held().set_config(backoff_factor=_args.as_float(new_factor))
        super().set_backoff_factor(new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """As PyTorch's; validated (an interval of at least 1)."""
        if self._enabled:
            self._state_held().set_config(growth_interval=new_interval)
        super().set_growth_interval(new_interval)

    # ------------------------------------------------------------------- saving
    def state_dict(self) -> dict[str, Any]:
        """PyTorch's five entries, and the whole scaler-core state under ``"scaler_core"``."""
        out = super().state_dict()
        if self._enabled:
            out[STATE_KEY] = to_dict(self.state)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict this class or ``torch.amp.GradScaler`` saved, validated first.

        A dict PyTorch saved keeps this scaler's policy knobs beyond PyTorch's
        (floors, hysteresis, ...); one saved by this class restores them all. Where
        both are present **PyTorch's five entries win** (loaded as PyTorch loads them,
        so editing one takes effect here as there, validated against the saved
        config), and the ``"scaler_core"`` payload supplies every other field. An
        unedited dict restores the saved state exactly.

        Raises:
            RuntimeError: The dict is empty (as PyTorch raises).
            InvalidStateError: It is malformed, or an entry is out of range (named by
                its key); nothing is loaded.
            InvalidArgumentError: Its config has spike skipping on (see
                ``spike_threshold``); nothing is loaded.
        """
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(  # PyTorch's error
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        # This class's dict: PyTorch's five entries win, the payload gives the rest;
        # PyTorch's: the other knobs stay this scaler's; a scaler-core checkpoint (the
        # facade's state_dict(), to_dict): its config and state.
        self._apply(load_dict(state_dict, self._state_held().config))

    def _apply(self, state: ScalerState) -> None:
        _args.no_spikes(state.config)
        self._init_scale = state.scale
        self._growth_factor = state.config.growth_factor
        self._backoff_factor = state.config.backoff_factor
        self._growth_interval = state.config.growth_interval
        self._init_growth_tracker = state.growth_tracker
        self._state_held().load(state, self._scale, self._growth_tracker)

    def __getstate__(self) -> dict[str, Any]:
        out = super().__getstate__()
        if self._enabled:
            state = self.state
            out["_held"] = self._state_held().detached(state)
            out["_init_scale"] = state.scale
        if out["_process_group"] is not None and out["_process_group"] is world():
            # The live default group, kept as "the default group" (looked up where the copy
            # is used). Any other group is kept as it is: a deep copy shares it (see
            # __deepcopy__), and pickle refuses it as it refuses PyTorch's (TypeError).
            out["_process_group"] = DEFAULT_GROUP
        out["_stepped"] = {}
        out["_plans"] = Plans()
        out["_on_step"] = None  # a callback may be a closure or lambda: pass it again
        out["_leaves"], out["_norm"] = [], None
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As PyTorch's (a scaler pickled before its state was held apart, too)."""
        super().__setstate__(HeldState.unpickled(state))

    def __deepcopy__(self, memo: dict[int, Any]) -> GradScaler:
        """A copy that combines its flags over the same process group: the group (a live
        communicator, which cannot be copied) is shared; everything else is copied as
        pickling would copy it."""
        state = self.__getstate__()
        group = state["_process_group"]
        if group is not None:
            memo[id(group)] = group
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(state, memo))
        return new


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, in ``param_groups`` order."""
    return [p for group in optimizer.param_groups for p in group["params"]]
