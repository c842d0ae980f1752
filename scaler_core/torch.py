"""PyTorch integration: ``GradScaler``, a drop-in for ``torch.amp.GradScaler``.

Change one import and nothing else: ``from scaler_core.torch import GradScaler``.
It *is* a ``torch.amp.GradScaler`` (a subclass: frameworks that type-check it
accept it), takes the same arguments, has the same methods and attributes, and
trains bit-identically to it with PyTorch's defaults. On top:

* any :class:`~scaler_core.ScalerConfig` or preset, ``GradScaler(config=sc.preset("megatron"))``:
  floors, ceilings, hysteresis, skip limits;
* fail-closed: a backoff that would leave the scale 0 or subnormal raises
  :class:`~scaler_core.ScaleCollapseError` (on an accelerator, it is recorded and
  raised by the next ``get_scale()``, ``state`` or ``state_dict()``, and every step
  is skipped until a checkpoint is loaded), where PyTorch's scale goes silently
  subnormal;
* the overflow an unscale itself makes (a scale below 1) is found, which PyTorch's
  kernel does not check;
* ``scaler.state``: the immutable state with its skip accounting; ``stepped(optimizer)``:
  whether the last ``step`` ran the optimizer (for LR schedulers and EMA);
* ``state_dict()`` carries the whole versioned scaler-core state under one extra
  key that PyTorch ignores; a dict PyTorch saved loads too;
* ``process_group=``: the found flag is OR-ed over ``torch.distributed`` ranks, so
  every rank skips together where ranks check different gradients (ZeRO-style
  shards each rank checks alone; FSDP2's DTensor gradients need no group).

Under ``torch.compile`` its methods run eagerly, as PyTorch's do (see
``_eager_under_compile``). Importing this module imports torch and ``torch._dynamo``
(``import scaler_core`` never does).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import numbers
from collections import defaultdict
from typing import Any, NamedTuple, TypeVar, cast

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from . import _ops
from ._config import ScalerConfig, shown
from ._errors import InvalidArgumentError
from ._f32 import f32, is_normal_f32
from ._lifecycle import StepReport
from ._report import LeafReport, non_finite_leaves
from ._serialize import TORCH_STATE_KEY, load_dict, to_dict
from ._state import DATA_FIELDS, FLOAT_FIELDS, ScalerState, host_update, init
from .backends import _torch as _torch_backend
from .backends._torch import BACKEND as _TORCH
from .backends._torch import UNSCALED_ON_SKIP as _TORCH_UNSCALED_ON_SKIP
from .backends._torch import check_for_fused, unscale_buckets

__all__ = ["GradScaler", "ShardedGradScaler"]

#: The state fields beyond PyTorch's two tensors (``_scale``, ``_growth_tracker``).
_EXTRA = tuple(name for name in DATA_FIELDS if name not in ("scale", "growth_tracker"))
#: The key of ``state_dict()`` holding the whole scaler-core state (PyTorch ignores it).
STATE_KEY = TORCH_STATE_KEY
_TORCH_DEFAULTS = (2.0**16, 2.0, 0.5, 2000)
_T = TypeVar("_T")


class _DefaultGroup:
    """The default process group, looked up each time it is used (``dist.group.WORLD``
    once it exists). It pickles by name, so a copied or unpickled scaler still ORs its
    flags over the default group of the process it lands in."""

    def __repr__(self) -> str:
        return "WORLD"

    def __reduce__(self) -> str:
        return "_DEFAULT_GROUP"


_DEFAULT_GROUP = _DefaultGroup()


class _Group(NamedTuple):
    """A process group to combine over, as ``torch.distributed`` takes it (``handle``
    ``None``: the default group)."""

    handle: Any


def _world() -> Any:
    """``dist.group.WORLD`` if a default group exists, else ``None`` (no group to be)."""
    import torch.distributed as dist  # noqa: PLC0415 - only data-parallel users need it

    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _no_spikes(config: ScalerConfig) -> None:
    """Refuse spike skipping: PyTorch's ``step`` decides the skip before any norm is known."""
    if config.spike_threshold is not None:
        raise InvalidArgumentError(
            f"spike_threshold={config.spike_threshold!r}, but scaler_core.torch.GradScaler "
            f"does not do spike skipping (torch.amp.GradScaler's step() decides the skip from "
            f"the found flags alone); use spike_threshold=None here, or the functional API "
            f"(scaler_core.update(state, found, grad_norm=...))"
        )


def _eager_under_compile(cls: type[_T]) -> type[_T]:
    """Run the methods of ``cls`` eagerly inside ``torch.compile``, as PyTorch's own do.

    Dynamo never traces ``torch.amp.GradScaler``: ``torch/`` is one of its skipped
    directories (``torch._dynamo.trace_rules``), so a compiled step breaks the graph at
    each of its calls and runs it as plain Python. A third-party class is traced
    instead, and tracing this one went wrong: a host read (``.item()``) broke the
    graph where PyTorch's does not, and state kept on ``self`` between calls (the
    per-optimizer record ``unscale_and_clip_`` leaves for ``step``) was lost, so a
    compiled step unscaled clipped gradients twice. Making the scaler traceable would
    fight Dynamo over every host read and dict of state for no gain, since PyTorch's
    class is not in the graph either; so every method that user code or PyTorch's
    own (skipped) code calls, that is every public one and every override of
    PyTorch's, is wrapped in ``torch.compiler.disable``: the graph breaks at the call
    as it does for PyTorch's class, and the call, with everything it calls (the
    optimizer's ``step``, an ``on_step`` callback), runs eagerly. Helpers only these
    methods call need no wrapper. ``torch.compiler.disable`` imports
    ``torch._dynamo``, which ``torch.optim`` imports anyway.
    """

    def eager(fn: Any) -> Any:
        return torch.compiler.disable(fn)  # type: ignore[no-untyped-call, unused-ignore]

    for name, value in list(vars(cls).items()):
        if name.startswith("_") and not hasattr(torch.amp.GradScaler, name):
            continue  # a helper of this class: only reached from the wrapped methods
        if isinstance(value, property):
            wrapped: Any = property(eager(value.fget), value.fset, value.fdel, value.__doc__)
        elif isinstance(value, staticmethod):
            wrapped = staticmethod(eager(value.__func__))
        elif inspect.isfunction(value):
            wrapped = eager(value)
        else:
            continue
        setattr(cls, name, wrapped)
    return cls


@_eager_under_compile
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
            if not isinstance(config, ScalerConfig):
                raise InvalidArgumentError(
                    f"config={config!r}, but it must be a ScalerConfig (or a preset's)"
                )
            given = (init_scale, growth_factor, backoff_factor, growth_interval)
            if given != _TORCH_DEFAULTS:
                raise InvalidArgumentError(
                    "config= was given with init_scale, growth_factor, backoff_factor or "
                    "growth_interval; pass the numbers in the config only"
                )
            init_scale, growth_factor = config.init_scale, config.growth_factor
            backoff_factor, growth_interval = config.backoff_factor, config.growth_interval
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        self._process_group = process_group
        if on_step is not None and not callable(on_step):
            raise InvalidArgumentError(
                f"on_step={on_step!r}, but it must be a callable taking a StepReport (or None)"
            )
        if not isinstance(report_leaves, bool):
            raise InvalidArgumentError(f"report_leaves={report_leaves!r}, but it must be a bool")
        self._on_step = on_step
        self._report_leaves = report_leaves
        self._leaves: list[LeafReport] = []
        self._norm: torch.Tensor | None = None
        self._mirror: ScalerState | None = None  # a CPU scaler's state at its last update
        self._stepped: dict[int, Any] = {}
        self._extra: dict[str, torch.Tensor] | None = None
        self._config: ScalerConfig | None = config
        if not self._enabled:  # as PyTorch's: nothing is checked, nothing is held
            return
        if config is None:
            config = ScalerConfig(
                init_scale=_f32(init_scale),
                growth_factor=_float(growth_factor),
                backoff_factor=_float(backoff_factor),
                growth_interval=growth_interval,
            )
        _no_spikes(config)
        self._config = config
        self._init_scale = config.init_scale
        self._start = init(config)

    # ------------------------------------------------------------ what it holds
    @property
    def config(self) -> ScalerConfig:
        """The policy (PyTorch's four numbers, or the config given).

        Raises:
            InvalidArgumentError: The scaler is disabled (``enabled=False``).
        """
        return self._enabled_config()

    def _enabled_config(self) -> ScalerConfig:
        if not self._enabled or self._config is None:
            raise InvalidArgumentError(
                "this GradScaler is disabled (enabled=False): it holds no policy or state"
            )
        return self._config

    @property
    def state(self) -> ScalerState:
        """The current state, read to the host (raises a recorded collapse).

        A synchronisation on an accelerator, as :meth:`get_scale` is.

        Raises:
            InvalidArgumentError: The scaler is disabled.
            ScaleCollapseError: A collapse was recorded on the device.
        """
        self._enabled_config()
        if self._scale is None or self._extra is None:
            return dataclasses.replace(
                self._start, scale=f32(self._init_scale), growth_tracker=self._init_growth_tracker
            )
        return self._device_state().to_host()

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

    def _device_state(self) -> ScalerState:
        """The state as it lives: 0-d tensors on the scale's device (after lazy init)."""
        extra = cast(dict[str, torch.Tensor], self._extra)
        return ScalerState(self._enabled_config(), self._scale, self._growth_tracker, **extra)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._extra = {
            name: torch.full(
                (),
                getattr(self._start, name),
                dtype=torch.float32 if name in FLOAT_FIELDS else torch.int32,
                device=dev,
            )
            for name in _EXTRA
        }

    # ------------------------------------------------------------ unscale, step
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """As PyTorch's (the same grouping, errors and sparse handling), with the rules'
        check of the unscaled values where the scale may be below 1."""
        buckets = self._buckets(optimizer, allow_fp16 or self._ALLOW_FP16)
        devices = self._flag_devices(buckets, found_inf.device)
        found = {dev: found_inf.to(dev, copy=True, non_blocking=True) for dev in devices}
        unscale_buckets(buckets, inv_scale, found, self._check_outputs(inv_scale))
        self._reduce(found)
        self._look_for_leaves(optimizer, found)
        return found

    def _look_for_leaves(
        self, optimizer: torch.optim.Optimizer, found: dict[torch.device, torch.Tensor]
    ) -> None:
        """With ``report_leaves``, name the optimizer's non-finite gradients (if any).

        Called wherever a step's flags are made: ``_unscale_grads_`` (``unscale_``,
        and ``step`` for other optimizers), ``_check_inf_per_device`` (``step`` with a
        fused optimizer, which unscales in its own kernel) and ``unscale_and_clip_``.
        A fused optimizer's overflow that only its own unscale would make (a scale
        below 1) is flagged but names no leaf: the gradients themselves are finite.
        """
        if not self._report_leaves or not any(bool(f.item()) for f in found.values()):
            return
        grads = [[p.grad for p in group["params"]] for group in optimizer.param_groups]
        self._leaves.extend(non_finite_leaves(grads, backend=_TORCH))

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """For a fused optimizer, which unscales in its own kernel: check what that
        unscale will meet, one read and nothing written. (PyTorch's checks with a
        dummy inverse of 1, so below a scale of 1 the kernel's overflow goes unseen.)"""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        buckets = self._buckets(optimizer, True)
        devices = self._flag_devices(buckets, scale.device)
        found = {dev: torch.zeros((), dtype=torch.float32, device=dev) for dev in devices}
        inv = scale.double().reciprocal() if self._may_fall_below_one() else None
        check_for_fused(buckets, inv, found)
        self._reduce(found)
        self._look_for_leaves(optimizer, found)
        self._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
        return cast(dict[str, Any], found)  # PyTorch's annotation; the keys are devices

    @staticmethod
    def _coalesce_half(grad: torch.Tensor) -> torch.Tensor:
        """A sparse float16 gradient coalesced as ``torch.amp.GradScaler`` does: summed in
        float16 (:class:`ShardedGradScaler` sums in float32, as PyTorch's does)."""
        return grad.coalesce()

    def _buckets(
        self, optimizer: torch.optim.Optimizer, allow_fp16: bool
    ) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
        """The optimizer's gradients (a sparse one's values) by device and dtype, checked
        as PyTorch checks them; a sparse float16 gradient is coalesced first
        (:meth:`_coalesce_half`)."""
        buckets: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list)
        )
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if not isinstance(param, torch.Tensor):
                        raise AssertionError(  # PyTorch's error
                            f"expected param to be torch.Tensor, got {type(param).__name__}"
                        )
                    grad = param.grad
                    if grad is None:
                        continue
                    if (not allow_fp16) and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")  # PyTorch's error
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:
                            param.grad = grad = self._coalesce_half(grad)
                        grad = grad._values()
                    buckets[grad.device][grad.dtype].append(grad)
        return buckets

    def _flag_devices(
        self, buckets: dict[torch.device, Any], scale_device: torch.device
    ) -> list[torch.device]:
        """The devices that get a found flag: the gradients', or the scale's when the
        optimizer has no gradient here and a flag is still due: with a process group
        (this rank must join every exchange the others make, in the same order) or
        ``_FLAG_WITHOUT_GRADS``."""
        if buckets or not (self._FLAG_WITHOUT_GRADS or self._group() is not None):
            return list(buckets)
        return [scale_device]

    def _check_outputs(self, inv_scale: torch.Tensor) -> bool | None:
        """Whether the unscaled values need their own check (the scale may be below 1)."""
        if not self._may_fall_below_one():
            return False
        if _torch_backend.reads_free(inv_scale.device):
            return bool(inv_scale.item() > 1.0)
        return None  # decided on the device, without a synchronisation

    def _may_fall_below_one(self) -> bool:
        floor = self._enabled_config().min_scale
        return floor is None or floor < 1.0

    def _reduce(self, found: dict[torch.device, torch.Tensor]) -> None:
        """OR into each optimizer's found flags, in place, what forbids its step.

        Every flag a step is decided from passes here (``unscale_``, a fused
        optimizer's check, ``unscale_and_clip_``). On the device route, a failure
        recorded by an earlier ``update`` (a collapse that could not raise there):
        after it no step may move a parameter until the user deals with it (loads a
        checkpoint); ORed on the device, with no synchronisation. Then the flags of
        the other ranks of the process group: exactly one all-reduce (max) per call,
        whatever this rank holds (every rank's call gets a flag, see
        :meth:`_flag_devices`), so the ranks' exchanges pair up in order.
        """
        if self._scale is not None and not self._host_route():
            failed = cast(dict[str, torch.Tensor], self._extra)["failure"] != 0
            for device, flag in found.items():
                held = failed.to(device, dtype=flag.dtype, non_blocking=True)
                torch.maximum(flag, held, out=flag)
        group = self._group()
        if group is None:
            return
        import torch.distributed as dist  # noqa: PLC0415 - only data-parallel users need it

        flags = list(found.values())
        if len(flags) == 1:
            dist.all_reduce(flags[0], op=dist.ReduceOp.MAX, group=group.handle)
            return
        home = flags[0].device
        one = torch.stack([f.to(home, torch.float32, non_blocking=True) for f in flags]).amax()
        dist.all_reduce(one, op=dist.ReduceOp.MAX, group=group.handle)
        for flag in flags:
            flag.copy_(one.to(flag.device, non_blocking=True))

    def _group(self) -> _Group | None:
        """The process group the ranks' flags and clip norms are combined over, if any."""
        given = self._process_group
        if given is None:
            return None
        return _Group(None if given is _DEFAULT_GROUP else given)

    def _global_norm(self, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        """``norm`` (of this rank's gradients) as the norm over every rank's, the same on
        each: their maximum for ``inf``, else ``(sum of norm**p) ** (1/p)``, as
        ``FullyShardedDataParallel.clip_grad_norm_`` combines its shards' (the powers
        summed in float64). Unchanged without a process group."""
        group = self._group()
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

    def _check_shards(self, params: list[torch.Tensor]) -> None:
        """Refuse, before anything changes, a clip whose norm over the group would be
        wrong: see :meth:`unscale_and_clip_`. Every rank runs the same checks on the
        same parameters, so they refuse alike (none is left waiting in a collective)."""
        if self._group() is None:
            return
        dtensor = _torch_backend.dtensor_type()
        for i, param in enumerate(params):
            if dtensor is not None and isinstance(param.grad, dtensor):
                raise InvalidArgumentError(
                    f"parameter {i} has a DTensor gradient (FSDP2), whose norm is global over "
                    f"its mesh already, but this scaler's process_group would sum it over the "
                    f"ranks again; build the scaler without process_group under FSDP2 (its "
                    f"DTensor gradients combine the flags and norms themselves)"
                )
            self._check_shard(i, param)

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
        skip = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
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
        PyTorch's call leaves a defect (:meth:`_skip_known`): a fused SGD with momentum
        skipped before its first step is not called, on the CPU and an accelerator alike.
        """
        if not (self._enabled and _takes_grad_scale(optimizer)) or "closure" in kwargs:
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
        """Step an optimizer that unscales in its own pass: ``divisor`` (times a
        ``grad_scale`` the user set, as PyTorch's step multiplies it in) as its
        ``grad_scale`` (``None``: the gradients are unscaled already), the recorded flags
        as its ``found_inf`` (1.0 or 0.0: its kernels skip only on 1.0), unless the call
        would leave a defect (:meth:`_skip_known`)."""
        scale = cast(torch.Tensor, self._scale)
        flags = [
            f.to(scale.device, non_blocking=True)
            for f in optimizer_state["found_inf_per_device"].values()
        ]
        found = (
            torch.stack(flags).amax() > 0
            if flags
            else torch.zeros((), dtype=torch.bool, device=scale.device)
        )
        found_inf = found.float()
        retval = None
        if self._skip_known(optimizer, found):
            self._stepped[id(optimizer)] = False
        else:
            given = getattr(optimizer, "grad_scale", None)
            if divisor is not None:  # a new tensor, as PyTorch's: the scale changes in update
                divisor = divisor * (1 if given is None else given)
            optimizer.grad_scale = given if divisor is None else divisor  # type: ignore[attr-defined]
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
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
        :class:`ShardedGradScaler`) each rank's optimizer holds its own shard of the
        gradients, so the norm clipped by is the one over the group, the same on every
        rank: each rank's norm ``n_r`` combined as ``(sum of n_r**p) ** (1/p)`` (the
        largest for ``inf``), as ``FullyShardedDataParallel.clip_grad_norm_`` combines
        its shards', with one more all-reduce. Refused before anything changes where
        that would count a gradient twice: DTensor gradients (FSDP2 combines them
        itself: build the scaler without a group), and, for
        :class:`ShardedGradScaler`, a parameter FSDP does not manage or a flat
        parameter not sharded over exactly the group's ranks (``NO_SHARD``,
        ``HYBRID_SHARD``: use the FSDP module's own ``clip_grad_norm_``). Every rank
        checks the same parameters, so they refuse alike. Other arguments than the
        defaults need PyTorch >= 2.6 with a group (``clip_grads_with_norm_``).

        The norm's squares are summed in float64 and rounded once (within one float32
        ulp of the exact norm); ``clip_grad_norm_`` takes each tensor's norm in the
        gradients' own dtype. For float32 gradients the two were measured within
        about one float32 ulp of each other (on the CPU); for bfloat16 or float16
        gradients PyTorch's norm is itself a half-precision number (off by up to
        2.5e-3, relative), and its clip coefficient with it. For the same norm the
        clipped gradients are PyTorch's bit for bit.

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
        params = [p for group in optimizer.param_groups for p in group["params"]]
        chosen = params if parameters is None else _subset(parameters, params)
        p_norm = _norm_type(norm_type)
        if not self._enabled:
            return torch.nn.utils.clip_grad_norm_(
                chosen, max_norm, p_norm, error_if_nonfinite, foreach
            )
        everything = parameters is None or {id(p) for p in chosen} == {id(p) for p in params}
        if p_norm != _L2 or error_if_nonfinite or not everything:
            _ops.max_norm_of(max_norm)  # checked before anything changes, as below
            if self._group() is None:
                self.unscale_(optimizer)
                self._norm = torch.nn.utils.clip_grad_norm_(
                    chosen, max_norm, p_norm, error_if_nonfinite, foreach
                )
                return self._norm
            self._norm = self._clip_over_group(
                optimizer, chosen, max_norm, p_norm, error_if_nonfinite, foreach
            )
            return self._norm
        _scale, optimizer_state = self._ready(optimizer)
        buckets = self._buckets(optimizer, self._ALLOW_FP16)  # PyTorch's checks, nothing changed
        self._check_shards(params)
        owners = [p for p in params if p.grad is not None]
        grads = [p.grad for p in owners]
        grads, found, norm = _ops.unscale_and_clip(
            _TORCH_UNSCALED_ON_SKIP,
            grads,
            _scale,
            max_norm,
            self._decide,
            reduce_norm=self._global_l2,
        )
        for param, grad in zip(owners, grads, strict=True):
            if grad is not param.grad:  # a sparse gradient, coalesced
                param.grad = grad
        optimizer_state["found_inf_per_device"] = {
            dev: found.to(dev, dtype=torch.float32, non_blocking=True)
            for dev in self._flag_devices(buckets, _scale.device)
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
            and _takes_grad_scale(optimizer)
            and parameters is None
            and _norm_type(norm_type) == _L2
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
        buckets = self._buckets(optimizer, True)  # as PyTorch's step checks for a fused one
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._check_shards(params)
        grads = [p.grad for p in params]
        found, norm, divisor = _ops.fold_clip(
            _TORCH, grads, scale, max_norm, self._decide, reduce_norm=self._global_l2
        )
        per_device = {
            dev: found.to(dev, torch.float32, non_blocking=True)
            for dev in self._flag_devices(buckets, scale.device)
        }
        optimizer_state["found_inf_per_device"] = per_device
        self._look_for_leaves(optimizer, per_device)
        self._fused_step(optimizer, optimizer_state, divisor)
        self._norm = cast(torch.Tensor, norm)
        return self._norm

    def _skip_known(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> bool:
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
        """The clip's L2 norm over the process group (see :meth:`_global_norm`)."""
        return self._global_norm(norm, _L2)

    def _clip_over_group(
        self,
        optimizer: torch.optim.Optimizer,
        chosen: list[torch.Tensor],
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
        foreach: bool | None,
    ) -> torch.Tensor:
        """PyTorch's recipe (``unscale_``, then the clip) with the norm over the process
        group, as ``FullyShardedDataParallel.clip_grad_norm_`` forms it: every rank's
        norm of its gradients combined (:meth:`_global_norm`), the same on each rank,
        then ``clip_grads_with_norm_``; ``error_if_nonfinite`` tested on that norm, so
        every rank raises alike."""
        clip_with_norm = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
        if clip_with_norm is None:  # PyTorch < 2.6
            raise InvalidArgumentError(
                f"norm_type={norm_type!r}, error_if_nonfinite={error_if_nonfinite!r} or "
                f"parameters= with a process group needs torch.nn.utils.clip_grads_with_norm_ "
                f"(PyTorch >= 2.6; this is {torch.__version__}); use the defaults (the L2 "
                f"norm over all parameters), or upgrade PyTorch"
            )
        self._check_shards([p for group in optimizer.param_groups for p in group["params"]])
        self.unscale_(optimizer)
        grads = [p.grad for p in chosen if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
        total = self._global_norm(local.to(self._scale.device), norm_type)  # type: ignore[union-attr]
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(  # PyTorch's error (clip_grad_norm_)
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                f"non-finite, so it cannot be clipped. To disable this error and scale the "
                f"gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        clip_with_norm(chosen, max_norm, total, foreach)
        return total

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
        the config's rules, as PyTorch's kernel drives its own. With ``new_scale``: the
        scale is set to it and no rule of the config runs (PyTorch's growth tracker
        stays, and so do the hysteresis tracker and the spike statistics); a step that
        was checked is still counted (``steps``, ``skipped_steps``,
        ``consecutive_skips``; ``last_kind`` is ``STATIC_CLEAN`` or ``STATIC_SKIP``, as
        for a static scale, which is what a loop passing its scale each step runs),
        and ``max_consecutive_skips`` still applies. It takes what
        PyTorch's takes (a float; a one-element tensor of any dtype on the scaler's
        device type, without grad), and any other real number (an ``int``, a NumPy
        float32), checked as the float32 value the scale would hold before anything
        changes. A tensor on an accelerator is taken unread, as PyTorch takes it (a
        read would synchronise). Either way ``on_step`` gets one report of the step,
        and the step's norm and leaves are dropped.

        Raises:
            ScaleCollapseError: (CPU) The step would collapse the scale or hit a floor
                set to raise; the scaler is left as it was, this step's checks kept
                (see :meth:`abandon_step`). On an accelerator the refusal is recorded
                and raised by the next host-side look, and every later ``step`` is
                skipped (no parameter moves) until :meth:`load_state_dict` loads a
                checkpoint.
            SkipLimitError: (CPU) More consecutive skips than the config allows.
            InvalidArgumentError: ``new_scale`` is no scale (not a real number or a
                tensor; 0, negative, NaN, inf or subnormal as a float32), lies outside
                the config's ``[min_scale, max_scale]``, or differs from a static
                config's scale; nothing has changed.
        """
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        found_infs = [
            found_inf
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if new_scale is not None:
            value = self._new_scale(new_scale)  # checked before anything changes
            flag = self._step_flag(found_infs, _scale)
            if self._host_route():
                current = self._host_state()
                # The step is counted (a skip limit may refuse it) before anything changes.
                counted = host_update(_counting(current), flag) if found_infs else current
                super().update(value)
                new = dataclasses.replace(
                    counted, config=current.config, scale=cast(float, _scale.item())
                )
                self._write(current, new, skip=("scale",))
                self._mirror = new
            else:
                if found_infs:  # counted on the device; a refused step is recorded there
                    counted = _TORCH.update(_counting(self._device_state()), flag)
                    for name in DATA_FIELDS:
                        if name != "scale":
                            self._field(name).copy_(getattr(counted, name))
                super().update(value)
                new = self._device_state()
            self._end_step(new, flag)
            return
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")  # PyTorch's error
        flag = self._step_flag(found_infs, _scale)
        if self._host_route():  # host values cost nothing to read here
            current = self._host_state()
            new = host_update(current, flag)
            self._write(current, new)
            self._mirror = new
        else:
            new = _TORCH.update(self._device_state(), flag)  # the core's, on the scale's device
            for name in DATA_FIELDS:
                self._field(name).copy_(getattr(new, name))
        self._end_step(new, flag)

    def _write(self, old: ScalerState, new: ScalerState, skip: tuple[str, ...] = ()) -> None:
        """Fill the tensors of the fields (but ``skip``) whose value changed from ``old``."""
        for name in DATA_FIELDS:
            value = getattr(new, name)
            if name not in skip and value != getattr(old, name):
                self._field(name).fill_(value)

    def _host_route(self) -> bool:
        """Whether the scale lives on the CPU, where its values are read and the rules
        run on the host (raising on a failing step); elsewhere they run on the device
        and a failure is recorded there. The one place the route is decided."""
        return _torch_backend.reads_free(cast(torch.Tensor, self._scale).device)

    def _step_flag(self, found_infs: list[torch.Tensor], scale: torch.Tensor) -> Any:
        """The step's found flag: a bool on the host route, a device bool otherwise."""
        if self._host_route():
            return any(bool(f.item()) for f in found_infs)
        if not found_infs:
            return torch.zeros((), dtype=torch.bool, device=scale.device)
        return torch.stack([f.to(scale.device, non_blocking=True) for f in found_infs]).sum() > 0

    def _end_step(self, new: ScalerState, flag: Any) -> None:
        """Clear the step's records (as PyTorch does) and report it once."""
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        norm, self._norm = self._norm, None
        leaves, self._leaves = tuple(self._leaves), []
        if self._on_step is not None:
            self._on_step(StepReport(new, flag, norm, leaves))

    def _host_state(self) -> ScalerState:
        """The state of a CPU scaler: the copy kept at the last update, while the two
        tensors PyTorch exposes (``_scale``, ``_growth_tracker``) still hold its values
        (code that writes them directly is seen), else read from the tensors. The
        config is always the current one: a setter called since then has changed it."""
        mirror = self._mirror
        scale, tracker = cast(torch.Tensor, self._scale), cast(torch.Tensor, self._growth_tracker)
        if (
            mirror is not None
            and scale.item() == mirror.scale
            and tracker.item() == mirror.growth_tracker
        ):
            config = self._enabled_config()
            return mirror if mirror.config is config else dataclasses.replace(mirror, config=config)
        return self._device_state().to_host()

    def _new_scale(self, new_scale: object) -> float | torch.Tensor:
        """``new_scale`` checked as far as the host can see it, as what to fill the scale
        with: PyTorch's checks of a tensor first (its messages), then the float32 value
        the scale would hold, against every scale's rule and the config's bounds."""
        if isinstance(new_scale, torch.Tensor):
            reason = (
                "new_scale should be a float or a 1-element torch.cuda.FloatTensor or "
                "torch.FloatTensor with requires_grad=False."
            )
            if new_scale.device.type != self._device:
                raise AssertionError(reason)  # PyTorch's error
            if new_scale.numel() != 1:
                raise AssertionError(reason)  # PyTorch's error
            if new_scale.requires_grad is True:
                raise AssertionError(reason)  # PyTorch's error
            if not _torch_backend.reads_free(new_scale.device):
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
        config = self._enabled_config()
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

    def _field(self, name: str) -> torch.Tensor:
        if name == "scale":
            return self._scale  # type: ignore[return-value]
        if name == "growth_tracker":
            return self._growth_tracker  # type: ignore[return-value]
        return self._extra[name]  # type: ignore[index]

    def abandon_step(self) -> None:
        """Drop this iteration's checks and keep the state: the way out after
        :meth:`update` refused a step (then resume from a checkpoint, or go on)."""
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
        self._leaves, self._norm = [], None

    # ------------------------------------------------------------------- reading
    def get_scale(self) -> float:
        """As PyTorch's; raises a collapse recorded on an accelerator."""
        extra = self._extra
        if self._enabled and self._scale is not None and extra and int(extra["failure"].item()):
            self._device_state().check()  # raises the recorded error
        return super().get_scale()

    def set_growth_factor(self, new_factor: float) -> None:
        """As PyTorch's; validated (a factor must stay above 1)."""
        if self._enabled:
            self._set_config(growth_factor=_float(new_factor))
        super().set_growth_factor(new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """As PyTorch's; validated (a factor must stay in (0, 1))."""
        if self._enabled:
            self._set_config(backoff_factor=_float(new_factor))
        super().set_backoff_factor(new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """As PyTorch's; validated (an interval of at least 1)."""
        if self._enabled:
            self._set_config(growth_interval=new_interval)
        super().set_growth_interval(new_interval)

    def _set_config(self, **fields: Any) -> None:
        self._config = dataclasses.replace(self._enabled_config(), **fields)
        self._start = dataclasses.replace(self._start, config=self._config)

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
        (floors, hysteresis, ...); one saved by this class restores them all. The
        rule where both are present: **PyTorch's five entries win**. ``scale``,
        ``growth_factor``, ``backoff_factor``, ``growth_interval`` and
        ``_growth_tracker`` are loaded as PyTorch's class loads them (so editing one
        takes effect here as there), validated against the saved config (its bounds,
        a static scale); the ``"scaler_core"`` payload supplies every other field
        (the config's other knobs, hysteresis, skip counters). An unedited dict
        restores the saved state exactly.

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
        self._apply(load_dict(state_dict, self._enabled_config()))

    def _apply(self, state: ScalerState) -> None:
        _no_spikes(state.config)
        self._config = state.config
        self._start = state
        self._init_scale = state.scale
        self._growth_factor = state.config.growth_factor
        self._backoff_factor = state.config.backoff_factor
        self._growth_interval = state.config.growth_interval
        self._init_growth_tracker = state.growth_tracker
        self._mirror = None
        if self._scale is not None and self._extra is not None:
            for name in DATA_FIELDS:
                self._field(name).fill_(getattr(state, name))

    def __getstate__(self) -> dict[str, Any]:
        out = super().__getstate__()
        if self._enabled:
            out["_start"] = self.state
            out["_init_scale"] = out["_start"].scale
            out["_extra"] = None
        out["_mirror"] = None
        if out["_process_group"] is not None and out["_process_group"] is _world():
            # The live default group, kept as "the default group" (looked up where the copy
            # is used). Any other group is kept as it is: a deep copy shares it (see
            # __deepcopy__), and pickle refuses it as it refuses PyTorch's (TypeError).
            out["_process_group"] = _DEFAULT_GROUP
        out["_stepped"] = {}
        out["_on_step"] = None  # a callback may be a closure or lambda: pass it again
        out["_leaves"], out["_norm"] = [], None
        return out

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
        return _world() if given is _DEFAULT_GROUP else given

    @process_group.setter
    def process_group(self, group: Any) -> None:
        self._process_group = group

    def _group(self) -> _Group:
        given = self._process_group
        return _Group(None if given is None or given is _DEFAULT_GROUP else given)

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


def _float(value: Any) -> Any:
    """``float(value)``, or ``value`` itself where no float holds it (an int past float's
    range): then the config's check names it, rather than a raw ``OverflowError``."""
    try:
        return float(value)
    except OverflowError:
        return value


def _f32(value: Any) -> Any:
    """``value`` rounded to float32, as PyTorch stores a scale (see :func:`_float`)."""
    wide = _float(value)
    return f32(wide) if isinstance(wide, float) else wide


def _counting(state: ScalerState) -> ScalerState:
    """``state`` under its config made static: its transition counts a step (``steps``,
    ``skipped_steps``, ``consecutive_skips``, ``last_kind``, the skip limit) and changes
    nothing else. What ``update(new_scale)`` applies, since the scale is set by hand."""
    return dataclasses.replace(state, config=dataclasses.replace(state.config, dynamic=False))


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


def _takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` unscales in its own pass, taking ``grad_scale`` and
    ``found_inf`` as attributes (not the deprecated ``grad_scaler`` keyword)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and (
        "grad_scaler" not in inspect.signature(optimizer.step).parameters
    )


#: The norm the fused path computes (``clip_grad_norm_``'s default ``norm_type``).
_L2 = 2.0


def _norm_type(norm_type: Any) -> float:
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


def _subset(parameters: Any, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parameters`` (a tensor or an iterable of them) as a list, each one of the
    optimizer's ``params`` (another's gradient would be clipped while still scaled).

    Raises:
        InvalidArgumentError: A tensor is not one of the optimizer's parameters.
    """
    chosen = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owned = {id(p) for p in params}
    for i, p in enumerate(chosen):
        if id(p) not in owned:
            shown = f"a {type(p).__name__}" + (
                f" of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else ""
            )
            raise InvalidArgumentError(
                f"parameters[{i}] is {shown} that is not a parameter of the optimizer, but "
                f"unscale_and_clip_ unscales the optimizer's gradients only; pass a subset of "
                f"its parameters, or call unscale_ and clip_grad_norm_ yourself"
            )
    return chosen
