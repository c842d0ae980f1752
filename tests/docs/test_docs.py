"""Every ``>>>`` example in the package's docstrings runs and gives what it shows."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import scaler_core
import scaler_core.backends

# The package and its backends, found where they are (inside the package once installed,
# beside it in a checkout).
MODULES = sorted(
    {m.name for m in pkgutil.walk_packages(scaler_core.__path__, "scaler_core.")}
    | {m.name for m in pkgutil.iter_modules(scaler_core.backends.__path__, "scaler_core.backends.")}
)

#: Modules that need an optional dependency: skipped cleanly without it.
OPTIONAL = {
    "scaler_core.jax": ("jax",),
    "scaler_core.optax": ("jax", "optax"),
    "scaler_core.backends._jax": ("jax",),
    "scaler_core.backends._cupy": ("cupy",),
    "scaler_core.backends._numpy_kernels": ("numba",),
    "scaler_core.torch": ("torch",),
    "scaler_core.accelerate": ("torch",),
    "scaler_core.deepspeed": ("torch", "deepspeed"),
    "scaler_core.megatron": ("torch", "megatron.core"),
    "scaler_core.mmengine": ("torch", "mmengine"),
    "scaler_core.timm": ("torch", "timm"),
    "scaler_core.backends._torch": ("torch",),
    "scaler_core.backends._torch_host": ("torch",),
    "scaler_core.backends._torch_leaves": ("torch",),
    "scaler_core.backends._torch_plans": ("torch",),
    "scaler_core.backends.torch_kernels": ("torch",),
    "scaler_core.torch._args": ("torch",),
    "scaler_core.torch._eager": ("torch",),
    "scaler_core.torch._flags": ("torch",),
    "scaler_core.torch._fused": ("torch",),
    "scaler_core.torch._groups": ("torch",),
    "scaler_core.torch._held": ("torch",),
    "scaler_core.torch._plan": ("torch",),
    "scaler_core.torch._scaler": ("torch",),
    "scaler_core.torch._sharded": ("torch",),
    "scaler_core.mlx": ("mlx",),
    "scaler_core.backends._mlx": ("mlx",),
}

#: Modules whose examples another test runs, and why not here.
ELSEWHERE = {
    "scaler_core.keras": (
        "Keras picks its backend when first imported (KERAS_BACKEND), so its examples run "
        "in fresh interpreters, one per backend: tests/integrations/test_keras.py::"
        "test_the_modules_docstring_examples_run"
    ),
}


def test_the_backends_are_among_the_modules() -> None:
    assert {"scaler_core.backends._common", "scaler_core.backends._numpy"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    if name in ELSEWHERE:
        pytest.skip(ELSEWHERE[name])
    for dep in OPTIONAL.get(name, ()):
        pytest.importorskip(dep, reason=f"{name} needs {dep}")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
