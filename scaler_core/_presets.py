"""Presets: configs that reproduce the well-known loss scalers, with their sources.

Each factory takes the anchor's own parameter names and defaults and returns a
:class:`ScalerConfig` whose trajectories equal the anchor's step by step, except
where noted in :attr:`PresetInfo.differences` (chiefly: scaler-core refuses a
scale that would become 0, subnormal or infinite, where some anchors carry on).
Differential tests drive each preset and the real package side by side on the
CPU (PyTorch, DeepSpeed, Megatron-LM, Paddle, jmp, flax, Keras); apex, which does
not install without CUDA, is checked against a re-statement of its rule.

Every factory also takes scaler-core's own ``spike_threshold=None`` and
``spike_window=128`` (spike skipping, off by default; no anchor has it in its
scaler: OLMo-core and levanter skip spikes in the optimizer), passed to the
config unchanged: ``preset("megatron", spike_threshold=6.0)``.

>>> preset("deepspeed").hysteresis
2
>>> preset("flax").growth_interval  # flax grows on the 2001st clean step
2001
>>> sorted(PRESETS)
['apex', 'deepspeed', 'flax', 'jmp', 'keras', 'megatron', 'paddle', 'paddle_static', 'torch']
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from ._config import ScalerConfig
from ._errors import InvalidArgumentError, InvalidConfigError
from ._f32 import FLT_MIN, f32

__all__ = ["PRESETS", "PresetInfo", "config_for", "preset"]


@dataclasses.dataclass(frozen=True)
class PresetInfo:
    """What a preset reproduces and where it differs.

    Attributes:
        name: The preset's name, as :func:`preset` takes it.
        anchor: The class or function reproduced.
        source: Where its rule lives (file in the anchor's repository).
        factory: Builds the config from the anchor's own parameter names.
        differences: What scaler-core does differently, in plain words.
    """

    name: str
    anchor: str
    source: str
    factory: Callable[..., ScalerConfig]
    differences: str


#: ``math.frexp`` gives this mantissa exactly for the powers of two.
_POWER_OF_TWO_MANTISSA = 0.5


def _power_of_two_factor(name: str, value: float) -> float:
    """``1 / value`` when dividing by ``value`` equals multiplying by it exactly."""
    mant, _ = math.frexp(float(value))
    if value <= 1.0 or not math.isfinite(value) or mant != _POWER_OF_TWO_MANTISSA:
        raise InvalidConfigError(
            f"{name}={value!r}, but it must be a power of two > 1 (2.0, 4.0, ...): the "
            f"anchor divides the scale by it, which only a power of two makes exact in float32"
        )
    return 1.0 / float(value)


def torch(
    *,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    spike_threshold: float | None = None,
    spike_window: int = 128,
) -> ScalerConfig:
    """``torch.amp.GradScaler`` (``torch._amp_update_scale_``)."""
    return ScalerConfig(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        spike_threshold=spike_threshold,
        spike_window=spike_window,
    )


def megatron(
    *,
    initial_scale: float = 2.0**32,
    min_scale: float = 1.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    spike_threshold: float | None = None,
    spike_window: int = 128,
) -> ScalerConfig:
    """Megatron-LM's ``DynamicGradScaler`` with the defaults of its arguments
    (``--initial-loss-scale 2**32 --min-loss-scale 1 --loss-scale-window 1000
    --hysteresis 2``).

    Megatron keeps the scale, the floor and both factors in float32 tensors, so
    they are rounded to float32 here as it rounds them (``backoff_factor=0.9`` is
    used as ``0.8999999761581421``).
    """
    return ScalerConfig(
        init_scale=f32(initial_scale),
        min_scale=f32(min_scale),
        growth_factor=f32(growth_factor),
        backoff_factor=f32(backoff_factor),
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        hysteresis_refill="on_growth",
        spike_threshold=spike_threshold,
        spike_window=spike_window,
    )


#: The first DeepSpeed release whose DynamicLossScaler grows after scale_window + 1
#: clean steps and has no scale_factor argument (its factor is 2).
_DEEPSPEED_STABLE_INTERVAL = (0, 17, 1)


def _release(name: str, value: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(p) for p in value.split("."))
    except (AttributeError, ValueError):
        parts = ()
    if not 1 <= len(parts) <= 3:  # noqa: PLR2004 - major.minor.patch
        raise InvalidConfigError(
            f"{name}={value!r}, but it must be None (the current release) or a release "
            f"number such as '0.17.0'"
        )
    return parts


def deepspeed(
    *,
    init_scale: float = 2.0**16,
    scale_window: int = 1000,
    min_scale: float = 1.0,
    delayed_shift: int = 2,
    consecutive_hysteresis: bool = False,
    raise_error_at_min_scale: bool = True,
    scale_factor: float = 2.0,
    version: str | None = None,
    spike_threshold: float | None = None,
    spike_window: int = 128,
) -> ScalerConfig:
    """DeepSpeed's ``DynamicLossScaler`` (ZeRO's scaler) as its fp16 config builds it:
    ``initial_scale_power=16``, ``loss_scale_window=1000``, ``hysteresis`` →
    ``delayed_shift`` = 2, ``min_loss_scale`` = 1.

    Since 0.17.1 (the default, ``version=None``) it grows first after
    ``scale_window + 1`` clean steps following an overflow (or the start), then
    every ``scale_window`` (``growth_delay=1``), and its factor is 2 (the class
    takes no ``scale_factor``). ``version="0.17.0"`` (or any earlier release)
    gives the older rule: growth every ``scale_window`` clean steps, and any
    power-of-two ``scale_factor``.
    """
    current = version is None or _release("version", version) >= _DEEPSPEED_STABLE_INTERVAL
    if current and scale_factor != 2.0:  # noqa: PLR2004 - the class's fixed factor
        raise InvalidConfigError(
            f"scale_factor={scale_factor!r}, but DeepSpeed's DynamicLossScaler has no "
            f"scale_factor since 0.17.1 (its factor is 2.0); pass version='0.17.0' for the "
            f"older class that took one"
        )
    return ScalerConfig(
        init_scale=init_scale,
        growth_factor=scale_factor,
        backoff_factor=_power_of_two_factor("scale_factor", scale_factor),
        growth_interval=scale_window,
        growth_delay=1 if current else 0,
        min_scale=min_scale,
        at_min_scale="raise" if raise_error_at_min_scale else "hold",
        hysteresis=delayed_shift,
        hysteresis_refill="on_clean_step" if consecutive_hysteresis else "on_growth",
        spike_threshold=spike_threshold,
        spike_window=spike_window,
    )


def jmp(
    *,
    loss_scale: float = 2.0**15,
    period: int = 2000,
    factor: float = 2.0,
    min_loss_scale: float = 1.0,
    spike_threshold: float | None = None,
    spike_window: int = 128,
) -> ScalerConfig:
    """``jmp.DynamicLossScale`` (``loss_scale`` 2**15 as its docstring uses)."""
    return ScalerConfig(
        init_scale=loss_scale,
        growth_factor=factor,
        backoff_factor=_power_of_two_factor("factor", factor),
        growth_interval=period,
        min_scale=min_loss_scale,
        spike_threshold=spike_threshold,
        spike_window=spike_window,
    )


def flax(
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    scale: float = 65536.0,
    minimum_scale: float | None = FLT_MIN,
    spike_threshold: float | None = None,
    spike_window: int = 128,
) -> ScalerConfig:
    """``flax.training.dynamic_scale.DynamicScale``.

    flax grows when its ``fin_steps`` *equals* ``growth_interval``, i.e. on the
    ``growth_interval + 1``-th clean step, and clamps growth at the largest
    float32 instead of refusing it. Its gradients are float32 whatever their
    dtype; scaler-core keeps the dtype (see ``PRESETS["flax"].differences``):
    cast the scaled gradients to float32 before unscaling to get flax's. The
    factors and the floor are rounded to float32, as JAX rounds them.
    """
    return ScalerConfig(
        init_scale=scale,
        # Python floats meet the float32 scale in JAX as float32 (weak types).
        growth_factor=f32(growth_factor),
        backoff_factor=f32(backoff_factor),
        growth_interval=growth_interval + 1,
        min_scale=None if minimum_scale is None else f32(minimum_scale),
        at_max_scale="clamp",
        spike_threshold=spike_threshold,
        spike_window=spike_window,
    )


def keras(
    *,
    initial_scale: float = 2.0**15,
    dynamic_growth_steps: int = 2000,
    spike_threshold: float | None = None,
    spike_window: int = 128,
) -> ScalerConfig:
    """Keras 3 ``keras.optimizers.LossScaleOptimizer`` (factors 2 and 0.5, fixed)."""
    return ScalerConfig(
        init_scale=initial_scale,
        growth_interval=dynamic_growth_steps,
        spike_threshold=spike_threshold,
        spike_window=spike_window,
    )


def paddle(
    *,
    init_loss_scaling: float = 2.0**16,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.5,
    incr_every_n_steps: int = 2000,
    decr_every_n_nan_or_inf: int = 1,
    spike_threshold: float | None = None,
    spike_window: int = 128,
) -> ScalerConfig:
    """``paddle.amp.GradScaler`` in dygraph mode (Paddle's default), ``GradScaler._update``.

    Paddle multiplies its float32 scale by the ratios as float32, so they are
    rounded here as Paddle rounds them (``decr_ratio=0.8`` is used as
    ``0.800000011920929``). A backoff has no floor, and a growth is not checked:
    see :data:`PRESETS` for the static graph's ``update_loss_scaling`` operator
    (``paddle_static``), which has both.
    """
    return ScalerConfig(
        init_scale=f32(init_loss_scaling),
        growth_factor=f32(incr_ratio),
        backoff_factor=f32(decr_ratio),
        growth_interval=incr_every_n_steps,
        hysteresis=decr_every_n_nan_or_inf,
        hysteresis_refill="on_clean_step_or_backoff",
        spike_threshold=spike_threshold,
        spike_window=spike_window,
    )


def paddle_static(
    *,
    init_loss_scaling: float = 2.0**16,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.5,
    incr_every_n_steps: int = 2000,
    decr_every_n_nan_or_inf: int = 1,
    spike_threshold: float | None = None,
    spike_window: int = 128,
) -> ScalerConfig:
    """Paddle's ``update_loss_scaling`` operator: static-graph AMP
    (``paddle.static.amp.decorate(..., level=...)``, whose defaults these are),
    and ``GradScaler`` under PIR. Unlike dygraph's ``GradScaler`` it never backs off below 1 and
    keeps the scale when a growth is not finite.
    """
    return ScalerConfig(
        init_scale=f32(init_loss_scaling),
        growth_factor=f32(incr_ratio),
        backoff_factor=f32(decr_ratio),
        growth_interval=incr_every_n_steps,
        min_scale=1.0,
        hysteresis=decr_every_n_nan_or_inf,
        hysteresis_refill="on_clean_step_or_backoff",
        spike_threshold=spike_threshold,
        spike_window=spike_window,
    )


def apex(
    *,
    init_scale: float = 2.0**16,
    scale_window: int = 2000,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
    spike_threshold: float | None = None,
    spike_window: int = 128,
) -> ScalerConfig:
    """NVIDIA apex ``amp`` ``LossScaler`` (factors 2 and 0.5, fixed)."""
    return ScalerConfig(
        init_scale=init_scale,
        growth_interval=scale_window,
        # apex tests ``if self._min_loss_scale:``, so 0 means no floor.
        min_scale=min_loss_scale or None,
        max_scale=max_loss_scale,
        at_max_scale="clamp",
        spike_threshold=spike_threshold,
        spike_window=spike_window,
    )


_NO_COLLAPSE = (
    "A backoff that would leave the scale 0 or subnormal raises ScaleCollapseError "
    "(the anchor carries on with a useless scale)."
)
_INF_GROWTH = (
    "A growth past the largest float32 (from 2**127 by 2) is blocked: the scale stays "
    "(the anchor multiplies unchecked and reaches inf)."
)
_FLOAT32_CONFIG = (
    "A scale float32 cannot hold as a normal number (0, subnormal, above the largest "
    "float32) is refused by the config, where the anchor starts with it."
)

PRESETS: Mapping[str, PresetInfo] = MappingProxyType(
    {
        info.name: info
        for info in (
            PresetInfo(
                "torch",
                "torch.amp.GradScaler",
                "pytorch/pytorch aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp "
                "(_amp_update_scale_cpu_)",
                torch,
                "None in the trajectory (bit for bit). " + _NO_COLLAPSE + " " + _FLOAT32_CONFIG,
            ),
            PresetInfo(
                "megatron",
                "megatron.core.optimizer.grad_scaler.DynamicGradScaler",
                "NVIDIA/Megatron-LM megatron/core/optimizer/grad_scaler.py",
                megatron,
                "Megatron's hysteresis tracker counts down past 0 where ours stays at 1 "
                "(same decisions). Scales and factors are rounded to float32 as Megatron's "
                "tensors round them. " + _INF_GROWTH + " " + _FLOAT32_CONFIG,
            ),
            PresetInfo(
                "deepspeed",
                "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                "deepspeedai/DeepSpeed deepspeed/runtime/fp16/loss_scaler.py",
                deepspeed,
                "DeepSpeed keeps the scale as a float64 Python float: a growth past the "
                "largest float32 (from 2**127), which DeepSpeed makes, is blocked here (the "
                "scale stays), and a scale float32 cannot hold exactly (init_scale=0.1, a "
                "subnormal min_scale) is refused by the config. At the floor with "
                "raise_error_at_min_scale, DeepSpeed raises a bare Exception; we raise "
                "ScaleCollapseError at the same step and keep the state. version='0.17.0' "
                "(the older rule): only power-of-two scale_factor values are taken (dividing "
                "by them is then exact in float32 as in float64). The fused and unfused "
                "FP16_Optimizer paths (no ZeRO) have their own rule, without hysteresis: "
                "not reproduced.",
            ),
            PresetInfo(
                "jmp",
                "jmp.DynamicLossScale",
                "google-deepmind/jmp jmp/_src/loss_scale.py",
                jmp,
                "jmp divides by factor (only powers of two are accepted, so it is exact) "
                "and stores the scale in the dtype you pass; we store float32. " + _FLOAT32_CONFIG,
            ),
            PresetInfo(
                "flax",
                "flax.training.dynamic_scale.DynamicScale",
                "google/flax flax/training/dynamic_scale.py",
                flax,
                "None in the trajectory: its growth on the (N+1)-th clean step is "
                "growth_interval=N+1, its clamp at float32 max is at_max_scale='clamp', "
                "its default floor is float32 tiny, its factors and floor are float32. "
                + _NO_COLLAPSE.replace(
                    "0 or subnormal", "0 or subnormal (only with minimum_scale=None)"
                )
                + " In the gradients: flax casts every gradient to float32 and returns "
                "float32 gradients (checking those), where scaler-core keeps each "
                "gradient's dtype: float16 and bfloat16 are computed in float32 and "
                "written back in their dtype (values below the dtype's smallest "
                "subnormal become 0, values past its largest become inf and the step "
                "is skipped), and the check reads the written value; float64 stays "
                "float64. flax divides by the scale, which XLA compiles into a multiply "
                "by the reciprocal, scaler-core's f32(1/f64(scale)): the values agree. "
                "Cast the scaled gradients to float32 before unscaling (before "
                "tx.update) to get flax's gradients and flag bit for bit. " + _FLOAT32_CONFIG,
            ),
            PresetInfo(
                "keras",
                "keras.optimizers.LossScaleOptimizer (Keras 3)",
                "keras-team/keras keras/src/optimizers/loss_scale_optimizer.py",
                keras,
                _INF_GROWTH + " " + _NO_COLLAPSE + " " + _FLOAT32_CONFIG,
            ),
            PresetInfo(
                "paddle",
                "paddle.amp.GradScaler (dygraph)",
                "PaddlePaddle/Paddle python/paddle/amp/grad_scaler.py (AmpScaler._update)",
                paddle,
                "Ratios and the initial scale are float32, as Paddle stores them. Paddle's "
                "bad-step counter is hysteresis_refill='on_clean_step_or_backoff'. "
                + _INF_GROWTH
                + " "
                + _NO_COLLAPSE
                + " "
                + _FLOAT32_CONFIG,
            ),
            PresetInfo(
                "paddle_static",
                "paddle update_loss_scaling operator (static graph, PIR)",
                "PaddlePaddle/Paddle paddle/phi/kernels/impl/amp_kernel_impl.h",
                paddle_static,
                "None in the trajectory: ratios and the initial scale are float32, as Paddle "
                "stores them; its bad-step counter is "
                "hysteresis_refill='on_clean_step_or_backoff'; its floor of 1 is "
                "min_scale=1.0, and its kept scale at a non-finite growth is the default "
                "at_max_scale='block'. An initial scale below 1 (which the operator raises "
                "to 1 at the first backoff) is refused by the config (min_scale=1.0 > "
                "init_scale).",
            ),
            PresetInfo(
                "apex",
                "apex.amp.scaler.LossScaler",
                "NVIDIA/apex apex/amp/scaler.py",
                apex,
                "apex keeps the scale as a float64 Python float; with factor 2 the values "
                "are the same. " + _NO_COLLAPSE + " (without min_loss_scale)",
            ),
        )
    }
)


def preset(name: str, **kwargs: Any) -> ScalerConfig:
    """The config reproducing the scaler called ``name``.

    Args:
        name: One of :data:`PRESETS` (``torch``, ``megatron``, ``deepspeed``,
            ``jmp``, ``flax``, ``keras``, ``paddle``, ``paddle_static``, ``apex``).
        **kwargs: The anchor's own parameters, by its own names (for example
            ``preset("deepspeed", consecutive_hysteresis=True)``), and
            ``spike_threshold`` / ``spike_window`` to turn on spike skipping
            (see :class:`ScalerConfig`).

    Returns:
        A validated :class:`ScalerConfig`.

    Raises:
        InvalidConfigError: Unknown name or parameter, or an invalid value.

    >>> preset("deepspeed", raise_error_at_min_scale=False).at_min_scale
    'hold'
    """
    info = PRESETS.get(name)
    if info is None:
        raise InvalidConfigError(f"preset={name!r}, but it must be one of {sorted(PRESETS)}")
    params = list(inspect.signature(info.factory).parameters)
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise InvalidConfigError(
            f"preset {name!r} got unknown parameter(s) {unknown}, but it takes only "
            f"{params} (the anchor's own parameter names)"
        )
    return info.factory(**kwargs)


def config_for(config: object, *, example: str, no_spikes: str | None = None) -> ScalerConfig:
    """``config`` as the policy an integration runs: a :class:`ScalerConfig`, or the name
    of a preset; with ``no_spikes`` (why the framework gives the scaler no gradient
    norm), a config with spike skipping on is refused. The one check every integration's
    ``config=`` makes.

    Args:
        config: What the user passed as ``config=``.
        example: A config to name in the message (``"scaler_core.preset('megatron')"``).
        no_spikes: Why spike skipping cannot run here, or ``None`` where it can.

    Raises:
        InvalidArgumentError: ``config`` is neither; spike skipping is on where it
            cannot run.
        InvalidConfigError: ``config`` names no preset.

    >>> config_for("megatron", example="'megatron'").hysteresis
    2
    """
    if isinstance(config, str):
        config = preset(config)
    if not isinstance(config, ScalerConfig):
        raise InvalidArgumentError(
            f"config={config!r}, but it must be a ScalerConfig or a preset's name (for "
            f"example {example})"
        )
    if no_spikes is not None and config.spike_threshold is not None:
        raise InvalidArgumentError(
            f"config.spike_threshold={config.spike_threshold!r}, but it must be None here: "
            f"{no_spikes}"
        )
    return config
