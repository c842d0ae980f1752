"""No core module but the registry names an array library.

The core asks: which library a value comes from, and whether it is a host value, is
the registry's answer (``scaler_core._registry``); whether a dtype is a boolean or a
float, the answer of the backend's namespace (``isdtype``). So a library that
registers a backend, or whose arrays carry ``__array_namespace__``, is served exactly
as the built-in ones are. This test reads every core module with :mod:`ast` and
fails on any import of an array library, any reference to one by name, and any
string that names one as code would (``"torch.bool"``, ``"jaxlib"``: a word with no
space whose first dotted part is a library), outside docstrings and messages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import scaler_core

PACKAGE = Path(scaler_core.__file__).parent

#: Array libraries, and the aliases code gives them.
LIBRARIES = frozenset(
    {
        "numpy", "np", "ml_dtypes", "cupy", "cp", "jax", "jaxlib", "jnp", "torch", "mlx",
        "mx", "paddle", "tensorflow", "tf", "dask", "array_api_strict", "array_api_compat",
        "ndonnx", "dpctl", "numba",
    }
)  # fmt: skip

#: The core: every private module of the package, the simulator and the backend kit.
CORE = sorted(
    [p for p in PACKAGE.glob("_*.py") if p.name != "__init__.py"]
    + [PACKAGE / "simulate.py", PACKAGE / "backend_kit.py"]
)

#: Core modules that may name libraries, and why.
EXEMPT = {
    "_registry.py": "the registry: it registers the built-in backends by their libraries",
    "_registration.py": "registers the state class with JAX's pytrees and flax's checkpoints "
    "once the user has imported them: JAX is what it registers with, never a value's library",
}

#: Names and strings that name a library as a label, not to tell a value's library.
LABELS = {
    # The presets of peer scalers are named after their framework (the functions that
    # build them too), and their metadata names the peer's class; no value's library is
    # told from them.
    "_presets.py": {"torch", "torch.amp.GradScaler", "paddle"},
    # The format of PyTorch's GradScaler.state_dict is called "torch" in a dict's "format".
    "_serialize.py": {"torch"},
}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def names_of_libraries(source: str) -> list[tuple[int, str, str]]:
    """``(line, how, name)`` for each place ``source`` names an array library."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    hits: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""] if not node.level else []
        elif isinstance(node, ast.Name) and node.id in LIBRARIES:
            hits.append((node.lineno, "the name", node.id))
            continue
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and node.value.strip()
            and not any(c.isspace() for c in node.value)
            and node.value.split(".")[0] in LIBRARIES
        ):
            hits.append((node.lineno, "the string", node.value))
            continue
        else:
            continue
        hits.extend((node.lineno, f"import {m}") for m in modules if m.split(".")[0] in LIBRARIES)
    return hits


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_a_core_module_names_no_array_library(path: Path) -> None:
    if path.name in EXEMPT:
        pytest.skip(EXEMPT[path.name])
    labels = LABELS.get(path.name, set())
    hits = [
        hit
        for hit in names_of_libraries(path.read_text(encoding="utf-8"))
        if hit[1] == "import" or hit[2] not in labels
    ]
    assert not hits, (
        f"{path.name} names an array library at {hits}: ask the registry "
        f"(scaler_core._registry) which library a value is, or the backend's namespace "
        f"(isdtype) what its dtype is"
    )


@pytest.mark.parametrize(
    "source",
    [
        "import numpy as np",
        "from torch import Tensor",
        "x = str(dtype) in {'bool', 'torch.bool'}",
        "name = str(dtype).removeprefix('torch.')",
        "SAME = {'jaxlib': 'jax'}",
        "if type(v).__module__ == 'numpy': pass",
        "ok = jnp.isfinite(x)",
    ],
)
def test_the_check_sees_each_way_of_naming_a_library(source: str) -> None:
    assert names_of_libraries(source), source


def test_the_check_reads_docstrings_and_messages_as_prose() -> None:
    source = (
        '"""Works with NumPy and torch arrays."""\n'
        "def f():\n"
        '    """numpy"""\n'
        '    raise ValueError("pass a torch tensor, or jax.numpy arrays")\n'
    )
    assert names_of_libraries(source) == []


def test_every_core_module_is_read() -> None:
    names = {p.name for p in CORE}
    assert {"_ops.py", "_coerce.py", "_state.py", "_backend.py", "_registry.py"} <= names
