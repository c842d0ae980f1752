"""MLX integration: device states, the scaled loss, and the skipped step inside ``mx.compile``.

Importing this module imports MLX (``import scaler_core`` alone never does).

* :func:`to_device` puts a host state on MLX as 0-d float32/int32 arrays, so the
  transition (:func:`scaler_core.update` with the flag of
  :func:`scaler_core.unscale`) runs as MLX operations, with nothing read back.
* :class:`StateCell` holds a state as a dict of MLX arrays, to pass to
  ``mx.compile``'s ``inputs=`` and ``outputs=`` beside ``model.state`` and
  ``optimizer.state`` (a compiled function takes trees of arrays, not a
  :class:`~scaler_core.ScalerState`).
* :func:`scaled_value_and_grad` is ``nn.value_and_grad`` of the loss times the
  state's scale: the loss as computed, and the scaled gradients.
* :func:`optimizer_update` is ``optimizer.update(model, grads)``, except that on a
  skipped step the parameters and the optimizer's state keep their bits (the
  update is computed, then the old values selected on the device).

A training step, compiled once::

    cell = StateCell(sc.init(config))
    captured = [model.state, optimizer.state, cell]
    loss_and_grad = scaled_value_and_grad(model, loss_fn)

    @partial(mx.compile, inputs=captured, outputs=captured)
    def step(x, y):
        loss, grads = loss_and_grad(cell.state, model, x, y)
        grads, found = sc.unscale(grads, cell.state)
        cell.state = sc.update(cell.state, found)
        optimizer_update(optimizer, model, grads, cell.state)
        return loss

>>> import mlx.core as mx
>>> import scaler_core as sc
>>> from scaler_core.mlx import to_device
>>> state = to_device(sc.init())
>>> grads, found = sc.unscale({"w": mx.array([65536.0, float("inf")])}, state)
>>> state = sc.update(state, found)
>>> grads["w"][0].item(), state.current_scale(), state.skipped_steps.item()
(1.0, 32768.0, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mlx.nn.layers.base import Module
from mlx.nn.utils import value_and_grad as nn_value_and_grad

from ._errors import InvalidArgumentError
from ._ops import as_flag
from ._registration import static_data
from ._state import DATA_FIELDS, ScalerState, require_state, step_skipped
from .backend_kit import state_on
from .backends._mlx import BACKEND, NAMESPACE

__all__ = ["StateCell", "optimizer_update", "scaled_value_and_grad", "to_device"]


def to_device(state: ScalerState) -> ScalerState:
    """``state`` with a 0-d float32 scale and 0-d int32 counters (MLX arrays).

    Use it once before the training loop: from then on :func:`scaler_core.update`
    with an MLX flag keeps the state on MLX with no host synchronisation. Nothing is
    read back: a recorded failure moves with the state and raises at the first
    host-side look (``state.check()``, ``current_scale()``, ``to_dict``). With spike
    skipping off, the window statistics stay Python numbers: they never change
    then, and a compiled step does not carry them (as under JAX).

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`~scaler_core.ScalerState`.
    """
    return state_on(NAMESPACE, state)


class StateCell(dict):  # type: ignore[type-arg]
    """A :class:`~scaler_core.ScalerState` kept as a dict of MLX arrays, for ``mx.compile``.

    A compiled function takes and returns trees of arrays; a function that updates
    state in place lists that state in ``inputs=`` and ``outputs=`` (MLX's
    ``model.state`` and ``optimizer.state`` are such dicts). This cell is one for the
    scaler: read :attr:`state` at the start of the step, assign the updated state at
    the end, and list the cell beside the model's and the optimizer's state::

        captured = [model.state, optimizer.state, cell]

        @partial(mx.compile, inputs=captured, outputs=captured)
        def step(x, y): ...

    Its items are the state's data fields as 0-d MLX arrays (those the config keeps
    static, the window statistics while spike skipping is off, stay on the cell as
    Python numbers, as :func:`to_device` keeps them). The config is fixed: a
    compiled step reads it when it is traced.

    Args:
        state: The state to hold (host or MLX; a host one is moved with
            :func:`to_device`).

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`~scaler_core.ScalerState`.

    >>> import scaler_core as sc
    >>> cell = StateCell(sc.init())
    >>> sorted(cell)[:3], cell.state.current_scale()
    (['consecutive_skips', 'failure', 'growth_tracker'], 65536.0)
    """

    def __init__(self, state: ScalerState) -> None:
        device = to_device(require_state(state))
        super().__init__()
        self._config = device.config
        self._held = {n: getattr(device, n) for n in static_data(device)}
        self.update((n, getattr(device, n)) for n in DATA_FIELDS if n not in self._held)

    @property
    def config(self) -> Any:
        """The :class:`~scaler_core.ScalerConfig` of the state held."""
        return self._config

    @property
    def state(self) -> ScalerState:
        """The state held (its fields MLX arrays; under ``mx.compile``, traced ones)."""
        return ScalerState(self._config, **self, **self._held)

    @state.setter
    def state(self, state: ScalerState) -> None:
        """Hold ``state``, writing its fields into this dict in place (what
        ``mx.compile``'s ``outputs=`` reads back).

        Raises:
            InvalidArgumentError: ``state`` is not a ScalerState, or its config is not
                the cell's.
        """
        device = to_device(require_state(state))
        if device.config != self._config:
            raise InvalidArgumentError(
                f"state.config={device.config!r}, but this cell holds states of "
                f"config={self._config!r}; a compiled step keeps the config it was traced "
                f"with: make a new StateCell (and a new compiled step) for another config"
            )
        self._held = {n: getattr(device, n) for n in self._held}
        for name in self:
            self[name] = getattr(device, name)

    def __repr__(self) -> str:
        return f"StateCell({self.state!r})"


def scaled_value_and_grad(model: Module, fn: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:
    """``nn.value_and_grad(model, fn)`` of the loss times a state's scale.

    The function returned takes the state first, then ``fn``'s arguments, and gives
    ``fn``'s value as ``fn`` returned it (the loss, or the tuple whose first item is
    the loss) and the gradients of ``loss * state.scale`` with respect to the model's
    trainable parameters (the product rounded to float32, as
    ``Backend.scale_loss`` forms it). Unscale them with :func:`scaler_core.unscale`.

    Args:
        model: The ``mlx.nn.Module`` whose trainable parameters are differentiated.
        fn: The loss function, called as ``fn(*args, **kwargs)``; it returns the loss
            (a scalar array) or a tuple whose first item is the loss.

    Returns:
        ``g(state, *args, **kwargs) -> (value, scaled_grads)``; ``state`` is a
        :class:`~scaler_core.ScalerState` (a host one too) or a :class:`StateCell`.

    Raises:
        InvalidArgumentError: ``model`` is not an ``mlx.nn.Module`` or ``fn`` is not
            callable (now); ``state`` is neither a state nor a cell (at the call).
    """
    if not isinstance(model, Module):
        raise InvalidArgumentError(
            f"model={model!r}, but it must be an mlx.nn.Module (the model whose trainable "
            f"parameters are differentiated, as nn.value_and_grad takes it)"
        )
    if not callable(fn):
        raise InvalidArgumentError(f"fn={fn!r}, but it must be the loss function")

    def scaled(scale: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        value = fn(*args, **kwargs)
        loss = value[0] if isinstance(value, tuple) else value
        return BACKEND.scale_loss(loss, scale), value

    grad_fn = nn_value_and_grad(model, scaled)

    def value_and_grad(state: ScalerState | StateCell, *args: Any, **kwargs: Any) -> Any:
        held = state.state if isinstance(state, StateCell) else require_state(state)
        (_, value), grads = grad_fn(held.scale, *args, **kwargs)
        return value, grads

    return value_and_grad


def optimizer_update(optimizer: Any, model: Module, grads: Any, skip: Any) -> None:
    """``optimizer.update(model, grads)``, unless the step is skipped.

    The update is computed either way; then, on the device, the old values are
    selected where the step is skipped (:meth:`scaler_core.Backend.select`), so the
    parameters *and* ``optimizer.state`` (moments, the step count, a scheduled
    learning rate) keep their bits on a skipped step and nothing is read back: it
    works inside ``mx.compile`` (list ``model.state`` and ``optimizer.state`` in
    its ``inputs=`` and ``outputs=``). ``optimizer.state`` is written in place, as
    the optimizer's own update writes it.

    Args:
        optimizer: An ``mlx.optimizers.Optimizer`` (``MultiOptimizer`` too).
        model: The ``mlx.nn.Module`` it updates.
        grads: The unscaled gradients (what :func:`scaler_core.unscale` returned).
        skip: The state the step's :func:`scaler_core.update` returned (the step is
            skipped where :func:`scaler_core.step_skipped` says so: non-finite
            gradients, a spike, a recorded failure), a :class:`StateCell` holding
            it, or a flag (a 0-d ``mx.bool_`` array or a bool).

    Raises:
        GradientTypeError: ``skip`` is neither a state nor a flag.
        InvalidArgumentError: The optimizer's update changes a parameter's or a
            state value's shape or dtype (select keeps them), or its state holds
            an array in a tuple (which cannot be written in place).
    """
    if isinstance(skip, StateCell):
        skip = skip.state
    flag = (
        step_skipped(skip, NAMESPACE)
        if isinstance(skip, ScalerState)
        else as_flag(NAMESPACE, skip, "skip")
    )
    if not getattr(optimizer, "_initialized", True):
        optimizer.init(grads)  # what apply_gradients does first: the old state is complete
    old_params = _like(grads, model)
    old_state = _copy(optimizer.state)
    new_params = optimizer.apply_gradients(grads, model)
    kept_state = BACKEND.select(flag, old_state, optimizer.state)
    _assign(optimizer.state, kept_state, "optimizer.state")
    model.update(BACKEND.select(flag, old_params, new_params))


def _like(structure: Any, tree: Any) -> Any:
    """The values of ``tree`` at the places of ``structure``'s leaves (as the optimizer's
    ``apply_gradients`` reads the parameters)."""
    if isinstance(structure, Mapping):
        return {k: _like(v, tree[k]) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(_like(v, t) for v, t in zip(structure, tree, strict=False))
    return tree


def _copy(tree: Any) -> Any:
    """``tree``'s containers copied, its leaves (immutable MLX arrays) shared."""
    if isinstance(tree, Mapping):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_copy(v) for v in tree)
    return tree


def _items(tree: Any) -> Iterable[tuple[Any, Any]]:
    return tree.items() if isinstance(tree, Mapping) else enumerate(tree)


def _assign(target: Any, source: Any, path: str) -> None:
    """Write ``source``'s leaves into ``target``'s containers, in place."""
    for key, value in _items(target):
        here = f"{path}[{key!r}]"
        new = source[key]
        if isinstance(value, (Mapping, list, tuple)):
            _assign(value, new, here)
        elif new is not value:
            if isinstance(target, tuple):
                raise InvalidArgumentError(
                    f"{here} is an array in a tuple, which cannot be written in place; "
                    f"keep the optimizer's state in dicts and lists, as mlx.optimizers does"
                )
            target[key] = new
