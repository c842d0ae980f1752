"""The frozen, validated scaler configuration.

Validation happens in the constructor with explicit raises (never ``assert``,
which ``python -O`` strips), so ``dataclasses.replace`` re-validates too. Every
message names the field, the value seen and what is accepted.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Literal

from ._errors import InvalidConfigError
from ._f32 import FLT_MAX, FLT_MIN, INT32_MAX, f32

__all__ = ["SPIKE_WINDOW_MAX", "AtMaxScale", "AtMinScale", "HysteresisRefill", "ScalerConfig"]

AtMinScale = Literal["hold", "raise"]
AtMaxScale = Literal["block", "clamp"]
HysteresisRefill = Literal["on_growth", "on_clean_step", "on_clean_step_or_backoff"]

_AT_MIN_SCALE = ("hold", "raise")
_AT_MAX_SCALE = ("block", "clamp")
_HYSTERESIS_REFILL = ("on_growth", "on_clean_step", "on_clean_step_or_backoff")

#: The longest spike window: every count up to it is exact in float32, so the
#: weight ``1 / n`` is the same float32 on the host and on every device.
SPIKE_WINDOW_MAX = 2**24
#: The range of spike thresholds whose square is a normal float32 (so that
#: ``k**2 * variance`` never turns a zero variance into NaN).
_SPIKE_LOW = 1.1e-19
_SPIKE_HIGH = 1.8e19


#: An int longer than this is described in messages, not printed: no float holds it
#: (the largest is below 2**1024), and Python refuses to print more than 4300 digits.
_SHOWN_BITS = 1024


def shown(value: object) -> str:
    """``repr(value)`` for a message; an int beyond every float is described by its size.

    >>> shown(2.5), shown(10**400)
    ('2.5', 'an int of 1329 bits')
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _SHOWN_BITS:
        return f"{'a negative' if value < 0 else 'an'} int of {value.bit_length()} bits"
    return repr(value)


def _fail(name: str, value: object, must: str) -> InvalidConfigError:
    return InvalidConfigError(f"{name}={shown(value)}, but it must be {must}")


def _real(name: str, value: object, must: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, value, must)
    try:
        out = float(value)
    except (OverflowError, ValueError):
        raise _fail(name, value, must) from None
    if not math.isfinite(out):
        raise _fail(name, value, must)
    return out


def _int(name: str, value: object, low: int, must: str, high: int = INT32_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, value, must)
    out = int(value)
    if not low <= out <= high:
        raise _fail(name, value, must)
    return out


def _scale(name: str, value: object) -> float:
    must = f"a finite float32 normal number in [{FLT_MIN!r}, {FLT_MAX!r}]"
    exact = _real(name, value, must)
    out = f32(exact)
    if not FLT_MIN <= out <= FLT_MAX:
        raise _fail(name, value, must)
    if out != exact:
        # One rule for every number the float32 state holds (scales and factors):
        # exactly a float32, never silently rounded.
        raise _fail(name, value, f"exactly representable in float32; use {out!r}")
    return out


def _choice(name: str, value: object, choices: tuple[str, ...], must: str) -> str:
    if not isinstance(value, str) or value not in choices:
        raise _fail(name, value, must)
    return value


def _factor(name: str, value: object, low: float, high: float, interval: str) -> float:
    must = f"a finite number in {interval}"
    out = _real(name, value, must)
    if not (low < out < high and out <= FLT_MAX):
        raise _fail(name, value, must)
    # A factor need not be a float32 (PyTorch takes backoff_factor=0.9): every product
    # is formed as PyTorch forms it, in float64, and rounded once to the float32 scale.
    # Only JAX without jax_enable_x64 cannot, and refuses such a factor there.
    return out


@dataclasses.dataclass(frozen=True)
class ScalerConfig:
    """How the loss scale evolves. Frozen; validated when built.

    The defaults reproduce ``torch.amp.GradScaler`` exactly. Scales are stored
    as float32 values (as PyTorch stores them), so ``init_scale=0.1`` is kept as
    ``0.10000000149011612``.

    Args:
        init_scale: The first scale. A finite, normal float32 value.
        growth_factor: Multiplier applied after ``growth_interval`` clean steps.
            Finite, > 1.0, exactly representable in float32.
        backoff_factor: Multiplier applied on a backoff. In (0.0, 1.0), exactly
            representable in float32.
        growth_interval: Consecutive clean steps before the scale grows (>= 1).
        min_scale: Optional floor (jmp, flax, DeepSpeed, Megatron). A backoff
            never goes below it.
        max_scale: Optional ceiling (apex, MXNet). The scale never grows past it.
        at_min_scale: What a backoff does when the scale already sits at
            ``min_scale``: ``"hold"`` keeps it there, ``"raise"`` fails closed
            with :class:`ScaleCollapseError` (DeepSpeed's
            ``raise_error_at_min_scale``). Needs ``min_scale``.
        at_max_scale: What a due growth does when ``scale * growth_factor``
            is non-finite or above the ceiling (``max_scale``, or the largest
            float32 without one): ``"block"`` keeps the scale (PyTorch, jmp,
            Paddle), ``"clamp"`` sets it to the ceiling (apex's
            ``min(max_loss_scale, scale * 2)``, flax's
            ``minimum(scale * growth_factor, finfo(float32).max)``).
        hysteresis: Overflows needed before a backoff (Megatron, DeepSpeed
            ``delayed_shift``); 1 (the default) backs off on every overflow.
        hysteresis_refill: When the hysteresis budget refills: ``"on_growth"``
            (Megatron and DeepSpeed's default), ``"on_clean_step"`` (DeepSpeed's
            ``consecutive_hysteresis=True``) or ``"on_clean_step_or_backoff"``
            (Paddle's ``decr_every_n_nan_or_inf``: every clean step and every
            backoff refill it).
        max_consecutive_skips: Optional limit on consecutive skipped steps; the
            step past it fails closed with :class:`SkipLimitError`.
        dynamic: ``False`` holds the scale at ``init_scale`` forever (a static
            scale) while non-finite gradients are still detected and skipped.
        spike_threshold: Spike skipping (off by default, ``None``): ``k``, the
            number of standard deviations above the rolling mean of recent
            gradient norms past which a step is skipped (OLMo-core's
            ``SkipStepAdamW``, levanter's skip-step option). A finite number
            > 0 whose square is a normal float32. Needs the step's gradient norm
            in :func:`scaler_core.update` (``grad_norm=``).
        spike_window: How many recent steps the rolling statistics follow
            (an exponential window that starts as a plain average); detection
            starts once this many steps were seen. An int in [2, 2**24] (the
            step weight ``1 / n`` is then exact on every device).
        growth_delay: Clean steps right after a non-finite step (and at the
            start) that do not count toward ``growth_interval``: the first growth
            after an overflow comes after ``growth_interval + growth_delay`` clean
            steps, later ones every ``growth_interval`` (DeepSpeed >= 0.17.1
            counts so: 1). 0 (the default) counts every clean step, as PyTorch.
            An int in [0, 2**31 - 1 - growth_interval].

    Raises:
        InvalidConfigError: A field is out of range or of the wrong type.

    >>> ScalerConfig().growth_interval
    2000
    >>> try:
    ...     ScalerConfig(growth_interval=0)
    ... except ValueError as e:
    ...     print(e)
    growth_interval=0, but it must be an int in [1, 2147483647]
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    max_scale: float | None = None
    at_min_scale: AtMinScale = "hold"
    at_max_scale: AtMaxScale = "block"
    hysteresis: int = 1
    hysteresis_refill: HysteresisRefill = "on_growth"
    max_consecutive_skips: int | None = None
    dynamic: bool = True
    spike_threshold: float | None = None
    spike_window: int = 128
    growth_delay: int = 0

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "init_scale", _scale("init_scale", self.init_scale))
        put(
            self,
            "growth_factor",
            _factor("growth_factor", self.growth_factor, 1.0, math.inf, f"(1.0, {FLT_MAX!r}]"),
        )
        put(
            self,
            "backoff_factor",
            _factor(
                "backoff_factor", self.backoff_factor, 0.0, 1.0, "the open interval (0.0, 1.0)"
            ),
        )
        put(
            self,
            "growth_interval",
            _int("growth_interval", self.growth_interval, 1, f"an int in [1, {INT32_MAX}]"),
        )
        if self.min_scale is not None:
            put(self, "min_scale", _scale("min_scale", self.min_scale))
            if self.min_scale > self.init_scale:
                raise _fail("min_scale", self.min_scale, f"<= init_scale={self.init_scale!r}")
        if self.max_scale is not None:
            put(self, "max_scale", _scale("max_scale", self.max_scale))
            if self.max_scale < self.init_scale:
                raise _fail("max_scale", self.max_scale, f">= init_scale={self.init_scale!r}")
        _choice("at_min_scale", self.at_min_scale, _AT_MIN_SCALE, "'hold' or 'raise'")
        if self.at_min_scale == "raise" and self.min_scale is None:
            raise _fail(
                "at_min_scale",
                self.at_min_scale,
                "'hold' unless min_scale is set (there is no floor)",
            )
        _choice("at_max_scale", self.at_max_scale, _AT_MAX_SCALE, "'block' or 'clamp'")
        put(
            self,
            "hysteresis",
            _int("hysteresis", self.hysteresis, 1, f"an int in [1, {INT32_MAX}]"),
        )
        _choice(
            "hysteresis_refill",
            self.hysteresis_refill,
            _HYSTERESIS_REFILL,
            "'on_growth', 'on_clean_step' or 'on_clean_step_or_backoff'",
        )
        if self.max_consecutive_skips is not None:
            put(
                self,
                "max_consecutive_skips",
                _int(
                    "max_consecutive_skips",
                    self.max_consecutive_skips,
                    0,
                    f"None or an int in [0, {INT32_MAX}]",
                ),
            )
        if not isinstance(self.dynamic, bool):
            raise _fail("dynamic", self.dynamic, "a bool")
        if self.spike_threshold is not None:
            must = (
                f"None or a finite number > 0 whose square is a normal float32 "
                f"(in [{_SPIKE_LOW!r}, {_SPIKE_HIGH!r}])"
            )
            k = _real("spike_threshold", self.spike_threshold, must)
            if not _SPIKE_LOW <= k <= _SPIKE_HIGH or not FLT_MIN <= f32(k * k) <= FLT_MAX:
                raise _fail("spike_threshold", self.spike_threshold, must)
            put(self, "spike_threshold", k)
        put(
            self,
            "spike_window",
            _int(
                "spike_window",
                self.spike_window,
                2,
                f"an int in [2, {SPIKE_WINDOW_MAX}]",
                high=SPIKE_WINDOW_MAX,
            ),
        )

        put(
            self,
            "growth_delay",
            _int(
                "growth_delay",
                self.growth_delay,
                0,
                f"an int in [0, {INT32_MAX - self.growth_interval}] (growth_interval + "
                f"growth_delay must fit an int32 counter)",
                high=INT32_MAX - self.growth_interval,
            ),
        )

    @classmethod
    def static(cls, scale: float = 1.0, **kwargs: Any) -> ScalerConfig:
        """A fixed scale that never changes; non-finite steps are still skipped.

        ``ScalerConfig.static()`` (scale 1.0) is the no-op mode for bfloat16 or
        float32 training: nothing is multiplied, non-finite gradients are still
        detected and the step skipped.

        >>> ScalerConfig.static(1024.0).dynamic
        False
        """
        return cls(init_scale=scale, dynamic=False, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict (``ScalerConfig(**d)`` rebuilds it)."""
        return dataclasses.asdict(self)
