"""The state class registered with JAX's pytrees and flax's serialization.

A :class:`~scaler_core.ScalerState` must be a JAX pytree (its data fields the
leaves, its config static) once JAX is loaded, and flax checkpoints must save it
once flax is; the core never imports either before the user has. The state module
declares its class here (:func:`declare`) and every state construction calls
:func:`register_loaded`, which registers the class, once, with whichever of the two
is in ``sys.modules``. The pytree split comes from the class's own field
declaration (``metadata["static"]``). This module knows the class only through its
declaration, so the state module imports this one and never the other way round.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ._errors import InvalidStateError

__all__ = ["declare", "register_flax_serialization", "register_loaded", "register_pytree"]

#: The declared class, and the data fields a flax checkpoint may lack.
_DECLARED: list[tuple[type[Any], frozenset[str]]] = []
_PYTREE = [False]
_FLAX = [False]
_LOCK = threading.Lock()


def declare(cls: type[Any], *, optional: Iterable[str] = ()) -> None:
    """Name the frozen dataclass that :func:`register_pytree` and
    :func:`register_flax_serialization` register.

    Its fields whose metadata says ``static`` become pytree auxiliary data (and
    are not saved by flax); the others are the data fields, the leaves.
    ``optional`` names data fields that a flax checkpoint saved before they existed
    lacks: a restore keeps the target's values for them. Called once, by the state
    module under its class; a new declaration (a reloaded module) is registered
    afresh.
    """
    with _LOCK:
        _DECLARED[:] = [(cls, frozenset(optional))]
        _PYTREE[0] = _FLAX[0] = False


def register_loaded() -> None:
    """Register the declared class with JAX and flax where they are loaded; import neither.

    Called by every state construction, so that a state can be handed to JAX, or
    saved by flax, whenever they are loaded, without the core importing them. A
    stub or broken ``jax`` or ``flax`` module (nothing to register with) is left
    alone.
    """
    if not _PYTREE[0] and "jax" in sys.modules:
        try:
            register_pytree()
        except ImportError:  # a stub or broken "jax" module: nothing to register with
            _PYTREE[0] = True
    if not _FLAX[0] and "flax.serialization" in sys.modules:
        try:
            register_flax_serialization()
        except ImportError:  # a broken flax: nothing to register with
            _FLAX[0] = True


def _data_fields(cls: type[Any]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if not f.metadata["static"]]


def register_pytree() -> None:
    """Register :class:`~scaler_core.ScalerState` with ``jax.tree_util`` (idempotent;
    imports JAX).

    The split comes from the class's one declaration: fields whose metadata says
    ``static`` (the config) become pytree auxiliary data, the others (its
    ``DATA_FIELDS``) become leaves. Called by the JAX backend on import and by
    every state construction once JAX is in ``sys.modules``, so a user never
    needs to call it; it is public for code that builds states before importing
    JAX and then hands them to JAX directly.
    """
    _once(_PYTREE, _register_pytree)


def _register_pytree() -> None:
    import jax.tree_util  # noqa: PLC0415 - JAX is optional; imported only here

    cls, _ = _DECLARED[0]
    data = _data_fields(cls)
    meta = [f.name for f in dataclasses.fields(cls) if f.metadata["static"]]
    try:
        jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
    except ValueError as exc:  # already registered (by hand, or a reloaded module)
        if "egistration" not in str(exc):
            raise


def register_flax_serialization() -> None:
    """Register :class:`~scaler_core.ScalerState` with ``flax.serialization``
    (idempotent; imports flax).

    Then ``flax.serialization.to_bytes`` / ``from_bytes`` (and flax checkpoints) save
    a state's data fields and restore them into a target state, which brings the
    config (static, as under ``jit``). Called by every state construction once flax
    is imported, so a user rarely needs to call it.
    """
    _once(_FLAX, _register_flax)


def _register_flax() -> None:
    from flax import serialization  # noqa: PLC0415 - flax is optional; imported only here

    cls, optional = _DECLARED[0]
    fields = _data_fields(cls)

    def to_state(state: Any) -> dict[str, Any]:
        return {n: serialization.to_state_dict(getattr(state, n)) for n in fields}

    def from_state(target: Any, data: dict[str, Any]) -> Any:
        # A state saved before a field existed (spike skipping's) lacks it: the
        # field keeps the target's value (a fresh window).
        missing = [n for n in fields if n not in data and n not in optional]
        if missing:
            raise InvalidStateError(
                f"flax state dict {sorted(data)!r} lacks the {cls.__name__} fields "
                f"{missing!r}; restore a state saved from a {cls.__name__}"
            )
        values = {
            n: serialization.from_state_dict(getattr(target, n), data[n], name=n)
            for n in fields
            if n in data
        }
        return dataclasses.replace(target, **values)

    try:
        serialization.register_serialization_state(  # type: ignore[no-untyped-call, unused-ignore]
            cls, to_state, from_state
        )
    except ValueError as exc:  # already registered (a reloaded module)
        if "already registered" not in str(exc):
            raise


def _once(done: list[bool], register: Callable[[], None]) -> None:
    """Run ``register`` once per process (until the next :func:`declare`), under the
    lock, and mark ``done`` after it succeeds."""
    if done[0]:
        return
    with _LOCK:
        if done[0]:
            return
        register()
        done[0] = True
