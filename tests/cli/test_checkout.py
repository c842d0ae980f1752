"""A source checkout behaves like the install: the three commands a newcomer runs from the
repository root work with the package installed and without it.

From the root, Python finds the source ``scaler_core/`` first, whose backends live beside
it in ``backends/`` (the wheel puts them inside). "Without the install" hides every
installed copy of the package from the child process (a ``sitecustomize`` drops the
paths and finders that lead to one), so only the checkout can answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_HIDE_INSTALL = textwrap.dedent(
    f"""
    import sys
    from pathlib import Path

    root = Path({str(ROOT)!r})
    def installed_copy(entry):
        path = Path(entry or ".").resolve()
        return (path / "scaler_core").is_dir() and path != root
    sys.path[:] = [p for p in sys.path if not installed_copy(p)]
    sys.meta_path[:] = [
        f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")
    ]
    """
)


@pytest.fixture(params=["installed", "not-installed"])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if request.param == "not-installed":
        (tmp_path / "sitecustomize.py").write_text(_HIDE_INSTALL, encoding="utf-8")
        out["PYTHONPATH"] = str(tmp_path)
    return out


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_import_from_the_root_finds_the_backends(env: dict[str, str]) -> None:
    code = (
        "import sys, numpy as np, scaler_core as sc, scaler_core.backends as b; "
        "assert sc.backends is b is sys.modules['scaler_core.backends']; "
        "g = [np.ones(3, np.float32)]; sc.unscale(g, 2.0); "
        "print(sc.__file__); print(b.__path__[0]); print(g[0].tolist())"
    )
    package, backends, values = _run(["-c", code], env).stdout.splitlines()
    assert Path(package) == ROOT / "scaler_core" / "__init__.py"
    assert Path(backends) == ROOT / "backends"
    assert values == "[0.5, 0.5, 0.5]"


def test_python_m_scaler_core_demo_from_the_root(env: dict[str, str]) -> None:
    args = ["-m", "scaler_core", "demo", "--steps", "5", "--dataset", "synthetic", "--quiet"]
    assert "float16 + scaler-core" in _run(args, env).stdout


def test_python_m_pytest_from_the_root(env: dict[str, str]) -> None:
    # What differs from the parent run is the import path (the root on sys.path, the
    # install hidden or not), not the code: every backend is built from this layout and
    # checked against the protocol, and the NumPy ones (numba's cached kernels among them)
    # take every check. The JAX and torch numeric checks run on these same files in the
    # parent's test_contract.py; here they cost 10-15 s of each run for no new failure.
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/backends/test_contract.py"]
    assert " passed" in _run([*args, "-k", "protocol or numpy"], env).stdout
