"""Shared test setup: hypothesis profiles, and a loader for the repository's scripts.

``ci`` (the default) is derandomized, so a red CI run is reproducible;
``explore`` runs many more random examples locally:
``HYPOTHESIS_PROFILE=explore pytest``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=100,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "explore",
    deadline=None,
    max_examples=2000,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _load_repo_module(relative: str) -> ModuleType:
    """A file of the repository (``benchmarks/...``) loaded by path, as its stem."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def repo_module() -> Callable[[str], ModuleType]:
    """Load a script of the repository that is not part of the package, by path."""
    return _load_repo_module
