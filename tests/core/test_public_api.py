"""The public surface: names, error hierarchy, and what importing costs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import ModuleType

import scaler_core as sc


def test_all_is_sorted_public_and_importable() -> None:
    assert list(sc.__all__) == sorted(sc.__all__)
    for name in sc.__all__:
        assert not name.startswith("_")
        assert getattr(sc, name) is not None
    leaked = {
        name
        for name, value in vars(sc).items()
        if not name.startswith("_") and name not in sc.__all__ and not isinstance(value, ModuleType)
    }
    assert leaked == set(), f"public names missing from __all__: {leaked}"


def test_numpy_use_never_imports_jax_cupy_or_torch(tmp_path: object) -> None:
    code = textwrap.dedent(
        """
        import sys
        import scaler_core as sc
        heavy = ("jax", "jaxlib", "cupy", "torch", "mpi4py", "numpy", "mlx", "array_api_compat")
        assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
        import numpy as np
        scaler = sc.LossScaler()
        grads = scaler.unscale({"w": np.ones(4, np.float32)})
        scaler.update()
        sc.update(sc.init(), False)
        others = ("jax", "jaxlib", "cupy", "torch", "mpi4py", "mlx", "array_api_compat")
        print(sorted(m for m in others if m in sys.modules))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
