"""Float32 arithmetic in pure Python, without importing any array library.

The scale is a float32 value (PyTorch keeps it in a float32 tensor). Python
floats are float64, so every product is formed in float64 and rounded once to
float32, which is what PyTorch's ``_amp_update_scale_`` does on the CPU.
"""

from __future__ import annotations

import math
import struct

__all__ = ["FLT_MAX", "FLT_MIN", "INT32_MAX", "f32", "is_f32_exact", "is_normal_f32"]

_F32 = struct.Struct("<f")

#: Largest finite float32.
FLT_MAX: float = _F32.unpack(b"\xff\xff\x7f\x7f")[0]
#: Smallest positive normal float32 (2**-126); anything below is subnormal.
FLT_MIN: float = 2.0**-126
#: Counters are int32 on every backend (PyTorch's growth tracker is int32 too).
INT32_MAX: int = 2**31 - 1


def f32(x: float) -> float:
    """Round ``x`` to the nearest float32 and return it as a Python float.

    Overflow gives a signed infinity instead of raising, as a float32 cast does.

    >>> f32(0.1)
    0.10000000149011612
    >>> f32(1e39)
    inf
    """
    try:
        return float(_F32.unpack(_F32.pack(x))[0])
    except OverflowError:
        return math.copysign(math.inf, x)


def is_f32_exact(x: float) -> bool:
    """Whether ``x`` is exactly representable as a float32."""
    return math.isfinite(x) and f32(x) == x


def is_normal_f32(x: float) -> bool:
    """Whether ``x`` is a finite, positive, normal float32 magnitude."""
    return math.isfinite(x) and FLT_MIN <= x <= FLT_MAX
