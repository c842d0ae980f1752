"""JAX integration: device states and the cross-replica OR of the found flag.

Importing this module imports JAX (``import scaler_core`` alone never does).

* :func:`to_device` puts a host state on the device as 0-d float32/int32
  arrays, so ``jax.jit`` traces a training step once.
* :func:`reduce_found` OR-reduces a found flag over a named mapped axis inside
  ``shard_map`` or ``pmap``, so every replica makes the same skip decision;
  :func:`found_reducer` makes it a hook for ``LossScaler(reduce_found=...)``.
  With global sharded arrays under plain ``jax.jit`` nothing is needed: the
  flag of :func:`scaler_core.unscale` is already a reduction over the whole
  global array, and XLA inserts the collective.

The same two names exist in :mod:`scaler_core.cupy` (NCCL) and
:mod:`scaler_core.mpi` (communicators).

>>> import jax, jax.numpy as jnp
>>> import scaler_core as sc
>>> from scaler_core.jax import to_device
>>> state = to_device(sc.init())
>>> @jax.jit
... def step(grads, state):
...     grads, found = sc.unscale(grads, state)
...     return grads, sc.update(state, found)
>>> grads, state = step({"w": jnp.array([65536.0, jnp.inf])}, state)
>>> bool(grads["w"][0] == 1.0), state.current_scale(), int(state.skipped_steps)
(True, 32768.0, 1)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._errors import InvalidArgumentError
from ._registration import register_flax_serialization
from .backends._jax import BACKEND, to_device

__all__ = [
    "found_reducer",
    "reduce_found",
    "register_flax_serialization",
    "to_device",
]


def reduce_found(found: Any, axis_name: Any) -> jax.Array:
    """The OR of ``found`` over every replica of the mapped axis ``axis_name``.

    Call it inside ``jax.shard_map`` or ``jax.pmap`` (any function with a named
    axis). One small collective (``lax.pmax`` of one int32) per step; every
    replica gets the same flag, so all of them skip or step together.

    Args:
        found: This replica's flag (a 0-d boolean array or a bool).
        axis_name: The mapped axis name, or a tuple of names.

    Returns:
        A 0-d boolean array, identical on every replica.

    Raises:
        GradientTypeError: ``found`` is not a boolean flag.
        InvalidArgumentError: ``axis_name`` is ``None``.
    """
    _check_axis(axis_name)
    flag = BACKEND.any(found)
    total = jax.lax.pmax(flag.astype(jnp.int32), axis_name)  # type: ignore[no-untyped-call]
    return total > 0  # type: ignore[no-any-return]


def _check_axis(axis_name: Any) -> None:
    if axis_name is None:
        raise InvalidArgumentError(
            "axis_name=None, but it must name the mapped axis of shard_map or pmap "
            "(the axis_name= you gave them)"
        )


def found_reducer(axis_name: Any) -> Callable[[Any], jax.Array]:
    """:func:`reduce_found` over ``axis_name`` as a hook for ``LossScaler(reduce_found=...)``.

    Raises:
        InvalidArgumentError: ``axis_name`` is ``None`` (checked now).
    """
    _check_axis(axis_name)
    return functools.partial(reduce_found, axis_name=axis_name)
