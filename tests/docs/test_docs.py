"""Every ``>>>`` example in the package's docstrings runs and gives what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import scaler_core

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(scaler_core.__path__, "scaler_core.")
    if not m.name.startswith("scaler_core.backends._") or m.name.endswith("_numpy")
)


#: Public modules that need an optional dependency: skipped cleanly without it.
OPTIONAL = {"scaler_core.jax": ("jax",), "scaler_core.optax": ("jax", "optax")}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    for dep in OPTIONAL.get(name, ()):
        pytest.importorskip(dep, reason=f"{name} needs {dep}")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
