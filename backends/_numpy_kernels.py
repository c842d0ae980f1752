"""Numba kernels for the fused NumPy backend (imported lazily, only when used).

Every kernel walks a table of work items, each a contiguous run of elements
given by its address and length, so one call covers thousands of arrays with no
per-array dispatch. Detection accumulates ``y - y`` (``+0`` for a finite ``y``,
NaN for NaN and +-inf) so the loop vectorises as a float reduction; only
reassociation is allowed (``fastmath={"reassoc"}``): the no-NaN/no-inf flags
would let the compiler fold ``y - y`` to zero, and contraction would turn it into
an FMA that leaves the product's rounding error behind. float16 / bfloat16
detection takes the maximum of the exponent bits of the raw ``uint16`` values,
an integer reduction that reads each element once (kept in ``uint16``: numba
would widen ``a & mask`` to int64, which AVX2 cannot max-reduce in vectors).

Parallel kernels spread work items over the threads in one parallel region per
call: with many regions per call (one per array), a thread descheduled by
another busy process stalls every region, and a call took 10-50x longer on a
loaded machine. numba's threads are started by :func:`start_threads` before the
first parallel kernel runs, so that starting them changes no setting of the caller.
"""

# numba's partial type hints do not describe carray or intrinsics; the kernels
# are typed by numba at compile time instead.
# mypy: disable-error-code="attr-defined,call-arg,no-any-return"
from __future__ import annotations

import threading
from typing import Any

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

__all__ = [
    "HEADER_WORDS",
    "NORM_CHUNK",
    "chunk_norm",
    "chunk_unscale_norm",
    "clip_array",
    "clip_items",
    "clip_items_parallel",
    "detect",
    "detect_array",
    "detect_bits",
    "detect_bits_parallel",
    "detect_parallel",
    "exponent_all_ones",
    "first_changed",
    "norm_array",
    "norm_items",
    "norm_items_parallel",
    "start_threads",
    "unscale",
    "unscale_array",
    "unscale_parallel",
]

_FLAGS = {"reassoc"}


@intrinsic
def _voidptr(typingctx: Any, addr: Any) -> Any:
    """An integer address as a ``void*``, for ``numba.carray``."""
    sig = types.voidptr(types.intp)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return sig, codegen


def start_threads() -> None:
    """Start numba's threads from a short-lived thread of their own.

    numba starts its threads at the first parallel kernel of a process, in the thread
    that calls it, and its OpenMP layer then sets that thread's OpenMP thread count
    to numba's (``omp_set_num_threads``; all cores by default) and turns nesting on.
    Where the process has one OpenMP runtime for numba and PyTorch (numba's calls
    bind to the runtime PyTorch loaded), that count is PyTorch's intra-op count:
    ``torch.set_num_threads(1)`` before, every core after, and several ranks on a
    node oversubscribe it. Both settings belong to the thread that makes the call,
    so a start from a thread that then ends leaves every caller's settings alone;
    each parallel region is given numba's own count (``numba.get_num_threads()`` of
    the calling thread) by numba itself.

    Raises:
        Exception: what numba raises when no threading layer loads.
    """
    errors: list[BaseException] = []

    def start() -> None:
        try:
            numba.get_num_threads()  # starts the threads, once per process
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    starter = threading.Thread(target=start, name="scaler-core-numba-start", daemon=True)
    starter.start()
    starter.join()
    if errors:
        raise errors[0]


@njit(cache=True, fastmath=_FLAGS, nogil=True)
def unscale(addrs: Any, sizes: Any, inv: Any, like: Any) -> Any:
    """Multiply every item by ``inv`` in place; NaN if any product is not finite.

    ``like`` is an empty array of the items' dtype (it fixes the element type).
    """
    acc = inv - inv
    for j in range(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        for i in range(a.size):
            y = a[i] * inv
            a[i] = y
            acc += y - y
    return acc


@njit(cache=True, fastmath=_FLAGS, nogil=True, parallel=True)
def unscale_parallel(addrs: Any, sizes: Any, inv: Any, like: Any) -> Any:
    """:func:`unscale` with the work items spread over the machine's threads."""
    acc = inv - inv
    for j in prange(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        part = inv - inv
        for i in range(a.size):
            y = a[i] * inv
            a[i] = y
            part += y - y
        acc += part
    return acc


@njit(cache=True, fastmath=_FLAGS, nogil=True)
def detect(addrs: Any, sizes: Any, like: Any) -> Any:
    """NaN if any element of any item is NaN or +-inf, else 0. Reads only."""
    acc = like.dtype.type(0)
    for j in range(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        for i in range(a.size):
            y = a[i]
            acc += y - y
    return acc


@njit(cache=True, fastmath=_FLAGS, nogil=True, parallel=True)
def detect_parallel(addrs: Any, sizes: Any, like: Any) -> Any:
    """:func:`detect` with the work items spread over the machine's threads."""
    acc = like.dtype.type(0)
    for j in prange(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        part = like.dtype.type(0)
        for i in range(a.size):
            y = a[i]
            part += y - y
        acc += part
    return acc


@njit(cache=True, nogil=True)
def exponent_all_ones(bits: Any, mask: Any) -> bool:
    """Whether any element of the 1-D ``uint16`` array has every ``mask`` bit set."""
    top = np.uint16(0)
    for i in range(bits.size):
        top = max(top, np.uint16(bits[i] & mask))
    return top == mask


@njit(cache=True, nogil=True)
def detect_bits(addrs: Any, sizes: Any, masks: Any) -> bool:
    """Whether any ``uint16`` item has all of its exponent bits (``masks[j]``) set."""
    for j in range(addrs.size):
        if exponent_all_ones(numba.carray(_voidptr(addrs[j]), (sizes[j],), np.uint16), masks[j]):
            return True
    return False


@njit(cache=True, nogil=True, parallel=True)
def detect_bits_parallel(addrs: Any, sizes: Any, masks: Any) -> bool:
    """:func:`detect_bits` with the work items spread over the machine's threads."""
    hits = 0
    for j in prange(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), np.uint16)
        if exponent_all_ones(a, masks[j]):
            hits += 1
    return hits > 0


# -- one array per call: small sets, where building a table costs more than the work


@njit(cache=True, fastmath=_FLAGS, nogil=True)
def unscale_array(a: Any, inv: Any) -> Any:
    """:func:`unscale` for one 1-D contiguous array."""
    acc = inv - inv
    for i in range(a.size):
        y = a[i] * inv
        a[i] = y
        acc += y - y
    return acc


@njit(cache=True, fastmath=_FLAGS, nogil=True)
def detect_array(a: Any) -> Any:
    """:func:`detect` for one 1-D contiguous array."""
    acc = a.dtype.type(0)
    for i in range(a.size):
        y = a[i]
        acc += y - y
    return acc


# -- the global norm: unscale (or only read), detect and sum squares in one pass -------
#
# Each array, in memory order, is cut into chunks of NORM_CHUNK elements; a chunk's
# squares are summed in float64 (reassociated, so the loop runs in vectors: the
# order is this compiled loop's, the same on every call), and the chunks' sums are
# added exactly (math.fsum) by the caller, so neither the split of the work over
# threads nor table-or-array dispatch changes a bit of the result. Other paths sum
# in other orders; in float64 that moves the float32 norm by at most one ulp.

#: Elements per norm chunk (and at most per work item of a table).
NORM_CHUNK = 1 << 17


@njit(cache=True, fastmath=_FLAGS, nogil=True)
def chunk_norm(a: Any, inv: Any) -> Any:
    """``(sum of squares, det)`` of ``a * inv`` for one chunk, reading only.

    The sum is float64; ``det`` is NaN if any product is NaN or +-inf, else 0.
    """
    s = 0.0
    det = inv - inv
    for i in range(a.size):
        y = a[i] * inv
        v = np.float64(y)
        s += v * v
        det += y - y
    return s, det


@njit(cache=True, fastmath=_FLAGS, nogil=True)
def chunk_unscale_norm(a: Any, inv: Any) -> Any:
    """:func:`chunk_norm`, storing each product in place (unscale) as it goes."""
    s = 0.0
    det = inv - inv
    for i in range(a.size):
        y = a[i] * inv
        a[i] = y
        v = np.float64(y)
        s += v * v
        det += y - y
    return s, det


@njit(cache=True, nogil=True)
def norm_items(  # noqa: PLR0913, PLR0917 - a kernel takes its table's columns, no objects
    addrs: Any, sizes: Any, inv: Any, like: Any, write: Any, parts: Any
) -> Any:
    """Each work item's sum of squares into ``parts``; NaN if any product is not finite.

    Items are at most :data:`NORM_CHUNK` long and start at chunk boundaries, so each
    is one chunk. With ``write`` the products are stored (unscale).
    """
    det = inv - inv
    for j in range(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        if write:
            total, part = chunk_unscale_norm(a, inv)
        else:
            total, part = chunk_norm(a, inv)
        parts[j] = total
        det += part
    return det


@njit(cache=True, nogil=True, parallel=True)
def norm_items_parallel(  # noqa: PLR0913, PLR0917 - as norm_items
    addrs: Any, sizes: Any, inv: Any, like: Any, write: Any, parts: Any
) -> Any:
    """:func:`norm_items` with the work items spread over the machine's threads."""
    det = inv - inv
    for j in prange(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        if write:
            total, part = chunk_unscale_norm(a, inv)
        else:
            total, part = chunk_norm(a, inv)
        parts[j] = total
        det += part
    return det


@njit(cache=True, nogil=True)
def norm_array(a: Any, inv: Any, write: Any, parts: Any, first: Any) -> Any:
    """:func:`norm_items` for one 1-D contiguous array: its chunks' sums into
    ``parts[first:]``."""
    det = inv - inv
    j = first
    for lo in range(0, a.size, NORM_CHUNK):
        chunk = a[lo : lo + NORM_CHUNK]
        if write:
            total, part = chunk_unscale_norm(chunk, inv)
        else:
            total, part = chunk_norm(chunk, inv)
        parts[j] = total
        det += part
        j += 1
    return det


# -- clipping: the second pass, (x * inv) * coef, two roundings as unscale then clip --
# No fastmath: reassociation would turn it into x * (inv * coef), one rounding.


@njit(cache=True, nogil=True)
def clip_items(addrs: Any, sizes: Any, inv: Any, coef: Any, like: Any) -> None:
    """Store ``(x * inv) * coef`` for every element of every work item."""
    for j in range(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        for i in range(a.size):
            a[i] = (a[i] * inv) * coef


@njit(cache=True, nogil=True, parallel=True)
def clip_items_parallel(addrs: Any, sizes: Any, inv: Any, coef: Any, like: Any) -> None:
    """:func:`clip_items` with the work items spread over the machine's threads."""
    for j in prange(addrs.size):
        a = numba.carray(_voidptr(addrs[j]), (sizes[j],), like.dtype)
        for i in range(a.size):
            a[i] = (a[i] * inv) * coef


@njit(cache=True, nogil=True)
def clip_array(a: Any, inv: Any, coef: Any) -> None:
    """:func:`clip_items` for one 1-D contiguous array."""
    for i in range(a.size):
        a[i] = (a[i] * inv) * coef


# -- what a cached plan was built for: is every array still that? --------------------

#: The machine words of a ``PyArrayObject`` read by :func:`first_changed`: CPython's
#: object header (reference count, type), then NumPy's ``data``, ``nd``,
#: ``dimensions``, ``strides``, ``base``, ``descr`` and ``flags`` fields, in this order
#: in every NumPy since 1.7. The NumPy backend checks this layout on its own arrays
#: before trusting it (and caches no plan if it does not hold).
HEADER_WORDS = 9
_H_DATA, _H_ND, _H_DIMS, _H_STRIDES, _H_DESCR, _H_FLAGS = 2, 3, 4, 5, 7, 8
_LOW32 = 0xFFFFFFFF


@njit(cache=True, nogil=True)
def first_changed(objs: Any, expected: Any, starts: Any, flag_mask: Any) -> Any:
    """The index of the first array whose buffer, dtype, flags, shape or strides differ
    from ``expected``, or -1 if none does.

    ``objs[i]`` is the address of a live ``numpy.ndarray`` (its ``id``); from
    ``starts[i]`` on, ``expected`` holds its data address, dtype object address,
    flags (masked by ``flag_mask``), number of dimensions, then the shape and the
    strides. Reads a few words per array, so a set of 2000 arrays costs microseconds.
    """
    for i in range(objs.size):
        head = numba.carray(_voidptr(objs[i]), (HEADER_WORDS,), np.int64)
        j = starts[i]
        if head[_H_DATA] != expected[j] or head[_H_DESCR] != expected[j + 1]:
            return i
        if (head[_H_FLAGS] & _LOW32 & flag_mask) != expected[j + 2]:
            return i
        nd = head[_H_ND] & _LOW32
        if nd != expected[j + 3]:
            return i
        if nd:
            dims = numba.carray(_voidptr(head[_H_DIMS]), (nd,), np.int64)
            strides = numba.carray(_voidptr(head[_H_STRIDES]), (nd,), np.int64)
            for k in range(nd):
                if dims[k] != expected[j + 4 + k] or strides[k] != expected[j + 4 + nd + k]:
                    return i
    return -1
