"""The NumPy backend (the default): unscale and detect in one pass over memory.

Same results, bit for bit, as the clear reference in ``_numpy_reference.py``
(:class:`NumpyReferenceBackend`, kept as the oracle the tests compare
against), reached by one of two paths:

- ``"numba"`` (when numba imports): compiled kernels walk a table of
  ``(address, length)`` work items, so one call covers thousands of arrays,
  reads and writes each element once and allocates nothing proportional to the
  gradients. Large sets use both threads of the machine.
- ``"numpy"`` (no numba, or ``SCALER_CORE_NUMPY_FALLBACK=1``): each array in
  1 MiB chunks that stay in cache: multiply, then a float sum of the chunk; a
  finite sum proves the chunk finite, and only a non-finite sum pays an exact
  ``isfinite`` re-check.

Arrays that are not one contiguous block, and calls whose arrays overlap in
memory, take the reference code, which is exact by definition. float16 and
bfloat16 unscale through NumPy's own casts in cache-sized chunks (so the
rounding is NumPy's), and are checked with a bit test on their ``uint16`` view.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

from scaler_core._errors import BackendUnavailableError, InvalidArgumentError

from ._common import NORM_CHUNK, clip_coefficient, inv_scale_of, max_norm_of, norm_of_sums
from ._numpy_reference import (
    NumpyReferenceBackend,
    chunk_sums,
    clip_in_place,
    numpy_leaves,
    unscaled_copy,
)

__all__ = ["BACKEND", "ENV_FALLBACK", "REFERENCE", "NumpyBackend", "Plan", "plan_blocks"]

#: Set to ``1`` to force the pure-NumPy path even when numba is installed.
ENV_FALLBACK = "SCALER_CORE_NUMPY_FALLBACK"

#: The clear implementation every fast path is tested against.
REFERENCE = NumpyReferenceBackend()

_F16 = np.dtype(np.float16)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
#: The dtypes a plan takes as raw blocks (the numba kernels read them in place).
_WIDE = (_F32, _F64)
#: All-ones exponent of each half type: the element is NaN or +-inf.
_EXPONENT = {_F16: np.uint16(0x7C00), _BF16: np.uint16(0x7F80)}
#: Work-item and chunk size: small enough to stay in a core's L2 cache.
_CHUNK_BYTES = 1 << 20
#: Sets of at least this many bytes get one parallel region over all their work
#: items. Below it one thread wins: waking the others costs tens of us. At 8 MB
#: (2000 x 1024 float32) two threads took 0.28-0.34 ms against one thread's
#: 0.37-0.63 ms, interleaved with PyTorch's OpenMP work, and no call stalled.
_PARALLEL_MIN_BYTES = 4 << 20
#: One parallel region at a time, whichever thread calls: numba's workqueue threading
#: layer (used where neither TBB nor GNU OpenMP is installed, e.g. on many macOS setups)
#: aborts the process when two threads launch parallel regions at once. Two regions
#: at once would share the same cores anyway.
_PARALLEL_LOCK = threading.Lock()
#: Parallel detection walks the work items in batches of this many bytes and
#: stops after the first batch with a hit, as the serial kernels stop at it.
_DETECT_BATCH_BYTES = 64 << 20
#: Sets of at least this many arrays (in a flat list, tuple or dict, at most
#: _CACHE_MAX_BYTES in all) get a plan of address tables, cached: for them one
#: kernel call per array would cost more than the work. The cache holds
#: references to the arrays, so it is kept small.
_TABLE_MIN_LEAVES = 32
_CACHE_MAX_BYTES = 64 << 20
_CACHE_MAX_PLANS = 4


def _load_kernels() -> tuple[ModuleType | None, str]:
    if os.environ.get(ENV_FALLBACK, "").strip() not in ("", "0"):
        return None, f"{ENV_FALLBACK} is set"
    try:
        from . import _numpy_kernels  # noqa: PLC0415 (numba only on first use)
    except Exception as exc:  # numba missing, or built for another numpy
        return None, f"numba is unavailable ({type(exc).__name__}: {exc})"
    return _numpy_kernels, "numba imported"


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _is_block(a: np.ndarray) -> bool:
    """Whether the elements of ``a`` fill one contiguous block (C or Fortran order)."""
    flags = a.flags
    return bool(flags.c_contiguous or flags.f_contiguous)


def _flat(a: np.ndarray) -> np.ndarray:
    """A 1-D view of a contiguous block, in memory order (never a copy)."""
    return a.reshape(-1, order="F" if not a.flags.c_contiguous else "C")


def _bounds(a: np.ndarray) -> tuple[int, int]:
    low = high = _address(a)
    for n, stride in zip(a.shape, a.strides, strict=True):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + a.itemsize


class _Table:
    """Work items ``(address, length)`` of one dtype, split at ``_CHUNK_BYTES``."""

    __slots__ = ("addrs", "like", "masks", "nbytes", "sizes")

    def __init__(self, dtype: np.dtype[Any], addrs: np.ndarray, sizes: np.ndarray) -> None:
        # At most one norm chunk per item, so a table's items are the norm's chunks.
        per = max(1, min(_CHUNK_BYTES // dtype.itemsize, NORM_CHUNK))
        pieces = (sizes + per - 1) // per
        starts = np.repeat(np.cumsum(pieces) - pieces, pieces)
        offset = (np.arange(int(pieces.sum()), dtype=np.intp) - starts) * per
        whole = np.repeat(sizes, pieces)
        self.addrs = np.repeat(addrs, pieces) + offset * dtype.itemsize
        self.sizes = np.minimum(whole - offset, per)
        self.like = np.empty(0, dtype)
        self.masks = np.full(self.addrs.size, _EXPONENT.get(dtype, 0), dtype=np.uint16)
        self.nbytes = int(sizes.sum()) * dtype.itemsize


class _Plan:
    """What one call needs, built from validated leaves (cached for repeated sets)."""

    __slots__ = (
        "aliased",
        "children",
        "comparable",
        "halves",
        "keep",
        "nbytes",
        "strided",
        "tables",
        "watch",
    )

    def __init__(
        self,
        leaves: list[np.ndarray],
        blocks: Mapping[np.dtype[Any], tuple[list[int], list[int]]] | None = None,
        keep: list[Any] | None = None,
    ) -> None:
        """A plan over ``leaves`` (arrays of any layout) and ``blocks``: contiguous
        float32 or float64 memory given by dtype as ``(addresses, element counts)``,
        whose owners ``keep`` holds alive (another library's tensors: reading their
        addresses costs a fraction of a NumPy view's)."""
        # the tables hold raw addresses: keep the arrays (or the blocks' owners) alive
        self.keep: list[Any] = leaves if keep is None else keep
        # the container's children, when cached (a tuple as given, else a copy)
        self.children: list[Any] | tuple[Any, ...] = []
        self.comparable = False  # see _same_children
        self.tables: dict[np.dtype[Any], _Table] = {}
        self.strided: list[np.ndarray] = []
        self.halves: list[np.ndarray] = []
        self.aliased = False
        self.watch: _Watch | None = None  # set when the plan is cached
        starts: dict[np.dtype[Any], list[int]] = {}
        sizes: dict[np.dtype[Any], list[int]] = {}
        for dtype, (addresses, counts) in (blocks or {}).items():
            if dtype not in _WIDE:
                raise InvalidArgumentError(
                    f"blocks has a block of dtype {dtype}, but blocks must be float32 or float64 "
                    f"(half types go through NumPy's casts); pass their arrays in arrays instead"
                )
            starts.setdefault(dtype, []).extend(addresses)
            sizes.setdefault(dtype, []).extend(counts)
        bounds: list[tuple[int, int]] = []
        for a in leaves:
            if a.size == 0:
                continue
            if _is_block(a):
                starts.setdefault(a.dtype, []).append(_address(a))  # ~2 us an array
                sizes.setdefault(a.dtype, []).append(a.size)
                if a.dtype in _EXPONENT:
                    self.halves.append(_flat(a))
            else:
                self.strided.append(a)
                bounds.append(_bounds(a))
        low = [np.array([b[0] for b in bounds], dtype=np.intp)]
        high = [np.array([b[1] for b in bounds], dtype=np.intp)]
        self.nbytes = sum(a.nbytes for a in self.strided)
        for dtype, at in starts.items():
            addrs = np.array(at, dtype=np.intp)
            lengths = np.array(sizes[dtype], dtype=np.intp)
            kept = lengths > 0
            if not kept.all():
                addrs, lengths = addrs[kept], lengths[kept]
            if not lengths.size:
                continue
            table = self.tables[dtype] = _Table(dtype, addrs, lengths)
            self.nbytes += table.nbytes
            low.append(addrs)
            high.append(addrs + lengths * dtype.itemsize)
        lows, highs = np.concatenate(low), np.concatenate(high)
        order = np.argsort(lows, kind="stable")
        self.aliased = bool(np.any(highs[order][:-1] > lows[order][1:]))


def plan_blocks(
    arrays: list[np.ndarray],
    blocks: Mapping[np.dtype[Any], tuple[list[int], list[int]]],
    keep: list[Any],
) -> _Plan:
    """A plan of work tables for the numba path from validated, writable ``arrays`` (any
    layout and float dtype) and ``blocks`` (contiguous float32 or float64 memory, by
    dtype: addresses and element counts), owned by objects in ``keep``, which the caller
    keeps alive and unchanged for the call. One call's plan: never cached. Check
    ``plan.aliased`` before handing it to :meth:`NumpyBackend.clip_planned` or
    :meth:`NumpyBackend.norm_planned` (overlapping memory takes the reference's code).
    """
    return _Plan(arrays, blocks, keep)


#: What :func:`plan_blocks` returns (a plan's fields are this module's business).
Plan = _Plan

#: The flags a plan depends on: the two contiguity flags, alignment and writeability
#: (NumPy's NPY_ARRAY_C_CONTIGUOUS, _F_CONTIGUOUS, _ALIGNED and _WRITEABLE).
_FLAG_MASK = 0x1 | 0x2 | 0x100 | 0x400


def _describe(a: np.ndarray) -> list[int]:
    """What a plan assumes of ``a``: buffer, dtype object, flags, rank, shape, strides."""
    start = _address(a)
    return [start, id(a.dtype), a.flags.num & _FLAG_MASK, a.ndim, *a.shape, *a.strides]


class _Watch:
    """What a cached plan was built for, checked in compiled code at every call.

    A cached set is recognised by the identity of its arrays, but an array can change
    under the same identity: ``resize`` moves or shrinks its buffer, assigning
    ``.dtype`` or ``.shape`` re-reads its bytes, ``flags.writeable`` can be cleared.
    :func:`_numpy_kernels.first_changed` compares each array's header, read from
    memory (a few words an array: microseconds for 2000), with what the plan saw; on
    any difference the plan is dropped and the set is validated and planned again.
    """

    __slots__ = ("expected", "objs", "starts")

    def __init__(self, leaves: list[np.ndarray]) -> None:
        rows = [_describe(a) for a in leaves]
        self.objs = np.array([id(a) for a in leaves], dtype=np.intp)
        self.starts = np.cumsum([0] + [len(r) for r in rows[:-1]], dtype=np.intp)
        self.expected = np.array([v for r in rows for v in r], dtype=np.int64)

    def changed(self, kernels: ModuleType) -> bool:
        return int(kernels.first_changed(self.objs, self.expected, self.starts, _FLAG_MASK)) >= 0


def _watch_works(kernels: ModuleType) -> bool:
    """Whether :class:`_Watch` reads this NumPy's array headers right (checked once).

    The header layout is NumPy's C ABI; on a platform where it differs (or a future
    NumPy), this says no and no plan is cached, which costs speed, never correctness.
    """
    try:
        base = np.zeros((4, 6), np.float32)
        samples: list[np.ndarray] = [
            base,
            np.asfortranarray(base),
            base[:, ::2],
            np.zeros((), np.float64),
            np.zeros((0, 3), np.float16),
            np.ones(5, ml_dtypes.bfloat16),
        ]
        watch = _Watch(samples)
        if watch.changed(kernels):
            return False
        probes = [np.ones(8, np.float32) for _ in range(4)]
        watches = [_Watch([probe]) for probe in probes]
        probes[0].flags.writeable = False
        setattr(probes[1], "dtype", np.int32)  # noqa: B010 (typed read-only, settable)
        probes[2].shape = (2, 4)
        probes[3].resize(16, refcheck=False)
        return all(w.changed(kernels) for w in watches)
    except Exception:  # any surprise: do not trust the layout
        return False


#: From NumPy 2.2 on, an array comparison that has no single truth value (more
#: than one element, none, or shapes that do not broadcast) raises in ``bool()``.
_EQ_RAISES = np.lib.NumpyVersion(np.__version__) >= "2.2.0"
#: ... for arrays of at least this many elements (a one-element comparison is a bool).
_EQ_MIN_SIZE = 2


def _same_children(plan: _Plan, children: list[Any] | tuple[Any, ...]) -> bool:
    """Whether ``children`` are, item by item, the very objects ``plan`` was built for.

    The plan holds its objects, so their ids cannot be reused meanwhile. The same
    tuple object is proof by itself (a tuple cannot change). Otherwise, when the
    plan is ``comparable`` (every cached item None or an ndarray of at least two
    elements), ``cached == children`` decides: list and tuple equality compare
    items by identity first, a pointer compare that touches no array (2000
    arrays: ~2 us, against ~40 us for ``operator.is_`` over them, more when the
    arrays' headers are out of cache), and a differing pair is compared by value,
    which for such an array raises or is False, so the answer is never a false
    "same" (short of an object that opts out of NumPy's comparison and claims
    equality with any array).
    """
    cached = plan.children
    if children is cached:
        return True
    if plan.comparable and type(children) is type(cached):
        try:
            return bool(cached == children)
        except Exception:  # a differing pair: not the same set
            return False
    return all(map(operator.is_, children, cached))


def _children(grads: Any) -> list[Any] | tuple[Any, ...] | None:
    """The direct children of a flat container the plan cache can recognise."""
    if isinstance(grads, (list, tuple)):
        return grads
    if isinstance(grads, dict):
        return list(grads.values())
    return None


def _leaves(prepared: _Plan | list[np.ndarray]) -> list[np.ndarray]:
    return prepared if isinstance(prepared, list) else prepared.keep


def _numpy_finite(chunk: np.ndarray) -> bool:
    """Exact finiteness of a float32/float64 chunk, paying for ``isfinite`` only on doubt."""
    total = np.add.reduce(chunk, axis=None)
    return math.isfinite(total) or bool(np.isfinite(chunk).all())


def _numpy_half_finite(bits: np.ndarray, mask: np.uint16, scratch: np.ndarray) -> bool:
    out = scratch[: bits.size]
    np.bitwise_and(bits, mask, out=out)
    return bool(out.max() != mask)


class NumpyBackend(NumpyReferenceBackend):
    """The NumPy backend's fast path; results identical to :class:`NumpyReferenceBackend`.

    Args:
        use_numba: ``True`` requires numba, ``False`` forces the pure-NumPy
            path, ``None`` (the default) uses numba when it imports and
            ``SCALER_CORE_NUMPY_FALLBACK`` is not set.

    Raises:
        BackendUnavailableError: ``use_numba=True`` and numba does not import.

    >>> import numpy as np
    >>> from scaler_core import get_backend
    >>> backend = get_backend("numpy")
    >>> backend.path in ("numba", "numpy")
    True
    >>> g = [np.array([2.0, 4.0], np.float32), np.array([np.inf], np.float16)]
    >>> _, found = backend.unscale(g, 2.0)
    >>> g[0].tolist(), bool(found)
    ([1.0, 2.0], True)
    """

    name = "numpy"

    def __init__(self, *, use_numba: bool | None = None) -> None:
        self._use_numba = use_numba
        self._kernels: ModuleType | None = None
        self._why = ""
        self._resolved = False
        self._lock = threading.Lock()
        self._plans: OrderedDict[tuple[bool, int, int, int], _Plan] = OrderedDict()
        self._watch_ok: bool | None = None

    def _resolve(self) -> ModuleType | None:
        if not self._resolved:
            with self._lock:
                if not self._resolved:
                    if self._use_numba is False:
                        self._kernels, self._why = None, "use_numba=False"
                    else:
                        self._kernels, self._why = _load_kernels()
                        if self._kernels is None and self._use_numba:
                            raise BackendUnavailableError(
                                f"use_numba=True, but {self._why}; install it with "
                                f"pip install 'scaler-core[fast]'"
                            )
                    self._resolved = True
        return self._kernels

    @property
    def path(self) -> str:
        """``"numba"`` or ``"numpy"``: the path this backend's calls take."""
        return "numpy" if self._resolve() is None else "numba"

    @property
    def path_reason(self) -> str:
        """Why :attr:`path` is what it is (for logs and bug reports)."""
        self._resolve()
        return self._why

    def clear_cache(self) -> None:
        """Drop the cached plans and with them the references to gradient arrays."""
        with self._lock:
            self._plans.clear()

    def __repr__(self) -> str:
        arg = "" if self._use_numba is None else f"use_numba={self._use_numba!r}"
        return f"NumpyBackend({arg})"

    # -- plans ---------------------------------------------------------------

    def _prepare(self, grads: Any, *, writable: bool) -> _Plan | list[np.ndarray]:
        """Validated leaves, or a plan of address tables (numba path only).

        A flat list, tuple or dict of many small arrays seen before gets its cached
        plan, once the same objects are confirmed (:func:`_same_children`) and each
        array is confirmed unchanged since (:class:`_Watch`); otherwise the set is
        validated as :func:`numpy_leaves` does, before anything is modified.
        """
        kernels = self._resolve()
        children = _children(grads) if kernels is not None and self._watching() else None
        key = None
        if children is not None and len(children) >= _TABLE_MIN_LEAVES:
            # A cheap key finds the candidate; identity of every child confirms it
            # (the plan holds its arrays, so an id cannot be reused meanwhile).
            key = (writable, len(children), id(children[0]), id(children[-1]))
            plan = self._plans.get(key)
            if plan is not None and _same_children(plan, children):
                watch = plan.watch
                if kernels is not None and watch is not None and not watch.changed(kernels):
                    with self._lock:
                        if key in self._plans:
                            self._plans.move_to_end(key)
                    return plan
                with self._lock:  # an array changed under its identity: plan again
                    self._plans.pop(key, None)
        leaves = [leaf for _, leaf in numpy_leaves(grads, writable=writable)]
        if kernels is None:
            return leaves
        nbytes = sum(a.nbytes for a in leaves)
        if (
            key is None
            or children is None
            or len(leaves) < _TABLE_MIN_LEAVES
            or not all(c is None or isinstance(c, np.ndarray) for c in children)
            or nbytes > _CACHE_MAX_BYTES
        ):
            if nbytes >= _PARALLEL_MIN_BYTES:
                return _Plan(leaves)  # one parallel region for the whole set
            return leaves
        plan = _Plan(leaves)
        plan.children = children if type(children) is tuple else list(children)
        plan.comparable = _EQ_RAISES and all(
            c is None or (type(c) is np.ndarray and c.size >= _EQ_MIN_SIZE) for c in children
        )
        plan.watch = _Watch(leaves)
        with self._lock:
            self._plans[key] = plan
            total = sum(p.nbytes for p in self._plans.values())
            while len(self._plans) > _CACHE_MAX_PLANS or total > _CACHE_MAX_BYTES:
                _, dropped = self._plans.popitem(last=False)
                total -= dropped.nbytes
        return plan

    def _watching(self) -> bool:
        """Whether cached plans can be checked here (see :func:`_watch_works`)."""
        if self._watch_ok is None:
            kernels = self._resolve()
            self._watch_ok = kernels is not None and _watch_works(kernels)
        return self._watch_ok

    # -- the backend ---------------------------------------------------------

    def unscale(self, grads: Any, scale: Any) -> tuple[Any, np.bool_]:
        """See :meth:`scaler_core.Backend.unscale`: in place, one pass per array."""
        inv = inv_scale_of(scale)
        kernels = self._resolve()
        if kernels is None:
            leaves = _leaves(self._prepare(grads, writable=True))
            with np.errstate(all="ignore"):
                return grads, np.bool_(_numpy_unscale(leaves, inv))
        prepared = self._prepare(grads, writable=True)
        with np.errstate(all="ignore"):
            if isinstance(prepared, list):
                return grads, np.bool_(_numba_unscale_arrays(kernels, prepared, inv))
            if prepared.aliased:
                return REFERENCE.unscale(grads, scale)
            if inv == 1.0:  # the reference writes nothing: neither do we
                return grads, np.bool_(_numba_detect(kernels, prepared))
            return grads, np.bool_(_numba_unscale(kernels, prepared, inv))

    def unscale_norm(self, grads: Any, scale: Any) -> tuple[Any, np.bool_, np.float32]:
        """See :meth:`scaler_core.Backend.unscale_norm`: one pass, reads and writes once."""
        inv = inv_scale_of(scale)
        prepared = self._prepare(grads, writable=True)
        if _overlaps(prepared):
            return REFERENCE.unscale_norm(grads, scale)
        found, norm = self.norm_planned(prepared, inv)
        return grads, found, norm

    def norm_planned(self, prepared: _Plan | list[np.ndarray], inv: float) -> tuple[Any, Any]:
        """:meth:`unscale_norm` of validated leaves or a plan none of whose arrays
        overlap (see :func:`plan_blocks`): ``(found, norm)``."""
        with np.errstate(all="ignore"):
            found, sums = self._measure(prepared, inv, write=inv != 1.0)
            return np.bool_(found), norm_of_sums(sums)

    def unscale_clip(
        self,
        grads: Any,
        scale: Any,
        max_norm: float,
        reduce: Callable[[Any], Any] | None = None,
    ) -> tuple[Any, Any, np.float32]:
        """See :meth:`scaler_core.Backend.unscale_clip`: a read, then a write if stepping."""
        inv = inv_scale_of(scale)
        limit = max_norm_of(max_norm)
        prepared = self._prepare(grads, writable=True)
        if _overlaps(prepared):
            return REFERENCE.unscale_clip(grads, scale, max_norm, reduce)
        flag, norm = self.clip_planned(prepared, inv, limit, reduce)
        return grads, flag, norm

    def clip_planned(
        self,
        prepared: _Plan | list[np.ndarray],
        inv: float,
        limit: float,
        reduce: Callable[[Any], Any] | None = None,
    ) -> tuple[Any, np.float32]:
        """:meth:`unscale_clip` of validated leaves or a plan none of whose arrays
        overlap (see :func:`plan_blocks`), with the inverse scale and the limit already
        checked: ``(flag, norm)``."""
        with np.errstate(all="ignore"):
            found, sums = self._measure(prepared, inv, write=False)
            norm = norm_of_sums(sums)
            flag: Any = np.bool_(found)
            if reduce is not None:
                flag = reduce(flag)
            if self.to_bool(flag):
                return flag, norm
            coef = clip_coefficient(norm, limit)
            if inv != 1.0 or coef != 1.0:  # else nothing would change: write nothing
                _clip(self._resolve(), prepared, inv, coef)
        return flag, norm

    def _measure(
        self, prepared: _Plan | list[np.ndarray], inv: float, *, write: bool
    ) -> tuple[bool, list[float]]:
        """The flag and the chunks' sums of squares of the unscaled values (stored if
        ``write``), by the numba kernels or the pure-NumPy code."""
        kernels = self._resolve()
        if kernels is None:
            return _numpy_norm(_leaves(prepared), inv, write)
        if isinstance(prepared, list):
            return _numba_norm_arrays(kernels, prepared, inv, write)
        return _numba_norm(kernels, prepared, inv, write)

    def find_non_finite(self, grads: Any) -> np.bool_:
        """See :meth:`scaler_core.Backend.find_non_finite`: reads each element once."""
        kernels = self._resolve()
        if kernels is None:
            leaves = _leaves(self._prepare(grads, writable=False))
            with np.errstate(all="ignore"):
                return np.bool_(_numpy_detect(leaves))
        prepared = self._prepare(grads, writable=False)
        with np.errstate(invalid="ignore"):  # a signalling NaN is an answer, not a warning
            if isinstance(prepared, list):
                return np.bool_(_numba_detect_arrays(kernels, prepared))
            return np.bool_(_numba_detect(kernels, prepared))


# -- the numba path -----------------------------------------------------------

#: The process whose numba threads have started (None: not yet; -1: they could not
#: start, and every process runs the one-thread kernels). A child forked after that
#: inherits a thread pool that is not there: GNU OpenMP kills it at its first
#: parallel region ("fork() called from a process already using GNU OpenMP"). So a
#: forked child (multiprocessing's default start on Linux, data loaders) runs the
#: one-thread kernels: the same results, on one core.
_THREADS_PID: list[int | None] = [None]
#: Held while the threads start, so two first callers start them once.
_START_LOCK = threading.Lock()


#: A float32 subnormal: multiplied by 1 in the calling thread it stays itself, unless
#: the thread flushes subnormals (FTZ/DAZ, e.g. after torch.set_flush_denormal(True)).
_SUBNORMAL, _ONE = np.float32(1e-40), np.float32(1.0)


def _flushes_subnormals() -> bool:
    """Whether the calling thread's floating-point mode flushes subnormals to zero."""
    return bool(_SUBNORMAL * _ONE == 0)


def _use_threads(kernels: ModuleType, nbytes: int) -> bool:
    """Whether a set of ``nbytes`` runs on all threads, here, in this process.

    Not when the calling thread flushes subnormals: numba's threads keep the mode
    they started with, while NumPy (the reference) computes in the caller's mode. On
    the calling thread the kernels give the reference's results in every mode.

    The first time it says yes, numba's threads are started from a thread of their
    own (:func:`_numpy_kernels.start_threads`), before any parallel kernel runs, so
    the caller's OpenMP and PyTorch thread counts stay as they are. Where they
    cannot start (no threading layer loads), the one-thread kernels serve.
    """
    if nbytes < _PARALLEL_MIN_BYTES or _flushes_subnormals():
        return False
    pid = os.getpid()
    if _THREADS_PID[0] is None:
        with _START_LOCK:
            if _THREADS_PID[0] is None:
                try:
                    kernels.start_threads()
                except Exception:  # no threading layer: the same results on one thread
                    _THREADS_PID[0] = -1
                else:
                    _THREADS_PID[0] = pid
    return _THREADS_PID[0] == pid


def _numba_unscale(k: ModuleType, plan: _Plan, inv: float) -> bool:
    found = False
    parallel = _use_threads(k, plan.nbytes)
    for dtype, table in plan.tables.items():
        if dtype in _EXPONENT:
            continue
        threads = parallel and table.addrs.size > 1
        run = k.unscale_parallel if threads else k.unscale
        with _PARALLEL_LOCK if threads else contextlib.nullcontext():
            acc = run(table.addrs, table.sizes, dtype.type(inv), table.like)
        found = found or math.isnan(acc)
    for flat in plan.halves:
        found = _half_unscale(flat, inv, k) or found
    for g in plan.strided:
        found = _reference_unscale(g, inv) or found
    return found


def _numba_detect(k: ModuleType, plan: _Plan) -> bool:
    parallel = _use_threads(k, plan.nbytes)
    for dtype, table in plan.tables.items():
        n = table.addrs.size
        step = max(1, _DETECT_BATCH_BYTES // _CHUNK_BYTES) if parallel else max(1, n)
        for lo in range(0, n, step):
            if _detect_items(k, dtype, table, slice(lo, lo + step), parallel and n > 1):
                return True
    return any(not bool(np.isfinite(g).all()) for g in plan.strided)


def _detect_items(
    k: ModuleType, dtype: np.dtype[Any], table: _Table, part: slice, parallel: bool
) -> bool:
    """Whether the work items ``part`` of ``table`` hold a NaN or +-inf."""
    addrs, sizes = table.addrs[part], table.sizes[part]
    if dtype in _EXPONENT:
        run = k.detect_bits_parallel if parallel else k.detect_bits
        with _PARALLEL_LOCK if parallel else contextlib.nullcontext():
            return bool(run(addrs, sizes, table.masks[part]))
    run = k.detect_parallel if parallel else k.detect
    with _PARALLEL_LOCK if parallel else contextlib.nullcontext():
        return math.isnan(run(addrs, sizes, table.like))


def _numba_unscale_arrays(k: ModuleType, leaves: list[np.ndarray], inv: float) -> bool:
    """One serial kernel call per array, in the reference's order (overlaps behave alike)."""
    found = False
    for g in leaves:
        if g.size == 0:
            continue
        if inv == 1.0:  # the reference writes nothing: neither do we
            found = found or _numba_detect_arrays(k, [g])
        elif not _is_block(g):
            found = _reference_unscale(g, inv) or found
        elif g.dtype in _EXPONENT:
            found = _half_unscale(_flat(g), inv, k) or found
        else:
            found = math.isnan(k.unscale_array(_flat(g), g.dtype.type(inv))) or found
    return found


def _numba_detect_arrays(k: ModuleType, leaves: list[np.ndarray]) -> bool:
    def hit(flat: np.ndarray) -> bool:
        if flat.dtype in _EXPONENT:
            return bool(k.exponent_all_ones(flat.view(np.uint16), _EXPONENT[flat.dtype]))
        return math.isnan(k.detect_array(flat))

    return _detect_leaves(leaves, hit)


# -- shared pieces ------------------------------------------------------------


def _reference_unscale(g: np.ndarray, inv: float) -> bool:
    """The reference's own arithmetic for one array; whether it is now non-finite."""
    if g.dtype in _EXPONENT:
        g[...] = np.multiply(g, np.float32(inv), dtype=np.float32)
    else:
        np.multiply(g, g.dtype.type(inv), out=g)
    return not bool(np.isfinite(g).all())


def _half_unscale(flat: np.ndarray, inv: float, kernels: ModuleType | None) -> bool:
    """float16/bfloat16 through NumPy's casts, a cache-sized chunk at a time."""
    mask = _EXPONENT[flat.dtype]
    step = _CHUNK_BYTES // 4  # elements per chunk, counted by the float32 temporary
    temp = np.empty(min(step, flat.size), np.float32)
    scratch = np.empty(temp.size, np.uint16)
    factor = np.float32(inv)
    found = False
    for lo in range(0, flat.size, step):
        chunk = flat[lo : lo + step]
        out = temp[: chunk.size]
        np.multiply(chunk, factor, out=out, dtype=np.float32)
        chunk[...] = out
        if not found:
            bits = chunk.view(np.uint16)
            if kernels is not None:
                found = bool(kernels.exponent_all_ones(bits, mask))
            else:
                found = not _numpy_half_finite(bits, mask, scratch)
    return found


# -- the norm and clipping ----------------------------------------------------


def _overlaps(prepared: _Plan | list[np.ndarray]) -> bool:
    """Whether two arrays share memory: those calls take the reference's code."""
    if isinstance(prepared, _Plan):
        return prepared.aliased
    spans = sorted(
        (_address(a), _address(a) + a.nbytes) if _is_block(a) else _bounds(a)
        for a in prepared
        if a.size
    )
    return any(prev[1] > cur[0] for prev, cur in itertools.pairwise(spans))


def _strided_norm(g: np.ndarray, inv: float, write: bool) -> tuple[bool, list[float]]:
    """The reference's own arithmetic for an array that is not one block."""
    if write:
        _reference_unscale(g, inv)
        u = g
    else:
        u = unscaled_copy(g, inv)
    return not bool(np.isfinite(u).all()), chunk_sums(u)


def _half_norm(
    flat: np.ndarray, inv: float, write: bool, kernels: ModuleType | None
) -> tuple[bool, list[float]]:
    """float16/bfloat16 a norm chunk at a time: NumPy's casts, then the squares of the
    stored values (exact in float32) summed in float64."""
    temp = np.empty(min(NORM_CHUNK, flat.size), np.float32)
    factor, one = np.float32(inv), np.float32(1.0)
    sums: list[float] = []
    for lo in range(0, flat.size, NORM_CHUNK):
        chunk = flat[lo : lo + NORM_CHUNK]
        out = temp[: chunk.size]
        np.multiply(chunk, factor, out=out, dtype=np.float32)
        stored = out.astype(flat.dtype)
        if write:
            chunk[...] = stored
        np.copyto(out, stored)  # exact: every half value is a float32
        if kernels is not None:
            sums.append(float(kernels.chunk_norm(out, one)[0]))
        else:
            wide = out.astype(np.float64)
            sums.append(float(np.dot(wide, wide)))
    # Squares of half values cannot overflow float64: a non-finite sum is a NaN/inf.
    return not all(math.isfinite(s) for s in sums), sums


def _numba_norm(k: ModuleType, plan: _Plan, inv: float, write: bool) -> tuple[bool, list[float]]:
    found = False
    sums: list[float] = []
    parallel = _use_threads(k, plan.nbytes)
    for dtype, table in plan.tables.items():
        if dtype in _EXPONENT:
            continue
        parts = np.empty(table.addrs.size)
        threads = parallel and table.addrs.size > 1
        run = k.norm_items_parallel if threads else k.norm_items
        with _PARALLEL_LOCK if threads else contextlib.nullcontext():
            det = run(table.addrs, table.sizes, dtype.type(inv), table.like, write, parts)
        found = found or math.isnan(det)
        sums.extend(parts.tolist())
    for hit, part in itertools.chain(
        (_half_norm(flat, inv, write, k) for flat in plan.halves),
        (_strided_norm(g, inv, write) for g in plan.strided),
    ):
        found = found or hit
        sums.extend(part)
    return found, sums


def _numba_norm_arrays(
    k: ModuleType, leaves: list[np.ndarray], inv: float, write: bool
) -> tuple[bool, list[float]]:
    def block(flat: np.ndarray) -> tuple[bool, list[float]]:
        parts = np.empty(-(-flat.size // NORM_CHUNK))
        hit = math.isnan(k.norm_array(flat, flat.dtype.type(inv), write, parts, 0))
        return hit, parts.tolist()

    return _norm_leaves(leaves, inv, write, k, block)


def _numpy_norm(leaves: list[np.ndarray], inv: float, write: bool) -> tuple[bool, list[float]]:
    return _norm_leaves(leaves, inv, write, None, lambda f: _numpy_block_norm(f, inv, write))


def _norm_leaves(
    leaves: list[np.ndarray],
    inv: float,
    write: bool,
    kernels: ModuleType | None,
    block: Callable[[np.ndarray], tuple[bool, list[float]]],
) -> tuple[bool, list[float]]:
    """The flag and the chunks' sums, array by array: ``block`` for float32/float64
    blocks, NumPy's casts for halves, the reference's arithmetic for strided arrays
    (shared by the numba and pure-NumPy paths)."""
    found = False
    sums: list[float] = []
    for g in leaves:
        if g.size == 0:
            continue
        if not _is_block(g):
            hit, part = _strided_norm(g, inv, write)
        elif g.dtype in _EXPONENT:
            hit, part = _half_norm(_flat(g), inv, write, kernels)
        else:
            hit, part = block(_flat(g))
        found = found or hit
        sums.extend(part)
    return found, sums


def _numpy_block_norm(flat: np.ndarray, inv: float, write: bool) -> tuple[bool, list[float]]:
    factor = flat.dtype.type(inv)
    wide = flat.dtype == _F64
    temp = None if write else np.empty(min(NORM_CHUNK, flat.size), flat.dtype)
    found = False
    sums: list[float] = []
    for lo in range(0, flat.size, NORM_CHUNK):
        chunk = flat[lo : lo + NORM_CHUNK]
        if temp is None:
            u = np.multiply(chunk, factor, out=chunk)
        else:
            u = np.multiply(chunk, factor, out=temp[: chunk.size])
        u64 = u if wide else u.astype(np.float64)
        total = float(np.dot(u64, u64))
        sums.append(total)
        # float32 squares cannot overflow float64 (a non-finite sum is a NaN/inf);
        # float64 squares can, so float64 is checked exactly.
        found = found or (not _numpy_finite(u) if wide else not math.isfinite(total))
    return found, sums


def _clip(
    kernels: ModuleType | None, prepared: _Plan | list[np.ndarray], inv: float, coef: np.float32
) -> None:
    """The second pass: store ``(x * inv) * coef`` (two roundings) in every element."""
    if kernels is not None and isinstance(prepared, _Plan):
        parallel = _use_threads(kernels, prepared.nbytes)
        for dtype, table in prepared.tables.items():
            if dtype in _EXPONENT:
                continue
            threads = parallel and table.addrs.size > 1
            run = kernels.clip_items_parallel if threads else kernels.clip_items
            with _PARALLEL_LOCK if threads else contextlib.nullcontext():
                run(table.addrs, table.sizes, dtype.type(inv), dtype.type(coef), table.like)
        _clip_rest(prepared.halves, prepared.strided, inv, coef)
        return
    halves, strided = [], []
    for g in _leaves(prepared):
        if not g.size:
            continue
        if not _is_block(g):
            strided.append(g)
            continue
        if g.dtype in _EXPONENT:
            halves.append(_flat(g))
            continue
        flat, factor, scale = _flat(g), g.dtype.type(inv), g.dtype.type(coef)
        if kernels is not None:
            kernels.clip_array(flat, factor, scale)
            continue
        for lo in range(0, flat.size, NORM_CHUNK):  # both products while the chunk is in cache
            chunk = flat[lo : lo + NORM_CHUNK]
            np.multiply(chunk, factor, out=chunk)
            np.multiply(chunk, scale, out=chunk)
    _clip_rest(halves, strided, inv, coef)


def _clip_rest(
    halves: Iterable[np.ndarray], strided: Iterable[np.ndarray], inv: float, coef: np.float32
) -> None:
    """Clipping of half-precision blocks (NumPy's casts) and of strided arrays."""
    factor = np.float32(inv)
    for flat in halves:
        temp = np.empty(min(NORM_CHUNK, flat.size), np.float32)
        for lo in range(0, flat.size, NORM_CHUNK):
            chunk = flat[lo : lo + NORM_CHUNK]
            out = temp[: chunk.size]
            np.multiply(chunk, factor, out=out, dtype=np.float32)
            stored = out.astype(flat.dtype)
            np.multiply(stored, coef, out=out, dtype=np.float32)
            chunk[...] = out
    for g in strided:
        clip_in_place(g, unscaled_copy(g, inv), coef)


# -- the pure-NumPy path ------------------------------------------------------


def _numpy_unscale(leaves: list[np.ndarray], inv: float) -> bool:
    found = False
    for g in leaves:
        if g.size == 0:
            continue
        if inv == 1.0:  # the reference writes nothing
            found = found or _numpy_detect([g])
        elif not _is_block(g):
            found = _reference_unscale(g, inv) or found
        elif g.dtype in _EXPONENT:
            found = _half_unscale(_flat(g), inv, None) or found
        elif g.nbytes <= _CHUNK_BYTES:  # already cache-sized: no chunking to pay for
            np.multiply(g, g.dtype.type(inv), out=g)
            found = found or not _numpy_finite(g)
        else:
            flat = _flat(g)
            factor = g.dtype.type(inv)
            step = _CHUNK_BYTES // g.itemsize
            for lo in range(0, flat.size, step):
                chunk = flat[lo : lo + step]
                np.multiply(chunk, factor, out=chunk)
                found = found or not _numpy_finite(chunk)
    return found


def _numpy_detect(leaves: list[np.ndarray]) -> bool:
    def hit(flat: np.ndarray) -> bool:
        step = _CHUNK_BYTES // flat.itemsize
        if flat.dtype in _EXPONENT:
            bits = flat.view(np.uint16)
            mask = _EXPONENT[flat.dtype]
            scratch = np.empty(min(step, flat.size), np.uint16)
            return any(
                not _numpy_half_finite(bits[lo : lo + step], mask, scratch)
                for lo in range(0, flat.size, step)
            )
        return any(not _numpy_finite(flat[lo : lo + step]) for lo in range(0, flat.size, step))

    return _detect_leaves(leaves, hit)


def _detect_leaves(leaves: list[np.ndarray], block_hit: Callable[[np.ndarray], bool]) -> bool:
    """Whether any leaf holds NaN/inf: ``block_hit`` on each contiguous leaf's flat view,
    an exact ``isfinite`` on strided ones (shared by the numba and pure-NumPy paths)."""
    for g in leaves:
        if g.size == 0:
            continue
        if not _is_block(g):
            if not np.isfinite(g).all():
                return True
        elif block_hit(_flat(g)):
            return True
    return False


BACKEND = NumpyBackend()
