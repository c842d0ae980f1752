"""Python files that belong to no package, loaded by path: a benchmark script, the
CPU build of the CUDA kernels (``tests/backends/cuda_on_cpu/build.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_file(path: Path, name: str | None = None) -> ModuleType:
    """The module of the file ``path``, run once more on each call, named ``name`` (the
    file's stem by default) and left out of ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(path.stem if name is None else name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
