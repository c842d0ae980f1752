"""One error hierarchy: every class lives in ``scaler_core/_errors.py``, derives from
``ScalerError`` and from the built-in a caller would catch, and the library never raises
a bare built-in (only ``AttributeError`` from a module ``__getattr__``, as Python asks)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

import scaler_core as sc
import scaler_core.backends
from scaler_core import _errors

# The package as imported (a checkout, an editable install or the wheel), backends included.
PACKAGE = Path(sc.__file__).resolve().parent
BACKENDS = Path(sc.backends.__path__[0]).resolve()
SHIPPED = sorted({*PACKAGE.rglob("*.py"), *BACKENDS.rglob("*.py")})
BUILTIN_ERRORS = {
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
}
OURS = set(_errors.__all__)


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else ""


def _functions_by_line(tree: ast.AST) -> dict[int, str]:
    """For each line, the name of the innermost function holding it."""
    out: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                out[line] = node.name  # inner functions come later in the walk
    return out


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_bare_builtin_is_raised_and_no_error_class_lives_elsewhere(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source)
    inside = _functions_by_line(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            name = _name(node.exc)
            if name in BUILTIN_ERRORS and name not in OURS:
                allowed = name == "AttributeError" and inside.get(node.lineno) == "__getattr__"
                # The PyTorch drop-in raises PyTorch's own errors for PyTorch's misuse
                # (tests/integrations/test_torch.py compares class and message).
                drop_in = path.parent.name == "torch"  # the package scaler_core.torch
                mirrors = drop_in and "# PyTorch's error" in lines[node.lineno - 1]
                assert allowed or mirrors, f"{path.name}:{node.lineno} raises a bare {name}"
        if isinstance(node, ast.ClassDef) and path.name != "_errors.py":
            bases = {_name(b) for b in node.bases}
            assert not bases & (BUILTIN_ERRORS | OURS), (
                f"{path.name}:{node.lineno} defines error class {node.name}; put it in _errors.py"
            )


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (sc.InvalidConfigError, ValueError),
        (sc.InvalidStateError, ValueError),
        (sc.InvalidArgumentError, ValueError),
        (sc.InvalidArgumentError, TypeError),
        (sc.TraceError, ValueError),
        (sc.ScaleCollapseError, ArithmeticError),
        (sc.SkipLimitError, sc.ScaleCollapseError),
        (sc.LifecycleError, RuntimeError),
        (sc.GradientTypeError, TypeError),
        (sc.GradientValueError, ValueError),
        (sc.MissingDependencyError, ImportError),
        (sc.BackendUnavailableError, sc.MissingDependencyError),
        (sc.PolicyViolationError, AssertionError),
        (sc.BackendContractError, AssertionError),
        (sc.ReplicaMismatchError, RuntimeError),
        (sc.ReplicaTimeoutError, TimeoutError),
    ],
)
def test_every_error_is_a_scaler_error_and_a_builtin(error: type, builtin: type) -> None:
    assert issubclass(error, sc.ScalerError)
    assert issubclass(error, builtin)


def test_every_error_class_is_exported() -> None:
    classes = {
        name
        for name, value in vars(_errors).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    assert classes == OURS
    assert all(getattr(sc, name) is getattr(_errors, name) for name in OURS)
