"""The state class registered with JAX's pytrees and flax's serialization.

A :class:`~scaler_core.ScalerState` must be a JAX pytree (its data fields the
leaves, its config static) once JAX is loaded, and flax checkpoints must save it
once flax is; the core never imports either before the user has. The state module
declares its class here (:func:`declare`) and every state construction calls
:func:`register_loaded`, which registers the class, once, with whichever of the two
is in ``sys.modules``. The pytree split comes from the class's own field
declaration: ``metadata["static"]`` true makes a field auxiliary data (the config),
false a leaf, and a data field may add ``metadata["static_when"]``, a predicate of
the instance that reads only its static fields: where it holds, the field is
auxiliary data too, as a hashable host value (the spike statistics while spike
skipping is off, which then never change, so they cost a jitted call nothing).
This module knows the class only through its declaration, so the state module
imports this one and never the other way round.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from ._errors import InvalidStateError

__all__ = [
    "declare",
    "register_flax_serialization",
    "register_loaded",
    "register_pytree",
    "static_data",
    "static_value",
]

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


@dataclasses.dataclass(frozen=True)
class _Split:
    """A declared class's pytree split, read once from its fields' metadata."""

    #: The fields that are always auxiliary data (the config).
    meta: tuple[str, ...]
    #: Every data field, in declaration order.
    data: tuple[str, ...]
    #: The data fields that are auxiliary data where their predicate holds, grouped
    #: by predicate (each predicate is called once per flatten).
    conditional: tuple[tuple[Callable[[Any], bool], tuple[str, ...]], ...]


_SPLITS: dict[type[Any], _Split] = {}


def _split(cls: type[Any]) -> _Split:
    """The split of ``cls``, read from its fields once."""
    split = _SPLITS.get(cls)
    if split is None:
        split = _SPLITS.setdefault(cls, _read_split(cls))
    return split


def _read_split(cls: type[Any]) -> _Split:
    fields = dataclasses.fields(cls)
    groups: dict[Callable[[Any], bool], tuple[str, ...]] = {}
    for f in fields:
        when = f.metadata.get("static_when")
        if when is not None and not f.metadata["static"]:
            groups[when] = (*groups.get(when, ()), f.name)
    return _Split(
        meta=tuple(f.name for f in fields if f.metadata["static"]),
        data=tuple(_data_fields(cls)),
        conditional=tuple(groups.items()),
    )


#: The host numbers a static data field may hold as it is.
_NUMBERS = (int, float)


class _Plan(NamedTuple):
    """How to flatten an instance whose static data fields are a given tuple."""

    names: tuple[str, ...]  # the leaves' fields
    leaves: Callable[[Any], tuple[Any, ...]]  # their values
    keys: tuple[Any, ...]  # their key paths (GetAttrKey)
    statics: Callable[[Any], tuple[Any, ...]]  # the static data fields' values
    order: tuple[str, ...]  # every field, in the order unflatten receives the values


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """A function of an instance that returns its ``names`` fields as a tuple."""
    if not names:
        return lambda obj: ()
    get = operator.attrgetter(*names)
    if len(names) == 1:
        return lambda obj: (get(obj),)
    return get


def static_data(obj: Any) -> tuple[str, ...]:
    """The data fields of ``obj`` that are static for it, in declaration order.

    Those declared with ``metadata["static_when"]`` whose predicate holds for
    ``obj`` (it reads only ``obj``'s static fields, so the answer is fixed by the
    config). Under JAX they are pytree auxiliary data, not leaves; a transition
    leaves them as they are.
    """
    held: tuple[str, ...] = ()
    for when, names in _split(type(obj)).conditional:
        if when(obj):
            held += names
    return held


def static_value(obj: Any, name: str) -> Any:
    """Field ``name`` of ``obj`` as a host value that can be static pytree data.

    A Python int or float as it is; a 0-d array (NumPy, or a concrete JAX or CuPy
    one) read as its Python scalar, with ``.item()``.

    Raises:
        InvalidStateError: The value is traced (inside ``jax.jit``), or not a scalar.
    """
    value = getattr(obj, name)
    if type(value) in _NUMBERS:
        return value
    core = sys.modules.get("jax.core")
    traced = core is not None and isinstance(value, core.Tracer)
    item = getattr(value, "item", None)
    if traced or getattr(value, "shape", None) != () or not callable(item):
        raise InvalidStateError(
            f"{type(obj).__name__}.{name}={value!r}, but this {type(obj).__name__}'s config "
            f"makes {name} static (pytree auxiliary data: a Python number, never traced); "
            f"build the state with scaler_core.init, from_dict or to_device, which keep it "
            f"on the host"
        )
    return item()


def register_pytree() -> None:
    """Register :class:`~scaler_core.ScalerState` with ``jax.tree_util`` (idempotent;
    imports JAX).

    The split comes from the class's one declaration: fields whose metadata says
    ``static`` (the config) become pytree auxiliary data, and so do the data fields
    that :func:`static_data` names for an instance (as :func:`static_value` reads
    them: the spike statistics while spike skipping is off); the other data fields
    become leaves, keyed by name as ``jax.tree_util.register_dataclass`` keys them.
    Called by the JAX backend on import and by
    every state construction once JAX is in ``sys.modules``, so a user never
    needs to call it; it is public for code that builds states before importing
    JAX and then hands them to JAX directly.
    """
    _once(_PYTREE, _register_pytree)


def _register_pytree() -> None:
    import jax.tree_util  # noqa: PLC0415 - JAX is optional; imported only here

    cls, _ = _DECLARED[0]
    split = _split(cls)
    meta_of = _getter(split.meta)
    plans: dict[tuple[str, ...], _Plan] = {}  # static data fields -> how to flatten

    def plan_of(held: tuple[str, ...]) -> _Plan:
        plan = plans.get(held)
        if plan is None:
            names = tuple(n for n in split.data if n not in held)
            keys = tuple(jax.tree_util.GetAttrKey(n) for n in names)
            plan = _Plan(names, _getter(names), keys, _getter(held), split.meta + names + held)
            plan = plans.setdefault(held, plan)
        return plan

    # A jitted call flattens its state argument and unflattens its result on every
    # call, so these are written for speed: getters built once per split, and where
    # no data field is static, one getter and the aux tuple.
    groups = split.conditional
    every = plan_of(())

    def flatten(obj: Any) -> tuple[tuple[Any, ...], Any]:
        held: tuple[str, ...] = ()
        for when, names in groups:  # static_data(obj), inlined
            if when(obj):
                held += names
        if not held:
            return every.leaves(obj), (meta_of(obj), (), ())
        plan = plan_of(held)
        statics = plan.statics(obj)
        for value in statics:
            if type(value) not in _NUMBERS:  # a 0-d array: read back once, here
                statics = tuple(static_value(obj, n) for n in held)
                break
        return plan.leaves(obj), (meta_of(obj), held, statics)

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        leaves, data = flatten(obj)
        return list(zip(plan_of(data[1]).keys, leaves, strict=True)), data

    def unflatten(data: Any, children: Iterable[Any]) -> Any:
        meta, held, statics = data
        # The fields set as the constructor sets them, without calling it: a frozen
        # dataclass checks nothing there, its __post_init__ only registers the class
        # (done by now), and its __init__ would double the cost of this call.
        obj = object.__new__(cls)
        obj.__dict__.update(zip(plan_of(held).order, (*meta, *children, *statics), strict=True))
        return obj

    try:
        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
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
        state = dataclasses.replace(target, **values)
        # msgpack gives 0-d NumPy arrays back: the fields the config makes static
        # (pytree auxiliary data) become Python numbers again.
        held = {n: static_value(state, n) for n in static_data(state)}
        return dataclasses.replace(state, **held) if held else state

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
