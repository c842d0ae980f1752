"""The floating dtypes the tests cover, and their bits.

Tests compare results bit for bit (signed zeros and NaN payloads included) through
the unsigned integers of each dtype's width; the same tables serve to plant a NaN
with a chosen payload and sign.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
#: Every gradient dtype scaler-core takes, narrowest first.
DTYPES = [np.dtype(np.float16), BF16, np.dtype(np.float32), np.dtype(np.float64)]
#: The unsigned integer of each float width: a value's bits.
UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: (mantissa bits, exponent bits) of each dtype, to plant NaNs with any payload and sign.
LAYOUT = {
    np.dtype(np.float16): (10, 5),
    BF16: (7, 8),
    np.dtype(np.float32): (23, 8),
    np.dtype(np.float64): (52, 11),
}


def bits(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as unsigned integers of their width (a view where ``a`` is
    C-contiguous: writing to it writes to ``a``)."""
    return np.ascontiguousarray(a).view(UINT[a.dtype.itemsize])
