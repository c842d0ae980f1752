"""Names renamed so that each says what it holds, kept working for one release.

Every use of an old name warns (a :class:`DeprecationWarning` that names the new
name) and then does what the new name does; the next release removes the old
names, and this module. docs/reference.md lists them ("Renamed").

Two kinds of name are kept here: a module's renamed attribute (served by the
module's ``__getattr__``, so ``from scaler_core import GradScaler`` warns too), and
the :class:`~scaler_core.Backend` protocol's renamed members. A backend written
against the old members (a class that defines ``rescale`` and ``leaves``, not
``clip`` and ``plan``) is given the new names, bound to its own methods, with one
warning per class; and calling an old member on any backend warns and calls the
new one.
"""

from __future__ import annotations

import abc
import inspect
import os
import sys
import typing
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "BACKEND_RENAMES",
    "PREFIX",
    "adopt_old_members",
    "module_getattr",
    "name_old_members",
    "warn",
]

#: How every warning of this module starts: ``-W "error:scaler-core renamed"`` makes
#: each use of an old name an error.
PREFIX = "scaler-core renamed"

#: The Backend protocol's renamed members, old name -> new name.
BACKEND_RENAMES: Mapping[str, str] = {"leaves": "plan", "rescale": "clip"}

#: Marks the forwarders :func:`name_old_members` makes, so a class that copies one
#: is not taken for a class that defines the old name itself.
_FORWARDER = "__scaler_core_renamed__"


def warn(old: str, new: str, *, stacklevel: int = 1) -> None:
    """Warn that ``old`` is renamed ``new``, at the caller's ``stacklevel``-th caller.

    ``stacklevel=1`` points at the code that called the function calling this one.
    """
    warnings.warn(
        f"{PREFIX} {old} to {new}; the old name still works, deprecated, until the next "
        f"release removes it",
        DeprecationWarning,
        stacklevel=stacklevel + 2,
    )


def module_getattr(module: str, renamed: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves each old name of ``renamed`` (old -> new) as
    the new one, with a warning, and raises ``AttributeError`` for any other name."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module attribute it becomes
        new = renamed.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warn(f"{module}.{name}", f"{module}.{new}")
        return getattr(sys.modules[module], new)

    return __getattr__


def _forwarder(owner: type, old: str, new: str) -> Callable[..., Any]:
    """``old`` for ``owner``'s instances: warns, then calls ``new`` as ``owner`` has it
    (looked up from ``owner``, not from the instance's class, so a subclass whose own
    ``new`` is its old-named method may call ``super().old`` without recursion)."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        warn(f"Backend.{old}", f"Backend.{new}")
        member = inspect.getattr_static(owner, new)
        bind = getattr(type(member), "__get__", None)
        return (member if bind is None else bind(member, self, owner))(*args, **kwargs)

    forward.__name__ = forward.__qualname__ = old
    forward.__doc__ = f"Deprecated: renamed :meth:`{new}`."
    setattr(forward, _FORWARDER, True)
    return forward


def _defines(namespace: Mapping[str, Any], name: str) -> bool:
    return name in namespace and not getattr(namespace[name], _FORWARDER, False)


def name_old_members(cls: type) -> None:
    """Keep a :class:`~scaler_core.Backend` subclass's old member names working.

    Where ``cls`` itself defines an old name and not its new one, the new name is
    bound to that method (it overrides what ``cls`` inherits), with one warning for
    the class; where ``cls`` does not define an old name, it gets a forwarder that
    warns and calls the new one.
    """
    own = vars(cls)
    adopted = [old for old, new in BACKEND_RENAMES.items() if _defines(own, old) and new not in own]
    for old in adopted:
        setattr(cls, BACKEND_RENAMES[old], own[old])
    for old, new in BACKEND_RENAMES.items():
        if not _defines(own, old):
            setattr(cls, old, _forwarder(cls, old, new))
    if adopted:
        _warn_class(cls, adopted)


def adopt_old_members(obj: object, missing: list[str]) -> None:
    """Give a backend that is no :class:`~scaler_core.Backend` subclass, written against
    the old member names, the new ones: bound on its class where the class has the old
    member, else on the object itself, with one warning. Only where the old names are
    all it lacks (``missing``, the members it lacks): an object that is no backend under
    either name is left alone, to be refused. A member that cannot be set (a class that
    refuses new attributes) is left missing, to be reported as missing."""
    olds = {new: old for old, new in BACKEND_RENAMES.items()}
    if not missing or not all(new in olds and _has(obj, olds[new]) for new in missing):
        return
    adopted = []
    for new in missing:
        old = olds[new]
        cls = type(obj)
        try:
            if _has(cls, old):
                setattr(cls, new, inspect.getattr_static(cls, old))
            else:
                setattr(obj, new, getattr(obj, old))
        except (AttributeError, TypeError):
            continue
        adopted.append(old)
    if adopted:
        _warn_class(type(obj), adopted)


def _has(obj: object, name: str) -> bool:
    try:
        inspect.getattr_static(obj, name)
    except AttributeError:
        return False
    return True


def _warn_class(cls: type, adopted: list[str]) -> None:
    olds = " and ".join(adopted)
    news = " and ".join(BACKEND_RENAMES[old] for old in adopted)
    warnings.warn(
        f"{PREFIX} the Backend members {olds} to {news}; {cls.__qualname__} defines the "
        f"old names, which still work, deprecated, until the next release removes them",
        DeprecationWarning,
        stacklevel=_outside_frame(),
    )


def _outside_frame() -> int:
    """The ``stacklevel`` of the first caller outside scaler-core's backend machinery,
    ``typing`` and ``abc`` (the class statement, or the call that handed the backend)."""
    frame, level = inspect.currentframe(), 0
    while frame is not None and frame.f_code.co_filename in _INSIDE:
        frame, level = frame.f_back, level + 1
    return max(level, 1)


def _code_files() -> frozenset[str]:
    """The files whose frames stand between a class statement, or a call handing a
    backend, and the warning: this module, the protocol's, and the ``abc`` and
    ``typing`` code that builds a class (named as its code objects name it: a frozen
    module's frames say ``<frozen abc>``)."""
    files = {__file__, os.path.join(os.path.dirname(__file__), "_backend.py")}
    files |= {abc.__file__, typing.__file__}
    builders = (vars(abc.ABCMeta).get("__new__"), vars(typing.Protocol).get("__init_subclass__"))
    for function in builders:
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        if code is not None:
            files.add(code.co_filename)
    return frozenset(files)


_INSIDE = _code_files()
