"""The NumPy backend (the default): unscale and detect in one pass over memory.

Same results, bit for bit, as the clear reference in ``_numpy_reference.py``
(:class:`NumpyReferenceBackend`, kept as the oracle the tests compare
against), reached by one of two paths:

- ``"numba"`` (when numba imports): compiled kernels walk a table of
  ``(address, length)`` work items (a plan, ``_plans.py``, cached for sets that
  come back), so one call covers thousands of arrays,
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
import os
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import numpy as np

from scaler_core._backend import forget_dispatch
from scaler_core._errors import BackendUnavailableError
from scaler_core._ops import clip_coefficient

from ._common import NORM_CHUNK, inv_scale_of, norm_of_sums
from ._numpy_reference import (
    NumpyReferenceBackend,
    Prepared,
    chunk_sums,
    clip_in_place,
    numpy_leaves,
    unscaled_copy,
)
from ._plans import (
    CHUNK_BYTES,
    EXPONENT,
    Plan,
    PlanCache,
    Table,
    address_of,
    bounds_of,
    flat_view,
    is_block,
)

__all__ = ["BACKEND", "ENV_FALLBACK", "REFERENCE", "NumpyBackend"]

#: Set to ``1`` to force the pure-NumPy path even when numba is installed.
ENV_FALLBACK = "SCALER_CORE_NUMPY_FALLBACK"

#: The clear implementation every fast path is tested against.
REFERENCE = NumpyReferenceBackend()

_F64 = np.dtype(np.float64)
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


def _load_kernels() -> tuple[ModuleType | None, str]:
    if os.environ.get(ENV_FALLBACK, "").strip() not in ("", "0"):
        return None, f"{ENV_FALLBACK} is set"
    try:
        from . import _numpy_kernels  # noqa: PLC0415 (numba only on first use)
    except Exception as exc:  # numba missing, or built for another numpy
        return None, f"numba is unavailable ({type(exc).__name__}: {exc})"
    return _numpy_kernels, "numba imported"


def _leaves(prepared: Plan | list[np.ndarray]) -> list[np.ndarray]:
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
    >>> _, found = backend.unscale(backend.plan(g, writable=True), 2.0)
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
        self._cache = PlanCache()

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
        """Drop the cached plans and the remembered dispatch, and with them the
        references to gradient arrays."""
        self._cache.clear()
        forget_dispatch()

    def __repr__(self) -> str:
        arg = "" if self._use_numba is None else f"use_numba={self._use_numba!r}"
        return f"NumpyBackend({arg})"

    # -- plans ---------------------------------------------------------------

    def _prepare(self, grads: Any, *, writable: bool) -> Plan | list[np.ndarray]:
        """Validated leaves, or a plan of address tables (numba path only).

        A flat list, tuple or dict of many small arrays seen before gets its cached
        plan (:class:`_plans.PlanCache`, which confirms the same arrays, unchanged);
        otherwise the set is validated as :func:`numpy_leaves` does, before anything
        is modified.
        """
        kernels = self._resolve()
        slot = None
        if kernels is not None:
            plan, slot = self._cache.lookup(grads, kernels, writable=writable)
            if plan is not None:
                return plan
        leaves = [leaf for _, leaf in numpy_leaves(grads, writable=writable)]
        if kernels is None:
            return leaves
        nbytes = sum(a.nbytes for a in leaves)
        plan = self._cache.store(slot, leaves, nbytes)
        if plan is not None:
            return plan
        if nbytes >= _PARALLEL_MIN_BYTES:
            return Plan(leaves)  # one parallel region for the whole set
        return leaves

    # -- the backend ---------------------------------------------------------

    def plan(self, grads: Any, *, writable: bool) -> Prepared:
        """See :meth:`scaler_core.Backend.plan`: the arrays, or their cached plan."""
        return Prepared(grads, self._prepare(grads, writable=writable))

    def unscale(self, leaves: Prepared, scale: Any) -> tuple[Any, np.bool_]:
        """See :meth:`scaler_core.Backend.unscale`: in place, one pass per array (a
        read alone without a scale)."""
        inv = None if scale is None else inv_scale_of(scale)
        prepared = leaves.work
        kernels = self._resolve()
        if kernels is None:
            with np.errstate(all="ignore"):
                arrays = _leaves(prepared)
                found = _numpy_detect(arrays) if inv is None else _numpy_unscale(arrays, inv)
                return leaves.grads, np.bool_(found)
        # A signalling NaN is an answer, not a warning; overflow is what the flag reports.
        with np.errstate(all="ignore"):
            if inv is None or inv == 1.0:  # the reference writes nothing: neither do we
                if isinstance(prepared, list):
                    return leaves.grads, np.bool_(_numba_detect_arrays(kernels, prepared))
                return leaves.grads, np.bool_(_numba_detect(kernels, prepared))
            if isinstance(prepared, list):
                return leaves.grads, np.bool_(_numba_unscale_arrays(kernels, prepared, inv))
            if prepared.aliased:
                return REFERENCE.unscale(Prepared(leaves.grads, _leaves(prepared)), scale)
            return leaves.grads, np.bool_(_numba_unscale(kernels, prepared, inv))

    def measure(
        self, leaves: Prepared, scale: Any, *, write: bool
    ) -> tuple[Any, np.bool_, np.float32]:
        """See :meth:`scaler_core.Backend.measure`: one pass; with ``write``, reads and
        writes once."""
        inv = inv_scale_of(scale)
        if _shares_memory(leaves):
            return REFERENCE.measure(
                Prepared(leaves.grads, _leaves(leaves.work)), scale, write=write
            )
        found, norm = self.measure_planned(leaves.work, inv, write=write)
        return leaves.grads, found, norm

    def measure_planned(
        self, prepared: Plan | list[np.ndarray], inv: float, *, write: bool
    ) -> tuple[np.bool_, np.float32]:
        """:meth:`measure` of validated leaves or a plan none of whose arrays overlap
        (see :func:`plan_blocks`), with the inverse scale checked: ``(found, norm)``."""
        with np.errstate(all="ignore"):
            found, sums = self._measure(prepared, inv, write=write and inv != 1.0)
            return np.bool_(found), norm_of_sums(sums)

    def clip(self, leaves: Prepared, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        """See :meth:`scaler_core.Backend.clip`: one write unless skipped."""
        if self.to_bool(skip):
            return leaves.grads
        inv = inv_scale_of(scale)
        if _shares_memory(leaves):
            return REFERENCE.clip(
                Prepared(leaves.grads, _leaves(leaves.work)), scale, norm, max_norm, skip
            )
        self.clip_planned(leaves.work, inv, norm, max_norm)
        return leaves.grads

    def clip_planned(
        self, prepared: Plan | list[np.ndarray], inv: float, norm: Any, max_norm: float
    ) -> None:
        """:meth:`clip` of a step that is taken, for what :meth:`measure_planned` took."""
        with np.errstate(all="ignore"):
            coef = clip_coefficient(np, np.float32(norm), max_norm)
            if inv != 1.0 or coef != 1.0:  # else nothing would change: write nothing
                _clip(self._resolve(), prepared, inv, coef)

    def _measure(
        self, prepared: Plan | list[np.ndarray], inv: float, *, write: bool
    ) -> tuple[bool, list[float]]:
        """The flag and the chunks' sums of squares of the unscaled values (stored if
        ``write``), by the numba kernels or the pure-NumPy code."""
        kernels = self._resolve()
        if kernels is None:
            return _numpy_norm(_leaves(prepared), inv, write)
        if isinstance(prepared, list):
            return _numba_norm_arrays(kernels, prepared, inv, write)
        return _numba_norm(kernels, prepared, inv, write)


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


def _numba_unscale(k: ModuleType, plan: Plan, inv: float) -> bool:
    found = False
    parallel = _use_threads(k, plan.nbytes)
    for dtype, table in plan.tables.items():
        if dtype in EXPONENT:
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


def _numba_detect(k: ModuleType, plan: Plan) -> bool:
    parallel = _use_threads(k, plan.nbytes)
    for dtype, table in plan.tables.items():
        n = table.addrs.size
        step = max(1, _DETECT_BATCH_BYTES // CHUNK_BYTES) if parallel else max(1, n)
        for lo in range(0, n, step):
            if _detect_items(k, dtype, table, slice(lo, lo + step), parallel and n > 1):
                return True
    return any(not bool(np.isfinite(g).all()) for g in plan.strided)


def _detect_items(
    k: ModuleType, dtype: np.dtype[Any], table: Table, part: slice, parallel: bool
) -> bool:
    """Whether the work items ``part`` of ``table`` hold a NaN or +-inf."""
    addrs, sizes = table.addrs[part], table.sizes[part]
    if dtype in EXPONENT:
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
        elif not is_block(g):
            found = _reference_unscale(g, inv) or found
        elif g.dtype in EXPONENT:
            found = _half_unscale(flat_view(g), inv, k) or found
        else:
            found = math.isnan(k.unscale_array(flat_view(g), g.dtype.type(inv))) or found
    return found


def _numba_detect_arrays(k: ModuleType, leaves: list[np.ndarray]) -> bool:
    def hit(flat: np.ndarray) -> bool:
        if flat.dtype in EXPONENT:
            return bool(k.exponent_all_ones(flat.view(np.uint16), EXPONENT[flat.dtype]))
        return math.isnan(k.detect_array(flat))

    return _detect_leaves(leaves, hit)


# -- shared pieces ------------------------------------------------------------


def _reference_unscale(g: np.ndarray, inv: float) -> bool:
    """The reference's own arithmetic for one array; whether it is now non-finite."""
    if g.dtype in EXPONENT:
        g[...] = np.multiply(g, np.float32(inv), dtype=np.float32)
    else:
        np.multiply(g, g.dtype.type(inv), out=g)
    return not bool(np.isfinite(g).all())


def _half_unscale(flat: np.ndarray, inv: float, kernels: ModuleType | None) -> bool:
    """float16/bfloat16 through NumPy's casts, a cache-sized chunk at a time."""
    mask = EXPONENT[flat.dtype]
    step = CHUNK_BYTES // 4  # elements per chunk, counted by the float32 temporary
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


def _shares_memory(leaves: Prepared) -> bool:
    """:func:`_overlaps` of the leaves' work, looked at once per call's leaves."""
    if leaves.shared is None:
        leaves.shared = _overlaps(leaves.work)
    return leaves.shared


def _overlaps(prepared: Plan | list[np.ndarray]) -> bool:
    """Whether two arrays share memory: those calls take the reference's code."""
    if isinstance(prepared, Plan):
        return prepared.aliased
    spans = sorted(
        (address_of(a), address_of(a) + a.nbytes) if is_block(a) else bounds_of(a)
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


def _numba_norm(k: ModuleType, plan: Plan, inv: float, write: bool) -> tuple[bool, list[float]]:
    found = False
    sums: list[float] = []
    parallel = _use_threads(k, plan.nbytes)
    for dtype, table in plan.tables.items():
        if dtype in EXPONENT:
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
        if not is_block(g):
            hit, part = _strided_norm(g, inv, write)
        elif g.dtype in EXPONENT:
            hit, part = _half_norm(flat_view(g), inv, write, kernels)
        else:
            hit, part = block(flat_view(g))
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
    kernels: ModuleType | None, prepared: Plan | list[np.ndarray], inv: float, coef: np.float32
) -> None:
    """The second pass: store ``(x * inv) * coef`` (two roundings) in every element."""
    if kernels is not None and isinstance(prepared, Plan):
        parallel = _use_threads(kernels, prepared.nbytes)
        for dtype, table in prepared.tables.items():
            if dtype in EXPONENT:
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
        if not is_block(g):
            strided.append(g)
            continue
        if g.dtype in EXPONENT:
            halves.append(flat_view(g))
            continue
        flat, factor, scale = flat_view(g), g.dtype.type(inv), g.dtype.type(coef)
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
        elif not is_block(g):
            found = _reference_unscale(g, inv) or found
        elif g.dtype in EXPONENT:
            found = _half_unscale(flat_view(g), inv, None) or found
        elif g.nbytes <= CHUNK_BYTES:  # already cache-sized: no chunking to pay for
            np.multiply(g, g.dtype.type(inv), out=g)
            found = found or not _numpy_finite(g)
        else:
            flat = flat_view(g)
            factor = g.dtype.type(inv)
            step = CHUNK_BYTES // g.itemsize
            for lo in range(0, flat.size, step):
                chunk = flat[lo : lo + step]
                np.multiply(chunk, factor, out=chunk)
                found = found or not _numpy_finite(chunk)
    return found


def _numpy_detect(leaves: list[np.ndarray]) -> bool:
    def hit(flat: np.ndarray) -> bool:
        step = CHUNK_BYTES // flat.itemsize
        if flat.dtype in EXPONENT:
            bits = flat.view(np.uint16)
            mask = EXPONENT[flat.dtype]
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
        if not is_block(g):
            if not np.isfinite(g).all():
                return True
        elif block_hit(flat_view(g)):
            return True
    return False


BACKEND = NumpyBackend()
