"""The NumPy backend's plans: its arrays' memory as tables of work items, and their cache.

A plan is what one call of the numba path needs, built from validated leaves: the
contiguous float32/float64 blocks as ``(address, length)`` work items by dtype (one
compiled call covers thousands of arrays), the float16/bfloat16 blocks and the
strided arrays apart, and whether any two arrays overlap in memory. The backend's
operations (``_numpy.py``) run plans; the torch backend builds them from tensors'
addresses (:func:`plan_blocks`). A set of many small arrays that comes back call
after call finds its plan again in a :class:`PlanCache`, by the arrays' identities,
once a compiled check has confirmed that none of them changed in place.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType, ModuleType
from typing import Any, ClassVar, NamedTuple

import numpy as np

from scaler_core._errors import InvalidArgumentError

from ._common import HALF_DTYPES, NORM_CHUNK

__all__ = [
    "CHUNK_BYTES",
    "EXPONENT",
    "Plan",
    "PlanCache",
    "Table",
    "address_of",
    "bounds_of",
    "flat_view",
    "is_block",
    "plan_blocks",
]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
#: The dtypes a plan takes as raw blocks (the numba kernels read them in place).
_WIDE = (_F32, _F64)


class _HalfExponents:
    """The all-ones exponent of each half type (the element is NaN or +-inf), by
    dtype, as a dict would give it; ``in`` tells the half types (bfloat16 through
    :data:`HALF_DTYPES`, without importing ml_dtypes unless it is in use)."""

    __slots__ = ()

    _BY_NAME: ClassVar[Mapping[str, np.uint16]] = MappingProxyType(
        {"float16": np.uint16(0x7C00), "bfloat16": np.uint16(0x7F80)}
    )

    def __contains__(self, dtype: object) -> bool:
        return dtype in HALF_DTYPES

    def __getitem__(self, dtype: np.dtype[Any]) -> np.uint16:
        return self._BY_NAME[dtype.name]  # the leaves are validated: a name is its dtype

    def get(self, dtype: np.dtype[Any], default: int) -> np.uint16 | int:
        return self[dtype] if dtype in HALF_DTYPES else default


#: All-ones exponent of each half type: the element is NaN or +-inf.
EXPONENT = _HalfExponents()
#: Work-item and chunk size: small enough to stay in a core's L2 cache.
CHUNK_BYTES = 1 << 20
#: Sets of at least this many arrays (in a flat list, tuple or dict, at most
#: _CACHE_MAX_BYTES in all) get a plan of address tables, cached: for them one
#: kernel call per array would cost more than the work. The cache holds
#: references to the arrays, so it is kept small.
_TABLE_MIN_LEAVES = 32
_CACHE_MAX_BYTES = 64 << 20
_CACHE_MAX_PLANS = 4


def address_of(a: np.ndarray) -> int:
    """The address of the first element of ``a``."""
    return int(a.__array_interface__["data"][0])


def is_block(a: np.ndarray) -> bool:
    """Whether the elements of ``a`` fill one contiguous block (C or Fortran order)."""
    flags = a.flags
    return bool(flags.c_contiguous or flags.f_contiguous)


def flat_view(a: np.ndarray) -> np.ndarray:
    """A 1-D view of a contiguous block, in memory order (never a copy)."""
    return a.reshape(-1, order="F" if not a.flags.c_contiguous else "C")


def bounds_of(a: np.ndarray) -> tuple[int, int]:
    """The first byte ``a`` touches and one past the last, whatever its strides."""
    low = high = address_of(a)
    for n, stride in zip(a.shape, a.strides, strict=True):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + a.itemsize


class Table:
    """Work items ``(address, length)`` of one dtype, split at ``CHUNK_BYTES``."""

    __slots__ = ("addrs", "like", "masks", "nbytes", "sizes")

    def __init__(self, dtype: np.dtype[Any], addrs: np.ndarray, sizes: np.ndarray) -> None:
        # At most one norm chunk per item, so a table's items are the norm's chunks.
        per = max(1, min(CHUNK_BYTES // dtype.itemsize, NORM_CHUNK))
        pieces = (sizes + per - 1) // per
        starts = np.repeat(np.cumsum(pieces) - pieces, pieces)
        offset = (np.arange(int(pieces.sum()), dtype=np.intp) - starts) * per
        whole = np.repeat(sizes, pieces)
        self.addrs = np.repeat(addrs, pieces) + offset * dtype.itemsize
        self.sizes = np.minimum(whole - offset, per)
        self.like = np.empty(0, dtype)
        self.masks = np.full(self.addrs.size, EXPONENT.get(dtype, 0), dtype=np.uint16)
        self.nbytes = int(sizes.sum()) * dtype.itemsize


class Plan:
    """What one call needs, built from validated leaves (cached for repeated sets).

    Its fields are this module's and the NumPy backend's business (its operations
    read the tables); other modules only hand a plan on.
    """

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
        self.tables: dict[np.dtype[Any], Table] = {}
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
            if is_block(a):
                starts.setdefault(a.dtype, []).append(address_of(a))  # ~2 us an array
                sizes.setdefault(a.dtype, []).append(a.size)
                if a.dtype in EXPONENT:
                    self.halves.append(flat_view(a))
            else:
                self.strided.append(a)
                bounds.append(bounds_of(a))
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
            table = self.tables[dtype] = Table(dtype, addrs, lengths)
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
) -> Plan:
    """A plan of work tables for the numba path from validated, writable ``arrays`` (any
    layout and float dtype) and ``blocks`` (contiguous float32 or float64 memory, by
    dtype: addresses and element counts), owned by objects in ``keep``, which the caller
    keeps alive and unchanged for the call. One call's plan: never cached. Check
    ``plan.aliased`` before handing it to ``_numpy.NumpyBackend.clip_planned`` or
    ``_numpy.NumpyBackend.norm_planned`` (overlapping memory takes the reference's code).
    """
    return Plan(arrays, blocks, keep)


#: The flags a plan depends on: the two contiguity flags, alignment and writeability
#: (NumPy's NPY_ARRAY_C_CONTIGUOUS, _F_CONTIGUOUS, _ALIGNED and _WRITEABLE).
_FLAG_MASK = 0x1 | 0x2 | 0x100 | 0x400


def _describe(a: np.ndarray) -> list[int]:
    """What a plan assumes of ``a``: buffer, dtype object, flags, rank, shape, strides."""
    start = address_of(a)
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
            np.ones(5, np.uint16),
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


def _same_children(plan: Plan, children: list[Any] | tuple[Any, ...]) -> bool:
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


class _Slot(NamedTuple):
    """Where a plan of a set looked up and not found would be cached."""

    key: tuple[bool, int, int, int]
    children: list[Any] | tuple[Any, ...]


class PlanCache:
    """The plans of the last few sets of many small arrays, found again by identity.

    A flat list, tuple or dict of at least ``_TABLE_MIN_LEAVES`` arrays (at most
    ``_CACHE_MAX_BYTES`` in all) seen before gets its cached plan, once the same
    objects are confirmed (:func:`_same_children`) and each array is confirmed
    unchanged since (:class:`_Watch`). The cache holds references to the arrays:
    it keeps ``_CACHE_MAX_PLANS`` plans, the least recently used dropped first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.plans: OrderedDict[tuple[bool, int, int, int], Plan] = OrderedDict()
        self._watch_ok: bool | None = None

    def clear(self) -> None:
        """Drop the cached plans and with them the references to gradient arrays."""
        with self._lock:
            self.plans.clear()

    def lookup(
        self, grads: Any, kernels: ModuleType, *, writable: bool
    ) -> tuple[Plan | None, _Slot | None]:
        """The cached plan of ``grads`` if it still holds, and where a new plan of
        ``grads`` would be cached (``None`` if the set is not one to cache)."""
        children = _children(grads) if self._watching(kernels) else None
        if children is None or len(children) < _TABLE_MIN_LEAVES:
            return None, None
        # A cheap key finds the candidate; identity of every child confirms it
        # (the plan holds its arrays, so an id cannot be reused meanwhile).
        key = (writable, len(children), id(children[0]), id(children[-1]))
        plan = self.plans.get(key)
        if plan is not None and _same_children(plan, children):
            watch = plan.watch
            if watch is not None and not watch.changed(kernels):
                with self._lock:
                    if key in self.plans:
                        self.plans.move_to_end(key)
                return plan, None
            with self._lock:  # an array changed under its identity: plan again
                self.plans.pop(key, None)
        return None, _Slot(key, children)

    def store(self, slot: _Slot | None, leaves: list[np.ndarray], nbytes: int) -> Plan | None:
        """A plan of ``leaves`` (the validated leaves of the set looked up, ``nbytes``
        in all), cached in ``slot``; ``None`` when the set is not one to cache."""
        if (
            slot is None
            or len(leaves) < _TABLE_MIN_LEAVES
            or not all(c is None or isinstance(c, np.ndarray) for c in slot.children)
            or nbytes > _CACHE_MAX_BYTES
        ):
            return None
        key, children = slot
        plan = Plan(leaves)
        plan.children = children if type(children) is tuple else list(children)
        plan.comparable = _EQ_RAISES and all(
            c is None or (type(c) is np.ndarray and c.size >= _EQ_MIN_SIZE) for c in children
        )
        plan.watch = _Watch(leaves)
        with self._lock:
            self.plans[key] = plan
            total = sum(p.nbytes for p in self.plans.values())
            while len(self.plans) > _CACHE_MAX_PLANS or total > _CACHE_MAX_BYTES:
                _, dropped = self.plans.popitem(last=False)
                total -= dropped.nbytes
        return plan

    def _watching(self, kernels: ModuleType) -> bool:
        """Whether cached plans can be checked here (see :func:`_watch_works`)."""
        if self._watch_ok is None:
            self._watch_ok = _watch_works(kernels)
        return self._watch_ok
