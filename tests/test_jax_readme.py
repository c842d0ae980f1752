"""The README's JAX example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("jax", reason="the README's JAX example needs jax")
pytest.importorskip("optax", reason="the README's JAX example needs optax")

README = Path(__file__).resolve().parent.parent / "README.md"


def _jax_blocks() -> list[str]:
    text = README.read_text()
    section = text.split("\n## JAX\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_has_a_jax_example() -> None:
    assert _jax_blocks(), "the README's JAX section must hold a python example"


@pytest.mark.parametrize("index", range(len(_jax_blocks())))
def test_readme_jax_example_runs(index: int, tmp_path: Any) -> None:
    code = _jax_blocks()[index]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped" in done.stdout
