"""optax integration: dynamic loss scaling for any optax optimizer, in one jitted step.

Importing this module imports JAX and optax (``import scaler_core`` never does).

:func:`with_loss_scaling` wraps an ``optax.GradientTransformation``;
:func:`scale_loss` multiplies the loss by the scale its state holds, and
:func:`current_scale` reads that scale. The wrapper's ``update``
takes the gradients of the *scaled* loss, unscales them, detects non-finite
values, runs the inner optimizer, and then *selects*: on a skipped step
(:func:`scaler_core.step_skipped`: non-finite gradients, a spike, or a failure
recorded by this or an earlier step) the returned updates are ``-0.0`` (so
``optax.apply_updates`` leaves every parameter bit-identical, ``-0.0`` and NaN
payloads included) and the inner optimizer state is the old one, bit for bit;
the scaler state advances either way. No host synchronisation: the whole step
traces once. After a refused step (a collapse, the skip limit) nothing is
applied any more, ``state.skipped`` stays true and ``state.scaler.failure`` holds
the code; the first host-side look (:func:`current_scale` outside ``jit``,
``state.scaler.check()``, ``state.scaler.current_scale()``,
``scaler_core.to_dict``) raises.

Why select rather than zero the gradients: an optimizer fed zero gradients
still steps. Adam's moments decay and its count advances, momentum keeps
moving the parameters, weight decay still shrinks them, and schedules move on.
A skipped step must be a step that did not happen.

>>> import jax, jax.numpy as jnp, optax
>>> from scaler_core.optax import current_scale, scale_loss, with_loss_scaling
>>> tx = with_loss_scaling(optax.sgd(0.1))
>>> params = {"w": jnp.array([1.0, -0.0])}
>>> opt_state = tx.init(params)
>>> grads = {"w": jnp.array([jnp.inf, 0.0])}   # gradients of loss * scale
>>> updates, opt_state = tx.update(grads, opt_state, params)
>>> new = optax.apply_updates(params, updates)
>>> bool(jnp.all(new["w"] == params["w"])), float(current_scale(opt_state))
(True, 32768.0)
>>> float(scale_loss(jnp.float32(0.5), opt_state))
16384.0
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from . import _deprecated, _ops
from ._config import ScalerConfig
from ._errors import InvalidArgumentError
from ._state import ScalerState, start_state, step_skipped
from .backends._jax import BACKEND, to_device
from .jax import reduce_found

__all__ = ["LossScaledState", "current_scale", "scale_loss", "with_loss_scaling"]

if not TYPE_CHECKING:  # the old names, served (warning) as the new until the next release
    __getattr__ = _deprecated.module_getattr(
        __name__, {"loss_scale": "current_scale", "loss_scaled": "with_loss_scaling"}
    )


class LossScaledState(NamedTuple):
    """The optimizer state of :func:`with_loss_scaling`.

    Attributes:
        inner: The wrapped optimizer's state.
        scaler: The :class:`~scaler_core.ScalerState` (on the device).
        skipped: Whether the last step was skipped (a device bool a loop can log
            with no host synchronisation): its gradients were non-finite, with spike
            skipping on its gradient norm was a spike, or a failure is recorded
            (``scaler.failure`` is nonzero from the refused step on, and then no
            step is applied until the user deals with it; see :func:`current_scale`).
    """

    inner: Any
    scaler: ScalerState
    skipped: jax.Array

    @property
    def found(self) -> jax.Array:
        """Deprecated: renamed :attr:`skipped` (it holds the skip decision)."""
        _deprecated.warn("LossScaledState.found", "LossScaledState.skipped")
        return self.skipped


def current_scale(state: LossScaledState) -> jax.Array:
    """The scale the loss is multiplied by this step (a 0-d float32 array).

    ``state`` is the optimizer state of :func:`with_loss_scaling`, as optax returns
    it or as flax NNX's ``nnx.Optimizer`` holds it (its leaves wrapped in NNX
    variables). Unlike :meth:`scaler_core.ScalerState.current_scale` it returns the
    array, not a float, so a jitted step can multiply by it (:func:`scale_loss`).

    Inside ``jax.jit`` nothing is read: a failure recorded in the state travels on
    (every step is then skipped, and ``state.skipped`` says so). Outside ``jit``,
    on concrete arrays, this is a host-side look: it reads the failure code back
    and raises the recorded failure (a replicated ``pmap`` state too).

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`LossScaledState`.
        ScaleCollapseError: (outside ``jit``) a collapse, or a backoff at a floor
            configured to raise, is recorded in the state.
        SkipLimitError: (outside ``jit``) the consecutive-skip limit was passed.
        ReplicaMismatchError: (outside ``jit``) the replicas of a replicated
            state disagree.
    """
    scaler = getattr(state, "scaler", None)
    if not isinstance(state, LossScaledState) or not isinstance(scaler, ScalerState):
        raise InvalidArgumentError(
            f"state={type(state).__qualname__}, but it must be the LossScaledState that "
            f"with_loss_scaling(...).init returns (or an nnx.Optimizer's opt_state holding "
            f"one)"
        )
    scale, failure = _unwrap(scaler.scale), _unwrap(scaler.failure)
    if not isinstance(failure, jax.core.Tracer):  # a host-side look: raise a failure
        dataclasses.replace(scaler, scale=scale, failure=failure).check()
    return scale  # type: ignore[no-any-return]


def scale_loss(loss: Any, state: LossScaledState) -> jax.Array:
    """``loss * scale``, the scale of ``state`` (float32): differentiate this, not ``loss``.

    Feed the gradients of what it returns to the ``update`` of
    :func:`with_loss_scaling`. ``state`` is read as :func:`current_scale` reads it
    (inside ``jax.jit`` nothing is read back; outside, a recorded failure raises).

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`LossScaledState`.
        ScaleCollapseError: As :func:`current_scale`.
        SkipLimitError: As :func:`current_scale`.
    """
    return BACKEND.scale_loss(loss, current_scale(state))


def _unwrap(value: Any) -> Any:
    """The array inside an NNX variable (``nnx.Optimizer`` wraps its state's leaves)."""
    if type(value).__module__.startswith("flax"):
        get_value = getattr(value, "get_value", None)  # flax >= 0.12; .value before
        return get_value() if callable(get_value) else value.value
    return value


def _held_by_a_running_multisteps(ours: tuple[object, ...]) -> bool:
    """Whether an ``optax.MultiSteps`` that holds ``ours`` is running a method right now.

    ``init`` is given nothing but the params, so its callers are the only place to
    find the ``MultiSteps`` that calls it; what decides is the structure. Every
    frame down to the bottom of the stack is looked at, so how deep the wrapper
    sits (chains inside chains, ``partition``, ``masked``, ``named_chain``, a
    user's own combinator) does not matter. A ``MultiSteps`` found there counts
    only if its inner transformation is built from ``ours`` (:func:`_reaches`): a
    scaler that some code run by a ``MultiSteps`` makes and initialises for itself
    is not inside it. Where the interpreter gives no frames, nothing is refused.
    """
    frame = inspect.currentframe()
    while frame is not None:
        code = frame.f_code
        if "self" in code.co_varnames or "self" in code.co_freevars:
            owner = frame.f_locals.get("self")
            if isinstance(owner, optax.MultiSteps) and _reaches(owner, ours):
                return True
        frame = frame.f_back
    return False


# Not followed: scalars, text, JAX arrays (they have a __dict__), classes, modules.
_ATOMS = (str, bytes, int, float, complex, type, types.ModuleType, jax.Array)


def _reaches(root: object, targets: tuple[object, ...]) -> bool:
    """Whether one of ``targets`` (compared by identity) is reachable from ``root``.

    Follows what optax transformations are made of: the fields of a
    ``GradientTransformation`` and other containers, functions' closures, defaults
    and ``__wrapped__``, ``functools.partial``'s parts, bound methods and instance
    attributes (``MultiSteps._opt``). Each object is visited once, so cycles end.
    """
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        if any(obj is target for target in targets):
            return True
        if id(obj) in seen or obj is None or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        todo.extend(_parts(obj))
    return False


def _parts(obj: object) -> list[object]:
    """The objects ``obj`` directly holds, as far as :func:`_reaches` follows them."""
    if isinstance(obj, (tuple, list, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, types.FunctionType):
        parts: list[object] = list(obj.__defaults__ or ())
        parts += (obj.__kwdefaults__ or {}).values()
        parts += vars(obj).values()  # __wrapped__ from functools.wraps
        parts += [_contents(cell) for cell in obj.__closure__ or ()]
        return parts
    if isinstance(obj, types.MethodType):
        return [obj.__func__, obj.__self__]
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    attributes = getattr(obj, "__dict__", None)
    return list(attributes.values()) if isinstance(attributes, dict) else []


def _contents(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # a variable not assigned yet
        return None


def with_loss_scaling(
    inner: optax.GradientTransformation,
    config: ScalerConfig | None = None,
    *,
    state: ScalerState | None = None,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so non-finite steps are skipped and the loss scale adapts.

    Feed its ``update`` the gradients of ``scale_loss(loss, opt_state)``. It
    returns the inner optimizer's updates of the unscaled gradients, or, on a
    skipped step (:func:`scaler_core.step_skipped` of the updated scaler state),
    ``-0.0`` updates and the old inner state (see the module docstring for why
    this is a select and not zeroed gradients).

    Args:
        inner: Any optax gradient transformation (extra args are passed on).
        config: The scaler policy; PyTorch's defaults when omitted.
        state: Start from this scaler state instead (e.g. one loaded with
            :func:`scaler_core.from_dict`); its config is used.
        axis_name: Inside ``shard_map``/``pmap``, the axis to OR the found flag
            over so that every replica skips together. Leave ``None`` for one
            device, or for global sharded arrays under ``jax.jit`` (there the
            flag already covers the whole array). With spike skipping, the
            largest of the replicas' norms decides, so they skip together too.

    With ``spike_threshold`` in the config, the unscale also gives the global
    gradient norm (in the same fused pass) and a spike is skipped like an
    overflow: the inner optimizer's update and state are discarded.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`LossScaledState`.

    Raises:
        InvalidStateError: Both ``config`` and ``state`` are given and differ,
            or ``state`` is not a :class:`~scaler_core.ScalerState`.
        InvalidArgumentError: (at ``init``, before any state exists) the wrapper
            sits inside ``optax.MultiSteps``, directly or at any depth (through
            ``chain``, ``partition``, ``masked``, ``named_chain``, ...), which would
            accumulate unchecked scaled gradients; ``with_loss_scaling(
            optax.MultiSteps(...))`` is the order that works.
    """
    start = start_state(config, state)
    _ops.require_float32_factors(BACKEND.namespace(), start.config)  # now, not when traced
    inner = optax.with_extra_args_support(inner)
    spikes = start.config.spike_threshold is not None

    def init_fn(params: Any) -> LossScaledState:
        if _held_by_a_running_multisteps((init_fn, update_fn)):
            raise InvalidArgumentError(
                "optax.MultiSteps(with_loss_scaling(...)), with with_loss_scaling at any "
                "depth inside MultiSteps' optimizer, accumulates the scaled gradients before "
                "they are checked, and one overflow poisons every later window (MultiSteps' "
                "reset multiplies inf by 0): every step is then skipped and the scale "
                "driven down. Put the accumulation inside: with_loss_scaling(optax.MultiSteps("
                "inner, every_k_schedule=k)) checks each micro-batch before it is added"
            )
        return LossScaledState(inner.init(params), to_device(start), jnp.asarray(False))

    def update_fn(
        updates: Any, opt_state: LossScaledState, params: Any = None, **extra: Any
    ) -> tuple[Any, LossScaledState]:
        norm = None
        if spikes:
            grads, found, norm = _ops.unscale_and_norm(BACKEND, updates, opt_state.scaler.scale)
        else:
            grads, found = _ops.unscale(BACKEND, updates, opt_state.scaler.scale)
        if axis_name is not None:
            found = reduce_found(found, axis_name)
            if norm is not None:
                norm = jax.lax.pmax(norm, axis_name)  # type: ignore[no-untyped-call]
        scaler = BACKEND.update(opt_state.scaler, found, norm)
        # Decided from the state after the update, by the one shared rule: a failing
        # step leaves last_kind as the previous step's, and records `failure`, which
        # stays set, so from a refused step on nothing is applied.
        skip = step_skipped(scaler, jnp)
        new_updates, new_inner = inner.update(grads, opt_state.inner, params, **extra)
        # -0.0, not 0.0: x + (-0.0) == x bit for bit for every x, -0.0 included.
        no_op = jax.tree_util.tree_map(lambda u: jnp.full_like(u, -0.0), new_updates)
        out = BACKEND.select(skip, no_op, new_updates)
        kept = BACKEND.select(skip, opt_state.inner, new_inner)
        return out, LossScaledState(kept, scaler, skip)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type, unused-ignore]
