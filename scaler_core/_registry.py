"""The backend registry: which backend owns a value, and which array library it is.

The one core module that names array libraries. Every other core module asks this
one (which library a value comes from, whether it is a host value that goes with
every library, which backend serves it) and asks that backend's namespace the
rest (is this a boolean, is this a float), so a library that registers a backend,
or whose arrays carry the Array API standard's ``__array_namespace__``, is served
by the core exactly as the built-in ones are.

A value's library is told from its type's top-level module (``type(x).__module__``
up to the first dot), which is necessarily imported already: nothing here imports
an array library, and a backend module loads on first use.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ._errors import BackendUnavailableError, InvalidArgumentError
from ._tree import leaves_with_paths

__all__ = [
    "ARRAY_API",
    "DEFAULT",
    "LOADED",
    "Claim",
    "backend_name_of",
    "claim",
    "dispatch_leaves",
    "is_host",
    "library_of",
    "load",
    "namespace_of",
    "register",
    "registered",
]

#: The backend of a step whose values are all host values, and of trees with no leaves.
DEFAULT = "numpy"
#: The backend that serves any array carrying ``__array_namespace__`` that no other
#: backend claims.
ARRAY_API = "array_api"


@dataclass(frozen=True)
class _Entry:
    loader: Callable[[], Any]
    array_modules: tuple[str, ...]
    host: bool


@dataclass(frozen=True)
class Claim:
    """Who serves a value's type: its ``backend`` and its ``library`` (the backend's name
    for the modules it registered; the top-level module for an Array API library, so
    two such libraries are told apart)."""

    backend: str
    library: str
    host: bool


_REGISTRY: dict[str, _Entry] = {}
#: The backends built so far, by name (what :func:`load` returns without a call).
LOADED: dict[str, Any] = {}
_CLAIMS: dict[type, Claim | None] = {}
_UNSEEN = object()
_LOCK = threading.Lock()


def register(
    name: str,
    loader: Callable[[], Any],
    *,
    array_modules: Iterable[str] = (),
    replace: bool = False,
    host: bool = False,
) -> None:
    """Register ``loader`` as backend ``name``, owning the types of ``array_modules``.

    ``host`` marks the library whose values are host values (NumPy's: they go with
    every library, and its backend decides on the host).

    Raises:
        InvalidArgumentError: ``name`` is not a non-empty str, ``loader`` is not
            callable, ``name`` is taken (and ``replace`` is false), or a module is
            already owned by another backend.
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"name={name!r}, but it must be a non-empty str")
    if not callable(loader):
        raise InvalidArgumentError(
            f"loader={loader!r}, but it must be a callable that returns the backend"
        )
    if isinstance(array_modules, str):
        raise InvalidArgumentError(
            f"array_modules={array_modules!r}, but it must be a list of module names; "
            f"pass [{array_modules!r}]"
        )
    modules = tuple(array_modules)
    bad = [m for m in modules if not isinstance(m, str) or not m or "." in m]
    if bad:
        raise InvalidArgumentError(
            f"array_modules={list(modules)!r} holds {bad!r}, but each must be a top-level "
            f"module name (type(x).__module__ up to the first dot)"
        )
    with _LOCK:
        if name in _REGISTRY and not replace:
            raise InvalidArgumentError(
                f"name={name!r} is already a registered backend; pass replace=True to replace it"
            )
        for other, entry in _REGISTRY.items():
            clash = set(entry.array_modules) & set(modules)
            if other != name and clash:
                raise InvalidArgumentError(
                    f"array_modules={sorted(clash)!r} already belong to backend {other!r}"
                )
        _REGISTRY[name] = _Entry(loader, modules, host)
        LOADED.pop(name, None)
        _CLAIMS.clear()


def registered() -> list[str]:
    """The registered backends' names, sorted."""
    return sorted(_REGISTRY)


def _module_backend(module: str) -> Callable[[], Any]:
    def load() -> Any:
        return importlib.import_module(module).BACKEND

    return load


# The built-in backends. NumPy's values (and ml_dtypes' bfloat16 scalars) are host
# values; JAX's concrete arrays live in jaxlib, its tracers in jax.
register(
    "numpy",
    _module_backend("scaler_core.backends._numpy"),
    array_modules=["numpy", "ml_dtypes"],
    host=True,
)
register("cupy", _module_backend("scaler_core.backends._cupy"), array_modules=["cupy"])
register("jax", _module_backend("scaler_core.backends._jax"), array_modules=["jax", "jaxlib"])
register("torch", _module_backend("scaler_core.backends._torch"), array_modules=["torch"])
register("mlx", _module_backend("scaler_core.backends._mlx"), array_modules=["mlx"])
register(ARRAY_API, _module_backend("scaler_core.backends._array_api"))

#: How to get each built-in backend's library, for the error when it does not load.
_INSTALL = {
    "numpy": "numpy and ml_dtypes come with scaler-core: reinstall it (pip install scaler-core)",
    "cupy": "install it with pip install 'scaler-core[cupy]' (CUDA 13) or "
    "'scaler-core[cupy-cuda12]'",
    "jax": "install it with pip install 'scaler-core[jax]'",
    "torch": "install it with pip install 'scaler-core[torch]'",
    "mlx": "install it with pip install 'scaler-core[mlx]' (on Linux: pip install 'mlx[cpu]')",
    ARRAY_API: "it serves arrays that carry __array_namespace__: install their library",
}


def load(name: str) -> Any:
    """The backend registered as ``name``, built on first use.

    Raises:
        BackendUnavailableError: ``name`` is unknown, or its library is not
            installed (the message says what to install).
    """
    loaded = LOADED.get(name)
    if loaded is not None:
        return loaded
    entry = _REGISTRY.get(name)
    if entry is None:
        raise BackendUnavailableError(
            f"backend={name!r} is not registered; known backends: {registered()!r} "
            f"(third-party backends register with scaler_core.register_backend)"
        )
    try:
        backend = entry.loader()
    except ImportError as exc:
        if isinstance(exc, BackendUnavailableError):
            raise
        hint = _INSTALL.get(name, "install the library its array types come from")
        raise BackendUnavailableError(f"backend={name!r} is unavailable: {exc}; {hint}") from exc
    with _LOCK:
        LOADED[name] = backend
    return backend


def _top(typ: type) -> str:
    return typ.__module__.partition(".")[0]


def claim(value: object) -> Claim | None:
    """Who serves ``value``'s type (kept per type), or ``None`` when nobody does.

    A registered module's types go to its backend; any other type whose values carry
    ``__array_namespace__`` goes to the Array API backend, as a library of its own.
    """
    typ = type(value)
    owner = _CLAIMS.get(typ, _UNSEEN)
    if owner is not _UNSEEN:
        return owner  # type: ignore[return-value]
    top = _top(typ)
    found: Claim | None = None
    for name, entry in _REGISTRY.items():
        if top in entry.array_modules:
            found = Claim(name, name, entry.host)
            break
    else:
        if ARRAY_API in _REGISTRY and callable(getattr(typ, "__array_namespace__", None)):
            found = Claim(ARRAY_API, top, False)
    _CLAIMS[typ] = found
    return found


def backend_name_of(value: object) -> str | None:
    """The name of the backend that serves ``value``, or ``None``."""
    owner = claim(value)
    return None if owner is None else owner.backend


def is_host(value: object) -> bool:
    """Whether ``value`` is a host value (a Python number or bool, or a value of the
    host library, NumPy), which goes with every library."""
    if type(value).__module__ == "builtins":
        return True
    owner = claim(value)
    return owner is not None and owner.host


def library_of(value: object) -> str:
    """The array library ``value`` comes from, as messages name it: the backend that
    claims its type (``"jax"`` for jaxlib's arrays), else its top-level module."""
    owner = claim(value)
    return _top(type(value)) if owner is None else owner.library


def namespace_of(value: object) -> Any:
    """The namespace of the backend that serves ``value``, on its device.

    Raises:
        BackendUnavailableError: No backend serves it, or it does not load.
    """
    name = backend_name_of(value)
    if name is None:
        raise BackendUnavailableError(
            f"a {type(value).__module__}.{type(value).__qualname__} is served by no backend"
        )
    return load(name).namespace(value)


def dispatch_leaves(tree: Any, root: str) -> Iterator[tuple[str, Any]]:
    """The leaves of ``tree`` for dispatch, with their paths. JAX's pytree nodes
    (registered dataclasses, equinox modules) are opened with ``jax.tree_util`` when
    JAX is already loaded."""
    for path, leaf in leaves_with_paths(tree, root):
        jax = sys.modules.get("jax")
        if jax is None or claim(leaf) is not None:
            yield path, leaf
            continue
        inner = jax.tree_util.tree_leaves(leaf)
        if len(inner) == 1 and inner[0] is leaf:
            yield path, leaf
        else:
            yield from ((path, x) for x in inner)
