"""Tools to test what plugs into scaler-core: your scale policies and your backends.

* :func:`check_backend` runs the Backend contract's checks on a backend (one
  registered with :func:`scaler_core.register_backend`, or a built-in one);
  it needs NumPy only. :data:`NAMESPACE_DUTIES` says what its namespace serves.
* :func:`check_policy` property-tests a scale policy ``policy(state, found) ->
  state`` on random configs and flag sequences, and the strategies
  (:func:`configs`, :func:`states`, :func:`flag_sequences`,
  :func:`norm_sequences`, :func:`scales`, :func:`gradient_trees`) serve your
  own properties. These need the ``test`` extra (hypothesis); without it, using
  one raises
  :class:`~scaler_core.MissingDependencyError`.

Run them from a plain test function in your own test file::

    from scaler_core.testing import check_backend, check_policy

    def test_my_policy():
        check_policy(my_policy)

    def test_my_backend():
        check_backend(my_backend)
"""

from typing import Any

from .._errors import MissingDependencyError
from ._checks_namespace import NAMESPACE_DUTIES
from ._contract import BACKEND_CHECKS, check_backend

try:
    from ._policy import (
        check_invariants,
        check_policy,
        check_step,
        configs,
        flag_sequences,
        gradient_trees,
        norm_sequences,
        scales,
        states,
    )
except MissingDependencyError as _missing:  # pragma: no cover - only without hypothesis
    _WHY = str(_missing)

    def __getattr__(name: str) -> Any:
        if name in __all__:
            raise MissingDependencyError(f"scaler_core.testing.{name}: {_WHY}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKEND_CHECKS",
    "NAMESPACE_DUTIES",
    "check_backend",
    "check_invariants",
    "check_policy",
    "check_step",
    "configs",
    "flag_sequences",
    "gradient_trees",
    "norm_sequences",
    "scales",
    "states",
]
