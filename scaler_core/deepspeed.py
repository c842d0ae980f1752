"""DeepSpeed: scaler-core's scaler in the seat of ZeRO's ``DynamicLossScaler``.

:class:`DynamicLossScaler` is a ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``:
ZeRO stages 1 and 2 (``DeepSpeedZeroOptimizer``) keep it as
``engine.optimizer.loss_scaler``, scale the loss with ``loss_scaler.scale_loss(loss)``
(``loss * loss_scale``), read ``loss_scaler.cur_scale`` (the optimizer's
``loss_scale``) to unscale and clip, call ``loss_scaler.update_scale(overflow)`` once
per step with the step's overflow flag (already OR-ed over the data-parallel group),
and pickle the object itself into their checkpoints (the ``loss_scaler`` entry of the
optimizer's ``state_dict()``). With the same numbers it moves the scale as
DeepSpeed's class does, bit for bit, through :func:`scaler_core.preset`
``("deepspeed", ...)``; the differences are the preset's
(``scaler_core.PRESETS["deepspeed"].differences``): a growth past the largest
float32 is blocked, and at the floor with ``raise_error_at_min_scale`` the step
raises :class:`~scaler_core.ScaleCollapseError` (DeepSpeed: a bare ``Exception``),
with the state unchanged.

:func:`install` hands a built engine over to it, carrying the numbers and the
counters of DeepSpeed's scaler, so the run continues exactly where it stands::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)
    install(engine)  # engine.optimizer.loss_scaler becomes scaler-core's

Checkpoints: ``engine.save_checkpoint`` pickles this class by reference
(``scaler_core.deepspeed.DynamicLossScaler``; loading needs scaler-core importable),
with a JSON-safe state (:meth:`DynamicLossScaler.state_dict`). A plain DeepSpeed
engine that loads such a checkpoint runs on with it (it is a DeepSpeed
``DynamicLossScaler``). ``engine.load_checkpoint`` puts back whatever scaler the
checkpoint holds; on an engine :func:`install` has seen, a DeepSpeed scaler loaded so
is converted into this class, with its numbers and counters, so loading never swaps
scaler-core's scaler out.

Importing this module imports torch and ``deepspeed``; ``import scaler_core``
imports neither.

>>> from scaler_core.deepspeed import DynamicLossScaler
>>> scaler = DynamicLossScaler(init_scale=2.0**8, scale_window=2)
>>> for overflow in (False, False, False):
...     scaler.update_scale(overflow)
>>> scaler.cur_scale, scaler.cur_iter, scaler.state.last_step
(512.0, 3, <StepKind.GROW: 'grow'>)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as torch_dist

with warnings.catch_warnings():
    # DeepSpeed's import warns about what it finds (no accelerator, optional ops); none
    # of it is about this module or anything its user can change here.
    warnings.simplefilter("ignore")
    from deepspeed.checkpoint.constants import LOSS_SCALER
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler as _DeepSpeedScaler
    from deepspeed.runtime.fp16.loss_scaler import LossScalerBase
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ._config import ScalerConfig
from ._errors import InvalidArgumentError, InvalidStateError
from ._f32 import INT32_MAX
from ._presets import config_for, preset
from ._serialize import TORCH_STATE_KEY, from_dict, to_dict
from ._state import ScalerState, StepKind, host_update, init
from .backends._torch import host_flag_of

__all__ = ["DEEPSPEED_KEYS", "STATE_KEY", "DynamicLossScaler", "install"]

#: DeepSpeed's counters, which :meth:`DynamicLossScaler.state_dict` writes by its names.
DEEPSPEED_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
#: The entry of :meth:`DynamicLossScaler.state_dict` holding the whole scaler-core
#: checkpoint (:func:`scaler_core.to_dict`), as in the other integrations.
STATE_KEY = TORCH_STATE_KEY
#: DeepSpeed's own constructor arguments, by its names, in its order.
_NUMBERS = (
    "init_scale",
    "scale_window",
    "min_scale",
    "delayed_shift",
    "consecutive_hysteresis",
    "raise_error_at_min_scale",
)
#: The half-precision dtypes DeepSpeed's class is built with (its log says "loss scale"
#: for float16 only).
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: The attribute install() sets on a ZeRO optimizer it guards (see _guard).
_GUARD = "_scaler_core_guarded"
_logger = logging.getLogger("DeepSpeed")  # DeepSpeed's own logger (deepspeed.utils.logger)


class DynamicLossScaler(_DeepSpeedScaler):  # type: ignore[misc]
    """scaler-core's dynamic scaler, as a DeepSpeed ``DynamicLossScaler``.

    Built from DeepSpeed's own arguments (by its names; an argument left ``None``
    takes the default DeepSpeed's fp16 config gives it: ``init_scale=2**16,
    scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False,
    raise_error_at_min_scale=True``) through ``preset("deepspeed", ...)``, or from any
    :class:`~scaler_core.ScalerConfig`.

    In plain words, :meth:`update_scale` does what DeepSpeed's does: an overflow
    spends one hysteresis credit (``delayed_shift``); with none left the scale is
    halved, not below ``min_scale`` (at ``min_scale`` with
    ``raise_error_at_min_scale`` the step fails). The first growth after an overflow
    (or the start) comes after ``scale_window + 1`` clean steps, the next ones every
    ``scale_window``; each doubles the scale and refills the credits (with
    ``consecutive_hysteresis``, every clean step refills them). The rule is
    scaler-core's transition (:func:`scaler_core.update`).

    DeepSpeed's attributes are there to read: ``cur_scale`` (and ``loss_scale``),
    ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``, ``scale_factor``,
    ``scale_window``, ``min_scale``, ``delayed_shift``, ``consecutive_hysteresis``,
    ``raise_error_at_min_scale``, ``dynamic`` (True) and ``dtype``; ``cur_scale`` can
    be set (ZeRO's ``optimizer.loss_scale = x`` sets it), to a value the config takes.

    Args:
        init_scale: DeepSpeed's ``init_scale`` (``2**initial_scale_power``).
        scale_window: DeepSpeed's ``scale_window`` (``loss_scale_window``).
        min_scale: DeepSpeed's ``min_scale`` (``min_loss_scale``).
        delayed_shift: DeepSpeed's ``delayed_shift`` (``hysteresis``).
        consecutive_hysteresis: DeepSpeed's ``consecutive_hysteresis``.
        raise_error_at_min_scale: DeepSpeed's ``raise_error_at_min_scale``.
        dtype: DeepSpeed's ``dtype``: the engine's half dtype (it only shapes the log).
        config: A :class:`~scaler_core.ScalerConfig` instead of DeepSpeed's arguments
            (which must then be left out); spike skipping must be off (ZeRO calls
            ``update_scale(overflow)`` with no gradient norm).

    Raises:
        InvalidConfigError: DeepSpeed's arguments make no valid config (as
            ``preset("deepspeed", ...)`` refuses them).
        InvalidArgumentError: ``config`` is not a ScalerConfig, is given with
            DeepSpeed's arguments, or has spike skipping on; ``dtype`` is not a
            torch floating dtype DeepSpeed trains in.

    >>> DynamicLossScaler(delayed_shift=3).cur_hysteresis
    3
    """

    dynamic = True

    def __init__(  # noqa: PLR0913, PLR0917 - DeepSpeed's six arguments, in order, and dtype
        self,
        init_scale: float | None = None,
        scale_window: int | None = None,
        min_scale: float | None = None,
        delayed_shift: int | None = None,
        consecutive_hysteresis: bool | None = None,
        raise_error_at_min_scale: bool | None = None,
        dtype: torch.dtype = torch.half,
        *,
        config: ScalerConfig | None = None,
    ) -> None:
        # DynamicLossScaler.__init__ only sets the attributes served here as properties:
        # not called.
        values = (
            init_scale,
            scale_window,
            min_scale,
            delayed_shift,
            consecutive_hysteresis,
            raise_error_at_min_scale,
        )
        given = {n: v for n, v in zip(_NUMBERS, values, strict=True) if v is not None}
        if config is None:
            config = preset("deepspeed", **given)
        elif given:
            raise InvalidArgumentError(
                f"config= was given, and DeepSpeed's arguments {sorted(given)} too; set the "
                f"scaler's numbers in one place (the config, or DeepSpeed's arguments)"
            )
        config = _check_config(config)
        self._dtype = _dtype(dtype)
        self._state = init(config)
        self._cur_iter = 0
        self._last_overflow_iter = -1

    # ------------------------------------------------------------ DeepSpeed's view
    @property
    def cur_scale(self) -> float:
        """The loss scale, a Python float (a float32 value)."""
        return float(self._state.scale)

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        base = to_dict(self._state)
        try:
            state = from_dict({**base, "state": {**base["state"], "scale": value}})
        except InvalidStateError as exc:
            message = str(exc).replace("checkpoint['state']['scale']", "cur_scale")
            raise InvalidStateError(message) from exc
        self._state = state

    @property
    def cur_iter(self) -> int:
        """Steps taken (``update_scale`` calls that did not raise), as DeepSpeed counts."""
        return self._cur_iter

    @property
    def last_overflow_iter(self) -> int:
        """The step of the last overflow (``-1``: none yet), as DeepSpeed records it."""
        return self._last_overflow_iter

    @property
    def cur_hysteresis(self) -> int:
        """Overflows left before the next backoff (DeepSpeed's ``cur_hysteresis``)."""
        tracker: int = self._state.hysteresis_tracker
        return tracker

    @property
    def scale_factor(self) -> float:
        """The growth factor (DeepSpeed's is 2.0)."""
        return self.config.growth_factor

    @property
    def scale_window(self) -> int:
        """Clean steps between growths (the config's ``growth_interval``)."""
        return self.config.growth_interval

    @property
    def min_scale(self) -> float | None:
        """The floor of the scale (``None``: the config has none)."""
        return self.config.min_scale

    @property
    def delayed_shift(self) -> int:
        """The hysteresis (overflows before a backoff)."""
        return self.config.hysteresis

    @property
    def consecutive_hysteresis(self) -> bool:
        """Whether every clean step refills the hysteresis credits."""
        return self.config.hysteresis_refill == "on_clean_step"

    @property
    def raise_error_at_min_scale(self) -> bool:
        """Whether an overflow at ``min_scale`` fails (``ScaleCollapseError``)."""
        return self.config.at_min_scale == "raise"

    @property
    def dtype(self) -> torch.dtype:
        """The engine's half dtype, as DeepSpeed's class keeps it."""
        return self._dtype

    # ---------------------------------------------------------- scaler-core's view
    @property
    def state(self) -> ScalerState:
        """The scaler-core state (a host :class:`~scaler_core.ScalerState`)."""
        return self._state

    @property
    def config(self) -> ScalerConfig:
        """The policy (:class:`~scaler_core.ScalerConfig`)."""
        return self._state.config

    # ----------------------------------------------------------------- stepping
    def update_scale(self, overflow: Any) -> None:
        """One step of the scaler, with this step's overflow flag.

        ZeRO passes a Python bool (its flag, OR-ed over the data-parallel group and
        read back to the host). A NumPy bool or a one-element bool or float tensor
        (nonzero, NaN included, is an overflow) is taken too. Logs as DeepSpeed's
        class does, on rank 0, at INFO on DeepSpeed's logger.

        Args:
            overflow: Whether any gradient of this step was NaN or inf.

        Raises:
            GradientTypeError: ``overflow`` is not a bool, a NumPy bool, nor a
                one-element bool or float tensor.
            ScaleCollapseError: An overflow at ``min_scale`` with
                ``raise_error_at_min_scale`` (where DeepSpeed raises ``Exception``),
                or another limit the config fails closed at; nothing is changed.
        """
        flag = _flag(overflow)
        before = self._state
        self._state = host_update(before, flag)
        if flag:
            self._last_overflow_iter = self._cur_iter
        self._cur_iter = min(self._cur_iter + 1, INT32_MAX)
        _log(before, self._state)

    # ------------------------------------------------------------------- saving
    def state_dict(self) -> dict[str, Any]:
        """DeepSpeed's counters by its names, the dtype, and the whole checkpoint
        under ``"scaler_core"`` (:func:`scaler_core.to_dict`); JSON-safe. This is
        what the object pickles (so ZeRO's checkpoint holds it).

        >>> sorted(DynamicLossScaler().state_dict())
        ['cur_hysteresis', 'cur_iter', 'cur_scale', 'dtype', 'last_overflow_iter', 'scaler_core']
        """
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self._cur_iter,
            "last_overflow_iter": self._last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "dtype": str(self._dtype).removeprefix("torch."),
            STATE_KEY: to_dict(self._state),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a dict :meth:`state_dict` wrote, validated first, config included.

        Where DeepSpeed's entries (``cur_scale``, ``cur_hysteresis``) differ from the
        ``"scaler_core"`` checkpoint (edited by hand), DeepSpeed's entries win.

        Args:
            state_dict: :meth:`state_dict`'s dict.

        Raises:
            InvalidStateError: A key is missing or unknown, or an entry is out of
                range (named by its key); nothing is loaded.
            InvalidArgumentError: The saved config has spike skipping on.

        >>> a, b = DynamicLossScaler(delayed_shift=1), DynamicLossScaler()
        >>> a.update_scale(True); a.update_scale(False)
        >>> b.load_state_dict(a.state_dict())
        >>> b.state == a.state, b.cur_iter, b.last_overflow_iter
        (True, 2, 0)
        """
        self._state, self._cur_iter, self._last_overflow_iter, self._dtype = _loaded(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.load_state_dict(state)

    # --------------------------------------------------------------- conversion
    @classmethod
    def from_deepspeed(cls, scaler: Any, config: ScalerConfig | None = None) -> DynamicLossScaler:
        """This class, continuing exactly where a DeepSpeed scaler stands.

        From DeepSpeed's ``DynamicLossScaler``: its numbers (through
        ``preset("deepspeed", ...)``), its scale, its hysteresis credits, its
        ``cur_iter`` and ``last_overflow_iter`` (from which the growth count is
        rebuilt: the clean steps since the last overflow). From this class: a copy.
        scaler-core's own step counters (``steps``, ``skipped_steps``) start at 0
        for DeepSpeed's class, which does not keep them.

        Args:
            scaler: A DeepSpeed ``DynamicLossScaler`` (or this class).
            config: A :class:`~scaler_core.ScalerConfig` instead of the scaler's
                numbers; its scale and counters must fit it.

        Returns:
            The new scaler.

        Raises:
            InvalidArgumentError: ``scaler`` is not a ``DynamicLossScaler`` (a static
                ``LossScaler``: nothing dynamic to carry), or a bad ``config``.
            InvalidConfigError: The scaler's numbers make no valid config.
            InvalidStateError: Its scale (past the largest float32, or one float32
                cannot hold), its credits or its counters do not fit the config.
        """
        if isinstance(scaler, DynamicLossScaler):
            data = scaler.state_dict()
            if config is not None:
                base = data[STATE_KEY]
                data[STATE_KEY] = {**base, "config": _check_config(config).to_dict()}
            out = cls.__new__(cls)
            out.load_state_dict(data)
            return out
        if type(scaler) is not _DeepSpeedScaler:
            raise InvalidArgumentError(
                f"scaler is a {type(scaler).__module__}.{type(scaler).__qualname__}, but it "
                f"must be DeepSpeed's DynamicLossScaler (fp16 with dynamic loss scaling: "
                f"'loss_scale': 0 in the fp16 config); a static LossScaler (bf16, fp32, or "
                f"a fixed loss_scale) has no dynamic state to carry"
            )
        if config is None:
            # DeepSpeed keeps no init_scale: the current scale starts the config.
            given = {name: getattr(scaler, name) for name in _NUMBERS[1:]}
            given["init_scale"] = scaler.cur_scale
            if getattr(scaler, "scale_factor", 2.0) != 2.0:  # noqa: PLR2004 - DeepSpeed's
                given["scale_factor"] = scaler.scale_factor  # refused by the preset, named
            config = preset("deepspeed", **given)
        config = _check_config(config)
        cur_iter, last = _counters(scaler.cur_iter, scaler.last_overflow_iter)
        clean = cur_iter - last - 1  # clean steps since the last overflow (or the start)
        base = to_dict(init(config))
        state = {
            **base["state"],
            "scale": scaler.cur_scale,
            "growth_tracker": _tracker(clean, config),
            "hysteresis_tracker": scaler.cur_hysteresis,
        }
        out = cls.__new__(cls)
        out.load_state_dict(
            {
                "cur_scale": scaler.cur_scale,
                "cur_iter": cur_iter,
                "last_overflow_iter": last,
                "cur_hysteresis": scaler.cur_hysteresis,
                "dtype": str(getattr(scaler, "dtype", torch.half)).removeprefix("torch."),
                STATE_KEY: {**base, "state": state},
            }
        )
        return out

    def __repr__(self) -> str:
        return f"DynamicLossScaler(config={self.config!r}, dtype={self._dtype!r})"


# ----------------------------------------------------------------- internals
def _check_config(config: object) -> ScalerConfig:
    return config_for(
        config,
        example="scaler_core.preset('deepspeed', ...)",
        no_spikes="ZeRO calls update_scale(overflow) with no gradient norm",
    )


def _dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES.values():
        raise InvalidArgumentError(
            f"dtype={dtype!r}, but it must be one of torch.float16, torch.bfloat16, "
            f"torch.float32 (the engine's training dtype, as DeepSpeed's class takes it)"
        )
    return dtype


def _flag(found: Any) -> bool:
    return host_flag_of(found, "overflow", "ZeRO's overflow")


def _counters(cur_iter: object, last: object) -> tuple[int, int]:
    """DeepSpeed's ``cur_iter`` and ``last_overflow_iter``, checked."""
    if (
        isinstance(cur_iter, int)
        and isinstance(last, int)
        and not isinstance(cur_iter, bool)
        and not isinstance(last, bool)
        and 0 <= cur_iter <= INT32_MAX
        and -1 <= last < cur_iter
    ):
        return int(cur_iter), int(last)
    raise InvalidStateError(
        f"cur_iter={cur_iter!r} and last_overflow_iter={last!r}, but they must be ints "
        f"with -1 <= last_overflow_iter < cur_iter <= {INT32_MAX} (DeepSpeed's counters "
        f"after cur_iter steps)"
    )


def _tracker(clean: int, config: ScalerConfig) -> int:
    """scaler-core's growth tracker after ``clean`` clean steps since the last overflow:
    growths came at ``interval + delay``, ``2 * interval + delay``, ... and each left
    the tracker at ``delay``."""
    first = config.growth_interval + config.growth_delay
    if clean < first:
        return clean
    return config.growth_delay + (clean - config.growth_delay) % config.growth_interval


def _loaded(data: object) -> tuple[ScalerState, int, int, torch.dtype]:
    if not isinstance(data, Mapping):
        raise InvalidStateError(
            f"state_dict={data!r}, but it must be a dict with the keys "
            f"{[*DEEPSPEED_KEYS, 'dtype', STATE_KEY]} (DynamicLossScaler.state_dict())"
        )
    keys = (*DEEPSPEED_KEYS, "dtype", STATE_KEY)
    missing = [k for k in keys if k not in data]
    unknown = sorted(repr(k) for k in data if k not in keys)
    if missing or unknown:
        raise InvalidStateError(
            f"state_dict has missing keys {missing} and unknown keys [{', '.join(unknown)}]; "
            f"expected {list(keys)} (DynamicLossScaler.state_dict())"
        )
    dtype = _DTYPES.get(data["dtype"]) if isinstance(data["dtype"], str) else None
    if dtype is None:
        raise InvalidStateError(
            f"state_dict['dtype']={data['dtype']!r}, but it must be one of {sorted(_DTYPES)}"
        )
    cur_iter, last = _counters(data["cur_iter"], data["last_overflow_iter"])
    saved = from_dict(data[STATE_KEY])  # validated, with its own config
    base = to_dict(saved)
    entries = {"scale": data["cur_scale"], "hysteresis_tracker": data["cur_hysteresis"]}
    try:
        state = from_dict({**base, "state": {**base["state"], **entries}})
    except InvalidStateError as exc:
        message = str(exc).replace("checkpoint['state']['scale']", "state_dict['cur_scale']")
        message = message.replace(
            "checkpoint['state']['hysteresis_tracker']", "state_dict['cur_hysteresis']"
        )
        raise InvalidStateError(message) from exc
    _check_config(state.config)
    return state, cur_iter, last, dtype


def _rank() -> int:
    return torch_dist.get_rank() if torch_dist.is_initialized() else 0


def _log(before: ScalerState, after: ScalerState) -> None:
    """DeepSpeed's messages for a step, on rank 0 (its users read them)."""
    kind = after.last_step
    if kind not in (StepKind.BACKOFF, StepKind.HOLD_AT_FLOOR, StepKind.HYSTERESIS):
        return
    if not _logger.isEnabledFor(logging.INFO) or _rank() != 0:
        return
    message = "[deepspeed] OVERFLOW! Rank 0 Skipping step."
    if kind is StepKind.HYSTERESIS:
        message += (
            f" Attempted loss scale: {int(before.scale)}, but hysteresis is "
            f"{before.hysteresis_tracker}. Reducing hysteresis to {after.hysteresis_tracker}"
        )
    else:
        message += f" Attempted loss scale: {int(before.scale)}, reducing to {int(after.scale)}"
    _logger.info(message)


# ---------------------------------------------------------------------- install
def install(engine: Any, config: ScalerConfig | None = None) -> DynamicLossScaler:
    """Replace the ``DynamicLossScaler`` of a ZeRO-1/2 fp16 engine with scaler-core's.

    The new :class:`DynamicLossScaler` takes over the old one's numbers
    (``scale_window``, ``min_scale``, ``delayed_shift``, ...), its scale, its
    hysteresis credits and its counters: training continues exactly where it stands,
    at any step. With ``config``, the config gives the policy instead, and the old
    scale and counters are loaded into it (they must fit it).

    It also guards the optimizer's checkpoint loading: ``engine.load_checkpoint``
    (ZeRO's ``_load_global_state``) sets whatever scaler the checkpoint holds; a
    DeepSpeed ``DynamicLossScaler`` loaded so becomes this class (the checkpoint's
    numbers and counters, as DeepSpeed would load them), a checkpoint of this class
    loads as it is, and a static ``LossScaler`` is refused (the module's weights,
    which DeepSpeed loads first, are loaded by then). Calling ``install`` again
    (after loading a checkpoint of this class into an engine it had not seen) keeps
    that scaler and guards the engine.

    Args:
        engine: A ``deepspeed.DeepSpeedEngine`` with ZeRO stage 1 or 2 and fp16
            dynamic loss scaling (``"fp16": {"enabled": true}``, ``loss_scale`` 0).
        config: A :class:`~scaler_core.ScalerConfig` instead of the old scaler's numbers.

    Returns:
        The new scaler, set as ``engine.optimizer.loss_scaler``.

    Raises:
        InvalidArgumentError: ``engine`` is not a DeepSpeedEngine; its optimizer is
            not ZeRO stage 1 or 2 (``FP16_Optimizer`` and ``FP16_UnfusedOptimizer``,
            fp16 without ZeRO, move the scale in their own code, with no scaler
            object to replace; stage 3 is not supported yet); no dynamic fp16 scale
            (bf16, fp32, a fixed ``loss_scale``); ``override_loss_scale`` set; a bad
            ``config``.
        InvalidConfigError: The old scaler's numbers make no valid config.
        InvalidStateError: Its scale or counters do not fit the config.

    Nothing is changed when it raises.

    >>> try:
    ...     install("my engine")
    ... except InvalidArgumentError as exc:
    ...     print(str(exc).split(" (")[0])
    engine='my engine', but it must be a deepspeed.DeepSpeedEngine
    """
    if not isinstance(engine, DeepSpeedEngine):
        raise InvalidArgumentError(
            f"engine={engine!r}, but it must be a deepspeed.DeepSpeedEngine (the first "
            f"value deepspeed.initialize returns)"
        )
    optimizer = _zero_optimizer(engine)
    old = optimizer.loss_scaler
    if isinstance(old, DynamicLossScaler) and config is None:
        new = old
    else:
        new = DynamicLossScaler.from_deepspeed(_dynamic(old), config)
    _guard(optimizer)
    optimizer.loss_scaler = new
    return new


def _zero_optimizer(engine: Any) -> Any:
    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        name = type(optimizer).__name__
        if name in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
            why = (
                "fp16 without ZeRO, whose loss scale moves in the optimizer's own step code "
                "(deepspeed/runtime/fp16/), with no loss_scaler object to replace; use "
                '"zero_optimization": {"stage": 1} or 2'
            )
        else:
            why = (
                "install() replaces the loss scaler of ZeRO stages 1 and 2 "
                "(DeepSpeedZeroOptimizer); stage 3 and other optimizers are not supported"
            )
        raise InvalidArgumentError(f"engine.optimizer is a {name}: {why}")
    if getattr(optimizer, "custom_loss_scaler", False):
        raise InvalidArgumentError(
            f"engine.optimizer.override_loss_scale({optimizer.external_loss_scale!r}) was "
            f"called: the optimizer scales by that value, not by its loss scaler, so "
            f"replacing the loss scaler would change nothing"
        )
    return optimizer


def _dynamic(scaler: Any) -> Any:
    if isinstance(scaler, LossScalerBase) and not getattr(scaler, "dynamic", False):
        raise InvalidArgumentError(
            f"engine.optimizer.loss_scaler is a static {type(scaler).__name__} "
            f"(cur_scale={scaler.cur_scale!r}): bf16, fp32, or fp16 with a fixed loss_scale "
            f'train without a dynamic scale; set "fp16": {{"enabled": true, '
            f'"loss_scale": 0}} for one'
        )
    return scaler


def _guard(optimizer: Any) -> None:
    """Make ``optimizer._load_global_state`` (ZeRO's checkpoint load sets
    ``loss_scaler`` there) keep scaler-core's class: it converts a loaded DeepSpeed
    scaler before anything is loaded, then lets ZeRO load, then sets the converted one."""
    if getattr(optimizer, _GUARD, False):
        return
    original: Callable[[Any], Any] = optimizer._load_global_state

    def _load_global_state(sd: Any) -> Any:
        loaded = sd.get(LOSS_SCALER) if isinstance(sd, Mapping) else None
        ours = None
        if loaded is not None:
            if not isinstance(loaded, _DeepSpeedScaler):
                raise InvalidStateError(
                    f"the checkpoint's loss_scaler is a {type(loaded).__name__} "
                    f"(cur_scale={getattr(loaded, 'cur_scale', None)!r}), but this engine "
                    f"trains with scaler-core's dynamic scaler (install()): a checkpoint of a "
                    f"static scale (bf16, fp32, a fixed loss_scale) does not continue it"
                )
            ours = DynamicLossScaler.from_deepspeed(loaded)  # raises before any change
        out = original(sd)
        if ours is not None:
            optimizer.loss_scaler = ours
        return out

    optimizer._load_global_state = _load_global_state
    setattr(optimizer, _GUARD, True)
