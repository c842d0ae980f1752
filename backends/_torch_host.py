"""The torch backend on the CPU without numba: PyTorch's own kernels, the NumPy path's bits.

Where numba is missing, the NumPy backend's pure path runs on one thread, and
``unscale_and_clip`` on CPU tensors through it took 1.5-10x as long as PyTorch's own
``unscale_`` + ``clip_grad_norm_`` pair. This route gives the same results with
PyTorch's kernels, on PyTorch's threads (``torch.set_num_threads`` is honoured):

1. One read, nothing written: the products ``x * inv`` (in the gradient's dtype, as
   the rules round them) go a chunk at a time to a scratch buffer that stays in
   cache, are widened to float64, squared and summed (exact squares of float32 and
   half values, summed by PyTorch's own reduction, not the BLAS); a finite
   sum proves every product finite (float64 squares of float32 or half values
   cannot overflow; float64 gradients get an exact ``isfinite`` re-check).
   Gradients smaller than a chunk are gathered into the scratch buffer first (a
   byte copy each, ``ctypes.memmove``), so 2000 small tensors cost a few kernel
   calls, not thousands.
2. On a skipped step nothing is written. Otherwise ``(x * inv) * coef`` is
   stored, two roundings as the NumPy kernels do, a chunk at a time so the second
   product reads the chunk from cache; small tensors are gathered again, multiplied
   in the scratch buffer and copied back (PyTorch's ``_foreach_mul_`` on the CPU
   costs about 5 us a tensor and a call, more than the copies and the arithmetic).

The chunks' float64 sums are added exactly (``math.fsum``) as on every other path;
the norm is within one float32 ulp of the exact norm, like theirs. Tensors that
are not contiguous, or that share memory with one another, are not served here
(:func:`plan` says no) and take the NumPy path, which handles them exactly.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator, Sequence

import torch

from scaler_core._errors import BackendContractError

from ._common import NORM_CHUNK

__all__ = ["Plan", "measure", "plan", "write_clip"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: Elements per chunk of the read: the products and their float64 copy (2 MiB) stay
#: in cache between the two kernels that square and sum them.
_CHUNK = 2 * NORM_CHUNK
#: Elements per chunk of the write: the second product reads the first from cache
#: (L3). Fewer, larger chunks open fewer parallel regions (each costs microseconds).
_WRITE_CHUNK = 8 * NORM_CHUNK
#: Elements per batch of small tensors: below PyTorch's grain size (32768), so each
#: kernel on a batch runs on the calling thread and opens no parallel region (waking
#: the other threads costs more than the work, and far more on a busy machine).
_BATCH = 1 << 15
#: Small tensors of one dtype up to this many elements in all (64 MiB of float32) are
#: gathered once, by the read, into a buffer the write multiplies and copies back
#: from; more are gathered again by the write, a batch at a time.
_HOLD = 1 << 24


class _Group:
    """One dtype's tensors: flat views of the large ones; the small ones in batches,
    each its elements' count and every tensor's ``(address, bytes)`` (contiguous, so a
    byte copy moves it), their elements in all, and (after the read, when they fit
    :data:`_HOLD`) all of them gathered in one buffer, as ``(buffer, multiplied)``."""

    __slots__ = ("batches", "held", "large", "small")

    def __init__(self) -> None:
        self.large: list[torch.Tensor] = []
        self.batches: list[tuple[int, list[tuple[int, int]]]] = []
        self.small = 0
        self.held: tuple[torch.Tensor, bool] | None = None


class Plan:
    """The tensors of one call, by dtype (see :class:`_Group`)."""

    __slots__ = ("groups", "keep")

    def __init__(self, keep: list[torch.Tensor]) -> None:
        self.keep = keep  # the batches hold raw addresses: keep the tensors alive
        self.groups: dict[torch.dtype, _Group] = {}


def plan(tensors: Sequence[torch.Tensor]) -> Plan | None:
    """A :class:`Plan` when this route serves ``tensors`` (distinct, dense CPU tensors):
    each contiguous, of a float dtype, no two sharing memory; ``None`` otherwise. A
    negative view (``torch._neg_view``) is planned as its memory: multiplying by
    positive factors and summing squares give exactly the negated results."""
    spans = []
    out = Plan(list(tensors))
    groups = out.groups
    for t in tensors:
        dtype = t.dtype
        if dtype not in _DTYPES or not t.is_contiguous():
            return None
        n = t.numel()
        if not n:
            continue
        start = t.data_ptr()
        nbytes = n * t.element_size()
        spans.append((start, start + nbytes))
        group = groups.get(dtype)
        if group is None:
            group = groups[dtype] = _Group()
        if n >= _CHUNK // 2:
            group.large.append(t.view(-1))
            continue
        batches = group.batches
        if not batches or batches[-1][0] + n > _BATCH:
            batches.append((0, []))
        filled, items = batches[-1]
        items.append((start, nbytes))
        batches[-1] = (filled + n, items)
        group.small += n
    spans.sort()
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        return None
    return out


def _chunks(flats: list[torch.Tensor], size: int) -> Iterator[torch.Tensor]:
    """Consecutive views of at most ``size`` elements of each flat tensor."""
    for flat in flats:
        n = flat.numel()
        for lo in range(0, n, size):
            yield flat[lo : lo + size]


def _widest(group: _Group) -> int:
    """Elements of the group's largest batch (one small tensor can exceed ``_BATCH``)."""
    return max((filled for filled, _ in group.batches), default=0)


def _gather(into: torch.Tensor, batch: tuple[int, list[tuple[int, int]]]) -> torch.Tensor:
    """The batch's tensors, one after another, in the front of ``into``."""
    filled, items = batch
    if filled > into.numel():  # raw copies: never past the end of the buffer
        raise BackendContractError(
            f"a batch of {filled} elements, but the buffer holds {into.numel()}; the plan and "
            f"the buffer disagree (a bug in scaler-core: please report it)"
        )
    at = into.data_ptr()
    for start, nbytes in items:
        ctypes.memmove(at, start, nbytes)
        at += nbytes
    return into[:filled]


def _scatter(gathered: torch.Tensor, items: list[tuple[int, int]]) -> None:
    """Copy ``gathered`` back into the tensors it was gathered from."""
    at = gathered.data_ptr()
    for start, nbytes in items:
        ctypes.memmove(start, at, nbytes)
        at += nbytes


#: Below this norm a product that falls into float32's subnormal range (and is rounded
#: there) could move the norm's float32 bits; at or above it, it cannot.
_TINY_NORM = 2.0**-60
#: ``math.frexp(x)[0]`` of every power of two.
_POWER_OF_TWO_MANTISSA = 0.5


def measure(prepared: Plan, inv: float) -> tuple[bool, list[float]]:
    """Whether any ``x * inv`` is NaN or +-inf, and the float64 sums of squares of the
    products (rounded to each tensor's dtype) by chunk. Reads only.

    When ``inv`` is a power of two no larger than 1, each float32 product is ``x``
    times ``inv`` exactly (short of the subnormal range), so the squares of ``x`` are
    summed and the sums scaled by ``inv**2`` (exact in float64): one multiply fewer per
    chunk. A norm so small that rounding in the subnormal range could matter is
    measured again from the products.
    """
    if 0.0 < inv <= 1.0 and math.frexp(inv)[0] == _POWER_OF_TWO_MANTISSA:
        found, sums = _measure(prepared, inv, scaled=True)
        if found or math.sqrt(math.fsum(sums)) >= _TINY_NORM:
            return found, sums
    return _measure(prepared, inv, scaled=False)


def _measure(prepared: Plan, inv: float, *, scaled: bool) -> tuple[bool, list[float]]:
    found = False
    sums: list[float] = []
    with torch.no_grad():
        for dtype, group in prepared.groups.items():
            scratch = torch.empty(_CHUNK if group.large else 0, dtype=dtype)
            wide = torch.empty(_CHUNK, dtype=torch.float64)
            # float32 only: half products round, and float64 squares of the scaled values
            # can overflow where the products' squares do not
            exact = scaled and dtype is torch.float32
            factor = inv * inv if exact else 1.0
            for part in _chunks(group.large, _CHUNK):
                prod = part if exact else torch.mul(part, inv, out=scratch[: part.numel()])
                found = _reduce(prod, wide, factor, sums) or found
            # the small ones gathered where the write finds them again (when they fit)
            hold = group.small <= _HOLD
            into = torch.empty(group.small if hold else _widest(group), dtype=dtype)
            at = 0
            for batch in group.batches:
                gathered = _gather(into[at:] if hold else into, batch)
                at += batch[0] if hold else 0
                prod = gathered if exact else gathered.mul_(inv)
                found = _reduce(prod, wide, factor, sums) or found
            group.held = (into, not exact) if hold else None
    return found, sums


def _reduce(prod: torch.Tensor, wide: torch.Tensor, factor: float, sums: list[float]) -> bool:
    """Append the float64 sum of squares of ``prod`` (times ``factor``) to ``sums``;
    whether a value of ``prod`` is NaN or +-inf."""
    w = wide[: prod.numel()]
    w.copy_(prod)
    # squared in place and summed by PyTorch's own reduction: torch.dot goes to the BLAS,
    # whose threads (outside PyTorch's pool) took milliseconds a call to wake
    total = float(w.square_().sum())
    sums.append(total * factor)
    if math.isfinite(total):
        return False
    # float64 squares can overflow where the values are finite: check those exactly
    return prod.dtype is not torch.float64 or not bool(torch.isfinite(prod).all())


def write_clip(prepared: Plan, inv: float, coef: float) -> None:
    """Store ``(x * inv) * coef`` in every element, two roundings in the tensor's dtype
    (after :func:`measure`, whose gathered copies of the small tensors it reuses)."""
    with torch.no_grad():
        for dtype, group in prepared.groups.items():
            for part in _chunks(group.large, _WRITE_CHUNK):
                # the second product reads the chunk from cache
                part.mul_(inv)
                if coef != 1.0:
                    part.mul_(coef)
            if group.held is not None:  # every small tensor, gathered by the read
                held, multiplied = group.held
                if not multiplied:
                    held.mul_(inv)
                if coef != 1.0:
                    held.mul_(coef)
                at = 0
                for filled, items in group.batches:
                    _scatter(held[at:], items)
                    at += filled
                continue
            scratch = torch.empty(_widest(group), dtype=dtype)
            for batch in group.batches:
                gathered = _gather(scratch, batch).mul_(inv)
                if coef != 1.0:
                    gathered.mul_(coef)
                _scatter(gathered, batch[1])
