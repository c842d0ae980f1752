"""``python -m scaler_core``: the same command line as the ``scaler-core`` script."""

from __future__ import annotations

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
