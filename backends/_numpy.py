"""The NumPy backend (the default): clear, correct, in place.

This is the reference implementation: every faster path is tested against it.
"""

from __future__ import annotations

import numbers
from typing import Any

import ml_dtypes
import numpy as np

from scaler_core._errors import GradientTypeError, GradientValueError
from scaler_core._f32 import f32, is_normal_f32
from scaler_core._state import ScalerState, host_update
from scaler_core._tree import leaves_with_paths

__all__ = ["BACKEND", "NumpyBackend", "inv_scale_of", "numpy_leaves"]

#: The gradient dtypes every backend accepts.
FLOAT_DTYPES: tuple[np.dtype[Any], ...] = (
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
)
_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_ACCEPTED = "float16, bfloat16, float32 or float64"


def inv_scale_of(scale: Any) -> float:
    """``f32(1 / f64(scale))`` after checking ``scale`` is a positive normal float32.

    Raises:
        GradientValueError: ``scale`` is not a real number, or not a positive,
            finite, normal float32 value.
    """
    if isinstance(scale, np.ndarray) and scale.shape == ():
        scale = scale[()]
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise GradientValueError(
            f"scale={scale!r}, but it must be a real number; pass state.scale or a float"
        )
    value = float(scale)
    if not is_normal_f32(value):
        raise GradientValueError(
            f"scale={scale!r}, but it must be a positive, finite, normal float32 value; "
            f"pass the scale of a valid ScalerState"
        )
    return f32(1.0 / f32(value))


def numpy_leaves(grads: Any, *, writable: bool) -> list[tuple[str, np.ndarray]]:
    """Every leaf of ``grads``, validated, each array once (by identity).

    Raises:
        GradientTypeError: A leaf is not a NumPy array, or has a dtype other
            than float16, bfloat16, float32 or float64.
        GradientValueError: ``writable`` and a leaf is read-only.
    """
    out: list[tuple[str, np.ndarray]] = []
    seen: set[int] = set()
    for path, leaf in leaves_with_paths(grads):
        if not isinstance(leaf, np.ndarray):
            raise GradientTypeError(
                f"{path} is a {type(leaf).__qualname__}, but the numpy backend needs "
                f"numpy.ndarray leaves of dtype {_ACCEPTED}"
            )
        if leaf.dtype not in FLOAT_DTYPES:
            raise GradientTypeError(
                f"{path} has dtype {leaf.dtype}, but gradients must be {_ACCEPTED}; "
                f"cast it with .astype(np.float32) or leave it out of the tree"
            )
        if writable and not leaf.flags.writeable:
            raise GradientValueError(
                f"{path} is read-only, but unscaling works in place; pass a writable array "
                f"(np.array(x) makes a writable copy)"
            )
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append((path, leaf))
    return out


def _all_finite(a: np.ndarray) -> bool:
    return bool(np.isfinite(a).all())


class NumpyBackend:
    """Unscale and detection for NumPy arrays. The flag is a ``numpy.bool_``."""

    name = "numpy"

    def unscale(self, grads: Any, scale: Any) -> tuple[Any, np.bool_]:
        """See :meth:`scaler_core.Backend.unscale`."""
        inv = inv_scale_of(scale)
        leaves = numpy_leaves(grads, writable=True)
        found = False
        # Overflow to inf is expected here (it is what the flag reports), not a warning.
        with np.errstate(over="ignore", invalid="ignore"):
            for _, g in leaves:
                if inv != 1.0:
                    if g.dtype in _HALF:
                        g[...] = np.multiply(g, np.float32(inv), dtype=np.float32)
                    else:
                        np.multiply(g, g.dtype.type(inv), out=g)
                if not found and not _all_finite(g):
                    found = True
        return grads, np.bool_(found)

    def find_non_finite(self, grads: Any) -> np.bool_:
        """See :meth:`scaler_core.Backend.find_non_finite`."""
        leaves = numpy_leaves(grads, writable=False)
        return np.bool_(not all(_all_finite(g) for _, g in leaves))

    def scale_loss(self, loss: Any, scale: Any) -> Any:
        """See :meth:`scaler_core.Backend.scale_loss`."""
        inv_scale_of(scale)  # validates scale
        return np.multiply(loss, np.float32(scale))

    def select(self, found: Any, on_skip: Any, on_step: Any) -> Any:
        """See :meth:`scaler_core.Backend.select`: returns one tree, uncopied."""
        return on_skip if self.to_bool(found) else on_step

    def any(self, *flags: Any) -> np.bool_:
        """See :meth:`scaler_core.Backend.any`."""
        return np.bool_(any(self.to_bool(f) for f in flags))

    def to_bool(self, found: Any) -> bool:
        """See :meth:`scaler_core.Backend.to_bool`."""
        if isinstance(found, (bool, np.bool_)) or (
            isinstance(found, np.ndarray) and found.shape == () and found.dtype == np.bool_
        ):
            return bool(found)
        raise GradientTypeError(
            f"found={found!r}, but it must be a bool or numpy bool; pass the flag returned "
            f"by unscale() or find_non_finite()"
        )

    def update(self, state: ScalerState, found: Any) -> ScalerState:
        """See :meth:`scaler_core.Backend.update`: the host transition."""
        if not state.on_host:
            state = state.to_host()
        return host_update(state, self.to_bool(found))


BACKEND = NumpyBackend()
