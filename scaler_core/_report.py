"""Which leaf overflowed: the paths of the non-finite gradient leaves, with counts.

A diagnostic, paid for only when asked (typically on a skipped step): the flag
of :func:`scaler_core.unscale` says *whether* some gradient held NaN or inf;
:func:`non_finite_leaves` says *which* leaves, and how many of each. The
counting is the backend's (its optional ``non_finite_counts`` kernel: each leaf's
path and counts); the report is written here, once, for every backend. This
module imports no array library.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from ._backend import Backend, resolve_backend
from ._errors import BackendContractError, InvalidArgumentError

__all__ = ["LeafReport", "non_finite_leaves"]

#: A backend's count of one leaf: ``(path, nan, inf)``.
_ROW = 3


def _is_count(value: object) -> bool:
    """An integer >= 0 (a NumPy integer too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _count(name: str, value: object) -> None:
    if not (isinstance(value, int) and _is_count(value)):
        raise InvalidArgumentError(f"{name}={value!r}, but it must be an int >= 0")


@dataclass(frozen=True)
class LeafReport:
    """One gradient leaf that holds NaN or inf, and how many of each.

    Attributes:
        path: The leaf's place in the tree, as the Python expression that reaches
            it (``grads['layer3']['w']``), as in the backends' error messages.
        nan: How many of its elements are NaN.
        inf: How many are +inf or -inf (together).

    Raises:
        InvalidArgumentError: ``path`` is not a str, or a count is not an int >= 0.

    >>> report = LeafReport("grads['layer3']['w']", nan=0, inf=12)
    >>> print(report)
    grads['layer3']['w']: 12 inf, 0 nan
    >>> report
    LeafReport(path="grads['layer3']['w']", nan=0, inf=12)
    """

    path: str
    nan: int
    inf: int

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise InvalidArgumentError(f"path={self.path!r}, but it must be a str")
        _count("nan", self.nan)
        _count("inf", self.inf)

    def __str__(self) -> str:
        return f"{self.path}: {self.inf} inf, {self.nan} nan"


def non_finite_leaves(
    grads: Any, *, backend: str | Backend | None = None
) -> tuple[LeafReport, ...]:
    """The leaves of ``grads`` that hold NaN or inf, with their counts; modifies nothing.

    Only leaves with at least one NaN or inf are reported, in the order the
    backend walks the tree (the order of :func:`scaler_core.unscale`'s
    validation; JAX sorts dict keys). An array that appears at several paths is
    read once and reported at its first. The leaves are validated as
    :func:`scaler_core.unscale` validates them, with the same errors, except that
    read-only arrays are fine. Each leaf is read once, and device backends read
    the counts back to the host once (so this synchronises: call it when a step
    was skipped, not on every step, and outside ``jax.jit``).

    Args:
        grads: A gradient tree of one library (as for :func:`scaler_core.unscale`).
        backend: A backend name or object; ``None`` picks it from ``grads``.

    Returns:
        One :class:`LeafReport` per non-finite leaf; ``()`` when all are finite.

    Raises:
        GradientTypeError: A leaf has a bad type or dtype, or libraries are mixed.
        InvalidArgumentError: The backend has no ``non_finite_counts`` method.
        BackendContractError: The backend's counts are not ``(path, nan, inf)``
            rows of a str and two ints >= 0.

    >>> import numpy as np
    >>> grads = {"layer3": {"w": np.array([np.inf, -np.inf, 1.0], np.float16)}, "b": None}
    >>> for report in non_finite_leaves(grads):
    ...     print(report)
    grads['layer3']['w']: 2 inf, 0 nan
    >>> non_finite_leaves({"w": np.ones(3, np.float32)})
    ()
    """
    chosen = resolve_backend(backend, grads)
    name = getattr(chosen, "name", chosen)
    method = getattr(chosen, "non_finite_counts", None)
    if not callable(method):
        raise InvalidArgumentError(
            f"backend {name!r} ({type(chosen).__qualname__}) has no non_finite_counts(grads) "
            f"method; add one to it that returns (path, nan, inf) for each leaf, in leaf "
            f"order, the counts as ints (see docs/reference.md, the backend protocol)"
        )
    reports = []
    for row in method(grads):
        if not (
            isinstance(row, tuple)
            and len(row) == _ROW
            and isinstance(row[0], str)
            and all(_is_count(n) for n in row[1:])
        ):
            raise BackendContractError(
                f"backend {name!r}: non_finite_counts returned the row {row!r}, but each row "
                f"must be a tuple (path: str, nan: int >= 0, inf: int >= 0); return one per leaf"
            )
        path, nan, inf = row[0], int(row[1]), int(row[2])
        if nan or inf:
            reports.append(LeafReport(path, nan, inf))
    return tuple(reports)
