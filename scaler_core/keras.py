"""Keras 3: scaler-core's rules in Keras's own ``LossScaleOptimizer``.

:class:`LossScaleOptimizer` subclasses ``keras.optimizers.LossScaleOptimizer``, so
``model.compile`` under the ``"mixed_float16"`` dtype policy takes it as it is
(Keras wraps an optimizer only when it is not already one of those). It keeps
Keras's variables (``dynamic_scale``, ``step_counter``), its loss scaling, its
finiteness check and its unscaling (``gradient / scale``); only the transition of
the scale is scaler-core's: the core rule (:func:`scaler_core.update`) run on
the Keras backend's own arrays, JAX (inside Keras's ``jit``) or torch, with no
host synchronisation.

With the defaults (the ``keras`` preset: ``initial_scale=2**15``,
``dynamic_growth_steps=2000``) the scale, the weights and the inner optimizer's
variables are Keras's bit for bit, until Keras's scale leaves float32's normal
range: where repeated non-finite steps halve Keras's scale to 0.0 (about 150
steps from 2**15; a scale of 0 unscales every gradient to inf or NaN, so Keras
never trains again and never says why), this optimizer refuses the backoff. It
records the failure in a Keras variable (``failure``), keeps the last valid
scale, skips that step and every later one, and the first host-side look
(:meth:`LossScaleOptimizer.check`, :meth:`~LossScaleOptimizer.scaler_state`,
:meth:`~LossScaleOptimizer.current_scale`) raises
:class:`~scaler_core.ScaleCollapseError`. A growth past the largest float32
(Keras reaches inf) is blocked: the scale stays.

``config=`` takes any :class:`~scaler_core.ScalerConfig` or preset name instead
(``config="torch"``, ``config=sc.preset("megatron")``): hysteresis, floors,
``max_consecutive_skips`` all run in the same Keras variables. Spike skipping
(``spike_threshold``) is not supported here.

The optimizer is registered as a Keras serializable (``"scaler_core>LossScaleOptimizer"``),
so ``keras.models.load_model`` rebuilds it from a ``.keras`` file once this module
is imported, and resumes bit for bit. Importing this module imports Keras; the
TensorFlow backend is refused (untested here).

>>> import keras, numpy as np
>>> from scaler_core.keras import LossScaleOptimizer
>>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.5), dynamic_growth_steps=2)
>>> w = keras.Variable(np.ones(2, np.float32))
>>> opt.apply([np.array([np.inf, 1.0], np.float32)], [w])  # skipped; the scale halves
>>> opt.current_scale(), w.value.tolist()
(16384.0, [1.0, 1.0])
>>> opt.apply([np.full(2, 16384.0, np.float32)], [w])  # unscaled to 1.0: w -= 0.5
>>> opt.apply([np.full(2, 16384.0, np.float32)], [w])  # 2nd clean step: the scale grows
>>> opt.current_scale(), w.value.tolist()
(32768.0, [0.0, 0.0])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import keras
from keras import ops

from ._api import update
from ._backend import backend_for
from ._config import ScalerConfig
from ._errors import InvalidArgumentError
from ._presets import config_for, preset
from ._registration import static_data
from ._state import DATA_FIELDS, FLOAT_FIELDS, ScalerState, init, step_skipped

__all__ = ["LossScaleOptimizer"]

#: The fields of the state that Keras's own variables hold (its names).
_KERAS_NAMES = {"scale": "dynamic_scale", "growth_tracker": "step_counter"}
#: The base class's defaults, for the arguments left out.
_KERAS_DEFAULTS = {"initial_scale": 2.0**15, "dynamic_growth_steps": 2000}


def _resolve(
    config: ScalerConfig | str | None, initial_scale: Any, dynamic_growth_steps: Any
) -> ScalerConfig:
    """The config from ``config=`` and Keras's own arguments (through the ``keras`` preset).

    Raises:
        InvalidArgumentError: ``config`` is neither a ScalerConfig nor a preset name,
            Keras's arguments disagree with it, or it sets ``spike_threshold``.
        InvalidConfigError: Keras's arguments make no valid config (the preset says why).
    """
    if config is None:
        given = {
            "initial_scale": _KERAS_DEFAULTS["initial_scale"]
            if initial_scale is None
            else initial_scale,
            "dynamic_growth_steps": _KERAS_DEFAULTS["dynamic_growth_steps"]
            if dynamic_growth_steps is None
            else dynamic_growth_steps,
        }
        cfg = preset("keras", **given)
    else:
        cfg = config_for(
            config,
            example="config='keras', config=scaler_core.preset('torch')",
            no_spikes="Keras gives the optimizer no gradient norm",
        )
    for name, value, own in (
        ("initial_scale", initial_scale, cfg.init_scale),
        ("dynamic_growth_steps", dynamic_growth_steps, cfg.growth_interval),
    ):
        if config is not None and value is not None and value != own:
            raise InvalidArgumentError(
                f"{name}={value!r}, but config= sets it to {own!r}; pass one of them (Keras's "
                f"arguments go through the keras preset: config=scaler_core.preset('keras', "
                f"{name}={value!r}))"
            )
    if cfg.spike_threshold is not None:  # the keras preset given spike skipping
        config_for(cfg, example="", no_spikes="Keras gives the optimizer no gradient norm")
    return cfg


@keras.saving.register_keras_serializable(package="scaler_core", name="LossScaleOptimizer")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):  # type: ignore[misc]
    """Keras's ``LossScaleOptimizer`` with scaler-core's transition (see the module docstring).

    Args:
        inner_optimizer: The ``keras.optimizers.Optimizer`` to wrap.
        initial_scale: Keras's argument (default ``2**15``), through the ``keras``
            preset; with ``config=`` it must be left out or equal the config's.
        dynamic_growth_steps: Keras's argument (default 2000), likewise.
        name: The optimizer's name, as Keras takes it.
        config: A :class:`~scaler_core.ScalerConfig` (a preset's) or a preset name;
            the ``keras`` preset of the two arguments above when omitted.
        **kwargs: Keras's other arguments (it refuses all but its defaults).

    Raises:
        InvalidArgumentError: A bad ``config``, Keras's arguments disagreeing with
            it, spike skipping, or the TensorFlow backend. Raised before anything
            (the inner optimizer included) is changed.
        InvalidConfigError: ``initial_scale`` or ``dynamic_growth_steps`` is out of
            range (``initial_scale=1e-40`` is subnormal in float32).
    """

    def __init__(
        self,
        inner_optimizer: Any,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        name: str | None = None,
        *,
        config: ScalerConfig | str | None = None,
        **kwargs: Any,
    ) -> None:
        if keras.backend.backend() == "tensorflow":
            raise InvalidArgumentError(
                "keras.backend.backend()='tensorflow', but scaler_core.keras supports the "
                "jax and torch backends (set KERAS_BACKEND before importing keras)"
            )
        cfg = _resolve(config, initial_scale, dynamic_growth_steps)
        super().__init__(
            inner_optimizer,
            initial_scale=cfg.init_scale,
            dynamic_growth_steps=cfg.growth_interval,
            name=name,
            **kwargs,
        )
        self._scaler_config = cfg
        start = init(cfg)
        held = static_data(start)
        #: The state's fields held in variables, in the core's order, with their start.
        self._scaler_fields = {n: getattr(start, n) for n in DATA_FIELDS if n not in held}

    @property
    def config(self) -> ScalerConfig:
        """The :class:`~scaler_core.ScalerConfig` this optimizer runs."""
        return self._scaler_config

    def build(self, var_list: Any) -> None:
        """Keras's variables, then one int32 variable per other field of the state."""
        super().build(var_list)
        for field, start in self._scaler_fields.items():
            if field not in _KERAS_NAMES:
                self.add_variable(
                    shape=(),
                    dtype="int32",
                    initializer=keras.initializers.Constant(start),
                    aggregation="none",
                    name=field,
                )

    def _field_variables(self) -> dict[str, Any]:
        by_name = {v.name: v for v in self._variables}
        return {f: by_name[_KERAS_NAMES.get(f, f)] for f in self._scaler_fields}

    def _state_of(self, read: Callable[[Any, str], Any]) -> ScalerState:
        values = {
            f: read(v, "float32" if f in FLOAT_FIELDS else "int32")
            for f, v in self._field_variables().items()
        }
        return ScalerState(self._scaler_config, **values)

    def _step(self, grads: list[Any], trainable_variables: Any) -> tuple[Any, list[Any]]:
        """Keras's check and unscale, then the core's transition, written to the variables.

        Returns ``(skip, unscaled)``: whether the inner optimizer must not step (a
        0-d boolean tensor of the backend) and the gradients divided by the scale
        of this step (before the transition), as Keras divides them.
        """
        found = ops.logical_not(self.check_finite(grads))
        tvs = trainable_variables or self._trainable_variables
        scale = self.dynamic_scale
        unscaled = [
            g if g is None or self._overwrite_variable_with_gradient(v) else ops.divide(g, scale)
            for g, v in zip(grads, tvs, strict=True)
        ]
        old = self._state_of(lambda v, dtype: ops.cast(ops.convert_to_tensor(v), dtype))
        new = update(old, found)
        xp = backend_for(old.scale, root="state.scale").namespace(old.scale)
        # A host library (Keras's NumPy backend) answers with a bool; a device one with
        # a 0-d boolean array, with no host synchronisation.
        skip = step_skipped(new, None if xp.on_host else xp)
        for field, variable in self._field_variables().items():
            variable.assign(getattr(new, field))
        return skip, unscaled

    def stateless_apply(
        self, optimizer_variables: Any, grads: Any, trainable_variables: Any
    ) -> tuple[list[Any], list[Any]]:
        """Keras's stateless step (the JAX backend's ``fit``), with the core's transition."""
        if not self.built:  # Keras's message; a ValueError, as Keras's
            raise InvalidArgumentError(
                f"To call `stateless_apply`, {self.__class__.__name__} must be built (i.e. its "
                f"variables must have been created). You can build it via "
                f"`optimizer.build(trainable_variables)`."
            )
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            skip, unscaled = self._step(list(grads), None)
        own = [scope.get_current_value(v) for v in self._variables]
        inner = list(optimizer_variables[len(self._variables) :])

        def keep() -> tuple[list[Any], list[Any]]:
            return list(trainable_variables), inner

        def apply() -> tuple[list[Any], list[Any]]:
            new_tvs, new_inner = self.inner_optimizer.stateless_apply(
                inner, unscaled, trainable_variables
            )
            return list(new_tvs), list(new_inner)

        new_tvs, new_inner = ops.cond(skip, keep, apply)
        return list(new_tvs), own + list(new_inner)

    def _common_apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Keras's stateful step (the torch backend), with the core's transition."""
        skip, unscaled = self._step(list(grads), trainable_variables)

        def apply() -> None:
            self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)

        if keras.backend.backend() == "jax":
            # An eager step on JAX (fit takes stateless_apply): lax.cond would trace the
            # stateful branch and leak its tracers into the variables, as it does with
            # Keras's own class; the flag is concrete here, so branch in Python.
            if not bool(skip):
                apply()
        else:
            ops.cond(skip, lambda: None, apply)

    # ------------------------------------------------------------ host-side looks
    def scaler_state(self) -> ScalerState:
        """The scaler's state as Python numbers, read from the variables.

        Under the JAX backend, inside ``fit``, Keras holds the current values apart
        from the variables: call ``model.jax_state_sync()`` first (Keras does at
        the end of each epoch).

        Raises:
            ScaleCollapseError: A refused backoff is recorded (the scale would have
                become 0 or subnormal), or a floor set to raise was hit.
            SkipLimitError: ``max_consecutive_skips`` was passed.
            InvalidArgumentError: The optimizer is not built yet (no step taken).
        """
        if not self.built:
            raise InvalidArgumentError(
                f"{self.name} is not built, so it has no state yet; call "
                f"optimizer.build(model.trainable_variables) or take a step first"
            )

        def read(variable: Any, dtype: str) -> Any:
            value = variable.value.item()  # jax, torch and numpy arrays alike
            return float(value) if dtype == "float32" else int(value)

        return self._state_of(read).check()

    def check(self) -> None:
        """Raise the failure a step recorded (see :meth:`scaler_state`); nothing otherwise."""
        self.scaler_state()

    def current_scale(self) -> float:
        """The scale as a Python float, after :meth:`check`."""
        scale: float = self.scaler_state().scale
        return scale

    def get_config(self) -> dict[str, Any]:
        """Keras's config, plus the scaler's (``"config"``)."""
        out: dict[str, Any] = super().get_config()
        out["config"] = self._scaler_config.to_dict()
        return out

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], custom_objects: Any = None
    ) -> LossScaleOptimizer:
        """Rebuild from :meth:`get_config` (``keras.models.load_model`` calls it)."""
        config = dict(config)
        scaler = config.pop("config", None)
        if isinstance(scaler, Mapping):
            config["config"] = ScalerConfig(**scaler)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
