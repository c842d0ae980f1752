"""JAX helpers: device states and the cross-replica OR of the found flag.

Importing this module imports JAX (``import scaler_core`` alone never does).

* :func:`to_device` puts a host state on the device as 0-d float32/int32
  arrays, so ``jax.jit`` traces a training step once.
* :func:`reduce_found` OR-reduces a found flag over a named mapped axis inside
  ``shard_map`` or ``pmap``, so every replica makes the same skip decision.
  With global sharded arrays under plain ``jax.jit`` nothing is needed: the
  flag of :func:`scaler_core.unscale` is already a reduction over the whole
  global array, and XLA inserts the collective.

>>> import jax, jax.numpy as jnp
>>> import scaler_core as sc
>>> from scaler_core.jax_utils import to_device
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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ._errors import GradientTypeError
from ._state import register_pytree
from .backends._jax import BACKEND, to_device

__all__ = ["found_reducer", "reduce_found", "register_pytree", "to_device"]


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
    """
    flag = BACKEND.any(found)
    total = jax.lax.pmax(flag.astype(jnp.int32), axis_name)  # type: ignore[no-untyped-call]
    return total > 0  # type: ignore[no-any-return]


def found_reducer(axis_name: Any) -> Callable[[Any], jax.Array]:
    """A one-argument :func:`reduce_found` for ``GradScaler(reduce_found=...)``.

    Raises:
        GradientTypeError: ``axis_name`` is ``None``.
    """
    if axis_name is None:
        raise GradientTypeError(
            "axis_name=None, but it must name the mapped axis of shard_map or pmap "
            "(the axis_name= you gave them)"
        )

    def reduce(found: Any) -> jax.Array:
        return reduce_found(found, axis_name)

    return reduce
