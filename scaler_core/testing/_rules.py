"""The rules every backend's results are held to, computed with NumPy alone.

``inv_scale = f32(1 / f64(scale))``; float16 and bfloat16 computed in float32 and
rounded back; the non-finite check on the unscaled values; and the seeded gradients
the checks feed a backend. A backend passing the checks gives these bits, as every
other backend does (NaN payloads aside).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .._f32 import f32

__all__ = [
    "BF16",
    "DTYPES",
    "UINT",
    "gradients",
    "non_finite",
    "same_bits",
    "unscaled",
    "unscaled_flushed",
]

BF16 = np.dtype(ml_dtypes.bfloat16)
#: The gradient dtypes a backend is checked on, where its library round-trips them.
DTYPES = (np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64))
_HALF = DTYPES[:2]
#: The unsigned integer of each itemsize: bits compared, and bfloat16 carried, through it.
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _inv(scale: float) -> float:
    return f32(1.0 / f32(scale))


def unscaled(host: np.ndarray, scale: float) -> np.ndarray:
    """What every backend must compute for one leaf, by the rules alone."""
    inv = _inv(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        if host.dtype in _HALF:
            return np.asarray(host.astype(np.float32) * np.float32(inv), dtype=host.dtype)
        return np.asarray(host * host.dtype.type(inv), dtype=host.dtype)


def unscaled_flushed(host: np.ndarray, scale: float) -> np.ndarray:
    """:func:`unscaled` where the multiply flushes subnormals (FTZ and DAZ)."""
    compute = np.dtype(np.float64 if host.dtype == np.dtype(np.float64) else np.float32)
    tiny = compute.type(np.finfo(compute).tiny)
    with np.errstate(over="ignore", invalid="ignore"):
        x = host.astype(compute)
        x = np.where(np.abs(x) < tiny, np.copysign(compute.type(0), x), x)
        y = np.asarray(x * compute.type(_inv(scale)), dtype=compute)
        y = np.where(np.abs(y) < tiny, np.copysign(compute.type(0), y), y)
        return np.asarray(y, dtype=compute).astype(host.dtype)


def non_finite(*arrays: np.ndarray) -> bool:
    return any(not bool(np.isfinite(a.astype(np.float64)).all()) for a in arrays if a.size)


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bit for bit, any NaN matching any NaN (GPUs make the canonical NaN)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    uint = UINT[want.dtype.itemsize]
    nan_got = np.isnan(got.astype(np.float64))
    nan_want = np.isnan(want.astype(np.float64))
    same = got.view(uint) == want.view(uint)
    return bool(np.all(np.where(nan_want, nan_got, same)))


def gradients(dtype: np.dtype[Any], scale: float, n: int, seed: int) -> np.ndarray:
    """Gradients of ``n`` elements whose unscaled values lie in [2**-4, 2**4], signed,
    with a +0.0 and a -0.0."""
    rng = np.random.default_rng(seed)
    target = 2.0 ** rng.uniform(-4, 4, n) * rng.choice([-1.0, 1.0], n)
    host = np.asarray(target * scale, dtype=dtype)
    host[: min(n, 2)] = np.array([0.0, -0.0][: min(n, 2)], dtype)
    return host
