"""The ``bound`` contenders' kernels: an in-place multiply, or a read, on all threads.

Imported only when numba is installed. They are the fastest ways we know to read
and write every gradient element once (``Table.scale``) or read it once
(``Table.read``), so they mark the machine's limit for an in-place unscale and for
a read-only pass: a contender that runs at their speed is bound by memory (or
cache), not by its own code.
"""

# mypy: disable-error-code="attr-defined,call-arg,no-any-return"
from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import njit, prange

from scaler_core.backends._numpy_kernels import _voidptr

__all__ = ["Table"]

_ITEM_BYTES = 1 << 20


@njit(nogil=True, parallel=True)  # no disk cache: the module is also loaded by path
def _scale(addrs: Any, sizes: Any, factor: Any, like: Any) -> None:
    for j in prange(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        for i in range(a.size):
            a[i] = a[i] * factor


@njit(nogil=True, parallel=True, fastmath=True)
def _read(addrs: Any, sizes: Any, like: Any) -> Any:
    total = 0.0
    for j in prange(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        s = np.float32(0.0)
        for i in range(a.size):
            s += a[i]
        total += s
    return total


class Table:
    """Work items of at most 1 MiB over contiguous float arrays of one dtype."""

    def __init__(self, grads: list[np.ndarray]) -> None:
        if not grads or any(g.dtype != grads[0].dtype or not g.flags.c_contiguous for g in grads):
            raise ValueError("grads must be non-empty C-contiguous arrays of one dtype")
        self.keep = grads
        per = _ITEM_BYTES // grads[0].itemsize
        addrs, sizes = [], []
        for g in grads:
            base = g.ctypes.data
            for lo in range(0, g.size, per):
                addrs.append(base + lo * g.itemsize)
                sizes.append(min(per, g.size - lo))
        self.addrs = np.array(addrs, np.intp)
        self.sizes = np.array(sizes, np.intp)
        self.like = np.empty(0, grads[0].dtype)

    def scale(self, factor: Any) -> None:
        """Multiply every element by ``factor`` (of the arrays' dtype) in place."""
        _scale(self.addrs, self.sizes, self.like.dtype.type(factor), self.like)

    def read(self) -> float:
        """Read every element once (their float32 sum), writing nothing."""
        return float(_read(self.addrs, self.sizes, self.like))
