"""``python -m benchmarks``: see :mod:`benchmarks` and ``--help``."""

from __future__ import annotations

import os
import sys

# `python -m benchmarks` puts the repository root first on sys.path, where the
# source scaler_core/ (without its installed `backends` subpackage) would shadow
# the installed package. Drop it before anything imports scaler_core.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

from benchmarks._harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
