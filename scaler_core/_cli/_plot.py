"""The one place the applications load matplotlib (an optional extra)."""

from __future__ import annotations

import importlib
from typing import Any

from scaler_core._errors import MissingDependencyError

__all__ = ["pyplot"]


def pyplot(flag: str = "--plot") -> Any:
    """``matplotlib.pyplot`` on its file-only backend (``Agg``).

    Args:
        flag: The option that asked for a plot, named in the error.

    Raises:
        MissingDependencyError: matplotlib is not installed; the message says
            how to get it.
    """
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError as exc:
        raise MissingDependencyError(
            f"{flag} needs matplotlib ({exc}); install it with pip install 'scaler-core[demo]' "
            f"or leave out {flag}"
        ) from exc
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
