"""megatron-core: scaler-core's scaler in the seat of Megatron's ``DynamicGradScaler``.

:class:`GradScaler` is a ``megatron.core.optimizer.grad_scaler.MegatronGradScaler``:
Megatron's mixed-precision optimizers (``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer``) take it where ``get_megatron_optimizer`` puts its
``DynamicGradScaler``. They read ``grad_scaler.scale`` (the loss scale, a float32
tensor of shape ``[1]``) and ``grad_scaler.inv_scale``, call
``grad_scaler.update(found_inf_flag)`` once per step with the step's overflow flag,
and save and load ``grad_scaler.state_dict()`` in their own checkpoints. With the
same numbers it moves the scale as Megatron's class does, bit for bit, through
:func:`scaler_core.preset` ``("megatron", ...)``; the differences are the preset's
(``scaler_core.PRESETS["megatron"].differences``):

* a growth past the largest float32 (Megatron multiplies unchecked and its scale
  becomes ``inf``, after which every step overflows and the scale stays ``inf``)
  is blocked: the scale stays where it is (``StepKind.GROWTH_BLOCKED``), or follows
  the config's ``max_scale`` / ``at_max_scale`` when a ``config=`` sets them;
* Megatron's hysteresis tracker counts on past its last credit (0, -1, ...) where
  scaler-core's stays at 1: the decisions are the same.

:func:`install` hands a built optimizer over to it, carrying the numbers and the
state of Megatron's scaler, so the run continues exactly where it stands::

    optimizer = get_megatron_optimizer(config, model_chunks)
    install(optimizer)  # every DynamicGradScaler becomes scaler-core's

Importing this module imports torch and ``megatron.core.optimizer``;
``import scaler_core`` imports neither.

>>> import scaler_core as sc
>>> from scaler_core.megatron import GradScaler
>>> scaler = GradScaler(initial_scale=2.0**16, growth_interval=2, device="cpu")
>>> scaler.update(False); scaler.update(False)
>>> scaler.scale, scaler.state.last_step
(tensor([131072.]), <StepKind.GROW: 'grow'>)
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any

import torch

with warnings.catch_warnings():
    # megatron.core's own imports warn, none of it about this module or anything a user
    # can change: PyTorch's torch.jit deprecations, Transformer Engine and Apex missing
    # (a fallback it takes by itself), its own moved imports.
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(torch|megatron)\.")
    warnings.filterwarnings("ignore", message=r"Transformer Engine and Apex are not installed")
    from megatron.core.optimizer.grad_scaler import (
        ConstantGradScaler,
        DynamicGradScaler,
        MegatronGradScaler,
    )
    from megatron.core.optimizer.optimizer import (
        ChainedOptimizer,
        MixedPrecisionOptimizer,
    )

from ._config import ScalerConfig
from ._errors import InvalidArgumentError, InvalidStateError
from ._presets import config_for, preset
from ._serialize import TORCH_STATE_KEY, from_dict, to_dict
from ._state import ScalerState, host_update, init
from .backends._torch import host_flag_of

__all__ = ["MEGATRON_KEYS", "STATE_KEY", "GradScaler", "install"]

#: The entries of Megatron's ``DynamicGradScaler.state_dict()``, which
#: :meth:`GradScaler.state_dict` writes too.
MEGATRON_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")
#: The entry of :meth:`GradScaler.state_dict` holding the whole scaler-core checkpoint
#: (:func:`scaler_core.to_dict`), as in ``scaler_core.torch.GradScaler.state_dict()``.
STATE_KEY = TORCH_STATE_KEY
#: Megatron's own arguments, by its names, in its order.
_NUMBERS = (
    "initial_scale",
    "min_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
)


def _default_device() -> torch.device:
    """Megatron builds its scale with ``device='cuda'`` (the current CUDA device); the
    CPU where CUDA is missing."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class GradScaler(MegatronGradScaler):  # type: ignore[misc]
    """scaler-core's dynamic scaler, as a Megatron ``MegatronGradScaler``.

    Built from Megatron's own arguments (by its names; an argument left ``None``
    takes the default Megatron's ``OptimizerConfig`` gives it:
    ``initial_scale=2**32, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
    growth_interval=1000, hysteresis=2``) through ``preset("megatron", ...)``, or
    from any :class:`~scaler_core.ScalerConfig`.

    In plain words, :meth:`update` does what Megatron's ``DynamicGradScaler.update``
    does: an overflow restarts the growth count and spends one hysteresis credit;
    with none left the scale is multiplied by ``backoff_factor``, not below
    ``min_scale``; ``growth_interval`` clean steps in a row multiply it by
    ``growth_factor`` and refill the credits. The rule is scaler-core's transition
    (:func:`scaler_core.update`); the growth Megatron would take to ``inf`` is blocked.

    Args:
        initial_scale: Megatron's ``initial_scale`` (``--initial-loss-scale``).
        min_scale: Megatron's ``min_scale`` (``--min-loss-scale``).
        growth_factor: Megatron's ``growth_factor`` (2.0 in ``get_megatron_optimizer``).
        backoff_factor: Megatron's ``backoff_factor`` (0.5 there).
        growth_interval: Megatron's ``growth_interval`` (``--loss-scale-window``).
        hysteresis: Megatron's ``hysteresis`` (``--hysteresis``).
        config: A :class:`~scaler_core.ScalerConfig` instead of Megatron's arguments
            (which must then be left out); spike skipping must be off (Megatron's
            optimizer passes no gradient norm).
        device: Where :attr:`scale` lives (``torch.device`` or its name). Default:
            ``"cuda"`` as Megatron's class, or ``"cpu"`` when CUDA is missing.

    Raises:
        InvalidConfigError: Megatron's arguments make no valid config (as
            ``preset("megatron", ...)`` refuses them).
        InvalidArgumentError: ``config`` is not a ScalerConfig, is given with
            Megatron's arguments, or has spike skipping on; a bad ``device``.

    >>> GradScaler(hysteresis=3, device="cpu").state.hysteresis_tracker
    3
    """

    def __init__(  # noqa: PLR0913, PLR0917 - Megatron's six arguments, in its order
        self,
        initial_scale: float | None = None,
        min_scale: float | None = None,
        growth_factor: float | None = None,
        backoff_factor: float | None = None,
        growth_interval: int | None = None,
        hysteresis: int | None = None,
        *,
        config: ScalerConfig | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        # MegatronGradScaler.__init__ builds its tensor with device='cuda': not called.
        floats = (initial_scale, min_scale, growth_factor, backoff_factor)
        values = (*floats, growth_interval, hysteresis)
        given = {n: v for n, v in zip(_NUMBERS, values, strict=True) if v is not None}
        if config is None:
            config = preset("megatron", **given)
        elif given:
            raise InvalidArgumentError(
                f"config= was given, and Megatron's arguments {sorted(given)} too; set the "
                f"scaler's numbers in one place (the config, or Megatron's arguments)"
            )
        config = _check_config(config)
        self._device = _device(device)
        self._state = init(config)
        self._scale = self._scale_tensor(self._state.scale)

    # ------------------------------------------------------------------ reading
    @property
    def scale(self) -> torch.Tensor:
        """The loss scale: a float32 tensor of shape ``[1]`` on the scaler's device, as
        Megatron's. A new tensor after each change (Megatron's class replaces its
        tensor too); never written in place."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as Megatron computes it: in float64, rounded to float32."""
        return self._scale.double().reciprocal().float()

    @property
    def state(self) -> ScalerState:
        """The scaler-core state (a host :class:`~scaler_core.ScalerState`)."""
        return self._state

    @property
    def config(self) -> ScalerConfig:
        """The policy (:class:`~scaler_core.ScalerConfig`)."""
        return self._state.config

    @property
    def device(self) -> torch.device:
        """Where :attr:`scale` lives."""
        return self._device

    # ----------------------------------------------------------------- stepping
    def update(self, found_inf: Any) -> None:
        """One step of the scaler, with this step's overflow flag.

        Megatron's optimizer passes a Python bool (``found_inf.item() > 0``, already
        read back to the host). A one-element bool or float tensor is taken too, as
        Megatron's ``if found_inf:`` takes it: nonzero (NaN included) is an overflow;
        reading it back costs one host synchronisation.

        Args:
            found_inf: Whether any gradient of this step was NaN or inf.

        Raises:
            GradientTypeError: ``found_inf`` is not a bool, a NumPy bool, nor a
                one-element bool or float tensor.
            ScaleCollapseError: The step would collapse the scale, or pass a limit
                the config fails closed at; the state is unchanged.
        """
        self._set_state(host_update(self._state, _flag(found_inf)))

    # ------------------------------------------------------------------- saving
    def state_dict(self) -> dict[str, Any]:
        """Megatron's three entries, and the whole checkpoint under ``"scaler_core"``.

        ``scale`` (the tensor), ``growth_tracker`` and ``hysteresis_tracker`` as
        Megatron's ``DynamicGradScaler.state_dict()`` holds them, so Megatron's class
        loads this dict (it ignores the other entry) and carries on with the same
        decisions; ``"scaler_core"`` holds :func:`scaler_core.to_dict`'s checkpoint
        (JSON-safe: ``torch.load(..., weights_only=True)`` reads it).

        >>> sorted(GradScaler(device="cpu").state_dict())
        ['growth_tracker', 'hysteresis_tracker', 'scale', 'scaler_core']
        """
        return {
            "scale": self._scale,
            "growth_tracker": self._state.growth_tracker,
            "hysteresis_tracker": self._state.hysteresis_tracker,
            STATE_KEY: to_dict(self._state),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a dict this class or Megatron's ``DynamicGradScaler`` saved, validated first.

        This class's dict restores everything, config included; where Megatron's three
        entries differ from its checkpoint (edited by hand), **Megatron's entries win**,
        as Megatron's class would load them. Megatron's dict gives the scale and the
        trackers; the config stays this scaler's, and the step counters start at 0.
        Megatron's hysteresis tracker of 0, -1, ... (past its last credit) is loaded
        as 1, which makes the same decisions.

        Args:
            state_dict: ``GradScaler.state_dict()``, or Megatron's
                ``DynamicGradScaler.state_dict()`` (``scale`` a one-element float
                tensor or a number).

        Raises:
            InvalidStateError: The dict is empty (Megatron's ``ConstantGradScaler``
                saves ``{}``), has missing or unknown keys, or an entry out of range
                for the config (named by its key: an ``inf`` scale, a tracker above
                the config's hysteresis, ...); nothing is loaded.
            InvalidArgumentError: The saved config has spike skipping on.

        >>> a, b = GradScaler(device="cpu"), GradScaler(device="cpu")
        >>> a.update(True); a.update(True); a.update(True)
        >>> b.load_state_dict(a.state_dict())
        >>> b.state == a.state
        True
        """
        self._set_state(self._loaded(state_dict))

    # ----------------------------------------------------------------- internals
    def _loaded(self, data: Mapping[str, Any]) -> ScalerState:
        if not isinstance(data, Mapping) or not data:
            raise InvalidStateError(
                f"state_dict={data!r}, but it must be a non-empty dict with Megatron's keys "
                f"{list(MEGATRON_KEYS)} (an empty one comes from a ConstantGradScaler, which "
                f"has no dynamic state)"
            )
        keys = (*MEGATRON_KEYS, STATE_KEY) if STATE_KEY in data else MEGATRON_KEYS
        missing = [k for k in keys if k not in data]
        unknown = sorted(repr(k) for k in data if k not in keys)
        if missing or unknown:
            raise InvalidStateError(
                f"state_dict has missing keys {missing} and unknown keys [{', '.join(unknown)}]; "
                f"expected {list(MEGATRON_KEYS)}, and optionally {STATE_KEY!r}"
            )
        if STATE_KEY in data:
            saved = from_dict(data[STATE_KEY])  # validated, with its own config
            base = to_dict(saved)
        else:
            base = to_dict(init(self._state.config))
        entries = {
            "scale": _scale_value(data["scale"]),
            "growth_tracker": data["growth_tracker"],
            "hysteresis_tracker": _hysteresis(data["hysteresis_tracker"]),
        }
        try:
            state = from_dict({**base, "state": {**base["state"], **entries}})
        except InvalidStateError as exc:
            message = str(exc).replace("checkpoint['state'][", "state_dict[")
            raise InvalidStateError(message) from exc
        _check_config(state.config)
        return state

    def _set_state(self, state: ScalerState) -> None:
        if state.scale != self._state.scale:
            self._scale = self._scale_tensor(state.scale)
        self._state = state

    def _scale_tensor(self, scale: float) -> torch.Tensor:
        return torch.tensor([scale], dtype=torch.float32, device=self._device)

    def __repr__(self) -> str:
        return f"GradScaler(config={self.config!r}, device={str(self._device)!r})"


def _check_config(config: object) -> ScalerConfig:
    return config_for(
        config,
        example="scaler_core.preset('megatron', ...)",
        no_spikes="Megatron's optimizer calls update(found_inf) with no gradient norm",
    )


def _device(device: object) -> torch.device:
    if device is None:
        return _default_device()
    try:
        out: torch.device = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(
            f"device={device!r}, but it must be a torch.device or its name ('cuda', 'cpu', "
            f"'cuda:1'): {exc}"
        ) from None
    return out


def _flag(found: Any) -> bool:
    return host_flag_of(found, "found_inf", "Megatron's found_inf")


def _scale_value(value: object) -> object:
    """Megatron's ``scale`` entry as a number for :func:`scaler_core.from_dict` to check
    (a one-element floating tensor, or a number); anything else as it is, refused there."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise InvalidStateError(
                f"state_dict['scale'] is a {value.dtype} tensor of shape {list(value.shape)}, "
                f"but it must be a one-element float tensor (Megatron's is float32, shape [1])"
            )
        return float(value.item())
    return value


def _hysteresis(value: object) -> object:
    """Megatron's hysteresis tracker in scaler-core's range: 0, -1, ... (past the last
    credit: the next overflow backs off) is 1; anything else is checked by from_dict."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) < 1:
        return 1
    return value


# ---------------------------------------------------------------------- install
def install(optimizer: Any, config: ScalerConfig | None = None) -> tuple[GradScaler, ...]:
    """Replace the ``DynamicGradScaler`` of a Megatron optimizer with :class:`GradScaler`.

    For the optimizer ``get_megatron_optimizer`` returns (a ``ChainedOptimizer``:
    each optimizer it chains has a scaler of its own, and each is replaced) or one
    mixed-precision optimizer (``Float16OptimizerWithFloat16Params``,
    ``DistributedOptimizer``). Each new scaler takes over its old one's numbers
    (``min_scale``, factors, interval, hysteresis), its current scale and its
    trackers, on its device: training continues exactly where it stands, at any
    step. With ``config``, the config gives the policy instead, and the old scale
    and trackers are loaded into it (they must fit it).

    Args:
        optimizer: A Megatron ``MixedPrecisionOptimizer`` or ``ChainedOptimizer`` of them.
        config: A :class:`~scaler_core.ScalerConfig` instead of the old scaler's numbers.

    Returns:
        The new scalers, one per optimizer, in the order of ``chained_optimizers``
        (one for a single optimizer), each set as that optimizer's ``grad_scaler``.

    Raises:
        InvalidArgumentError: ``optimizer`` is not one of these; an optimizer has no
            ``grad_scaler`` (bf16 without a loss scale, or an ``FP32Optimizer``:
            nothing to scale), a ``ConstantGradScaler`` (``OptimizerConfig.loss_scale``
            set), a scaler of another class, or scaler-core's already; a bad ``config``.
        InvalidConfigError: The old scaler's numbers make no valid config.
        InvalidStateError: Its scale (``inf`` after Megatron grew past float32) or
            trackers do not fit the config.

    Nothing is changed when it raises.

    >>> try:
    ...     install("my optimizer")
    ... except InvalidArgumentError as exc:
    ...     print(str(exc).split(" (")[0])
    optimizer='my optimizer', but it must be a Megatron MixedPrecisionOptimizer
    """
    if isinstance(optimizer, ChainedOptimizer):
        targets = list(optimizer.chained_optimizers)
        if not targets:
            raise InvalidArgumentError(
                "optimizer is a ChainedOptimizer of no optimizers (this rank has no trainable "
                "parameters): there is no grad_scaler to replace"
            )
    elif isinstance(optimizer, MixedPrecisionOptimizer):
        targets = [optimizer]
    else:
        raise InvalidArgumentError(
            f"optimizer={optimizer!r}, but it must be a Megatron MixedPrecisionOptimizer "
            f"(Float16OptimizerWithFloat16Params, DistributedOptimizer) or the ChainedOptimizer "
            f"get_megatron_optimizer returns; an FP32Optimizer has no loss scale"
        )
    for i, target in enumerate(targets):
        _replaceable(target, i)
    new = tuple(_successor(target.grad_scaler, config) for target in targets)
    for target, scaler in zip(targets, new, strict=True):
        target.grad_scaler = scaler
    return new


def _replaceable(target: Any, index: int) -> None:
    where = f"chained optimizer {index} ({type(target).__name__})"
    if not isinstance(target, MixedPrecisionOptimizer):
        raise InvalidArgumentError(
            f"{where} is not a MixedPrecisionOptimizer, so it has no grad_scaler (an "
            f"FP32Optimizer trains without loss scaling)"
        )
    old = getattr(target, "grad_scaler", None)
    if old is None:
        raise InvalidArgumentError(
            f"{where} has grad_scaler=None: Megatron builds none for bf16 without "
            f"OptimizerConfig.loss_scale, and there is no loss scale to replace (use "
            f"OptimizerConfig(fp16=True) for a dynamic scale)"
        )
    if isinstance(old, GradScaler):
        raise InvalidArgumentError(
            f"{where}'s grad_scaler is already scaler-core's; install() replaces Megatron's "
            f"DynamicGradScaler, once"
        )
    if isinstance(old, ConstantGradScaler):
        raise InvalidArgumentError(
            f"{where}'s grad_scaler is a ConstantGradScaler (OptimizerConfig.loss_scale="
            f"{float(old.scale.item())!r}): a constant scale, which install() does not "
            f"replace; leave loss_scale unset for a dynamic one"
        )
    if type(old) is not DynamicGradScaler:
        raise InvalidArgumentError(
            f"{where}'s grad_scaler is a {type(old).__module__}.{type(old).__qualname__}, "
            f"but install() replaces megatron.core's DynamicGradScaler only"
        )


def _successor(old: Any, config: ScalerConfig | None) -> GradScaler:
    """The scaler that takes over from Megatron's ``old``, with its state loaded."""
    device = old.scale.device
    scale = float(old.scale.item())
    if not math.isfinite(scale):
        raise InvalidStateError(
            f"the DynamicGradScaler's scale is {scale!r}: Megatron grew it past the largest "
            f"float32 (every step now overflows and it stays {scale!r}); build the scaler anew "
            f"with GradScaler(initial_scale=...) and set it as optimizer.grad_scaler"
        )
    if config is None:
        new = GradScaler(
            initial_scale=scale,
            min_scale=float(old.min_scale.item()),
            growth_factor=float(old.growth_factor.item()),
            backoff_factor=float(old.backoff_factor.item()),
            growth_interval=old.growth_interval,
            hysteresis=old.hysteresis,
            device=device,
        )
    else:
        new = GradScaler(config=config, device=device)
    new.load_state_dict(old.state_dict())
    return new
