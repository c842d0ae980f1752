"""The torch backend on the CPU without numba: PyTorch's own kernels, the NumPy path's bits.

Where numba is missing, the NumPy backend's pure path runs on one thread, and
``unscale_clip`` on CPU tensors through it took 1.5-10x as long as PyTorch's own
``unscale_`` + ``clip_grad_norm_`` pair. This route gives the same results with
PyTorch's kernels, on PyTorch's threads (``torch.set_num_threads`` is honoured):

1. One read, nothing written: the products ``x * inv`` (in the gradient's dtype, as
   the rules round them) go a chunk at a time to a scratch buffer that stays in
   cache, are widened to float64 and summed as squares (``torch.dot``); a finite
   sum proves every product finite (float64 squares of float32 or half values
   cannot overflow; float64 gradients get an exact ``isfinite`` re-check).
   Gradients smaller than a chunk are gathered into the scratch buffer first
   (``torch.cat``), so 2000 small tensors cost a few calls, not thousands.
2. On a skipped step nothing is written. Otherwise ``(x * inv) * coef`` is
   stored, two roundings as the NumPy kernels do, a chunk at a time so the second
   product reads the chunk from cache; small tensors by ``torch._foreach_mul_``
   (float32 and float64 only: for half types that kernel rounds the factor to the
   half type first, so they take ``mul_`` tensor by tensor).

The chunks' float64 sums are added exactly (``math.fsum``) as on every other path;
the norm is within one float32 ulp of the exact norm, like theirs. Tensors that
are not contiguous, or that share memory with one another, are not served here
(:func:`plan` says no) and take the NumPy path, which handles them exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._common import NORM_CHUNK

__all__ = ["Plan", "measure", "plan", "write_clip"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_HALF = (torch.float16, torch.bfloat16)
#: Elements per chunk: the float64 scratch (1 MiB) and the product stay in L2.
_CHUNK = NORM_CHUNK


class Plan:
    """The tensors of one call by dtype: flat views of the large ones (cut into chunks)
    and the small ones as given, with 1-D views of them for gathering."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        #: dtype -> (chunks of large tensors, small tensors, their 1-D views)
        self.groups: dict[
            torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
        ] = {}


def plan(tensors: Sequence[torch.Tensor]) -> Plan | None:
    """A :class:`Plan` when this route serves ``tensors`` (distinct, dense CPU tensors):
    each contiguous, of a float dtype, no two sharing memory; ``None`` otherwise."""
    spans = []
    out = Plan()
    groups = out.groups
    for t in tensors:
        dtype = t.dtype
        if dtype not in _DTYPES or not t.is_contiguous():
            return None
        n = t.numel()
        if not n:
            continue
        start = t.data_ptr()
        spans.append((start, start + t.nbytes))
        group = groups.get(dtype)
        if group is None:
            group = groups[dtype] = ([], [], [])
        if n >= _CHUNK // 2:
            flat = t.view(-1)
            group[0].extend(flat[lo : lo + _CHUNK] for lo in range(0, n, _CHUNK))
        else:
            group[1].append(t)
            group[2].append(t if t.dim() == 1 else t.view(-1))
    spans.sort()
    if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
        return None
    return out


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
        for dtype, (chunks, _, small) in prepared.groups.items():
            scratch = torch.empty(_CHUNK, dtype=dtype)
            wide = torch.empty(_CHUNK, dtype=torch.float64)
            # float32 only: half products round, and float64 squares of the scaled values
            # can overflow where the products' squares do not
            exact = scaled and dtype is torch.float32
            factor = inv * inv if exact else 1.0
            for part in chunks:
                prod = part if exact else torch.mul(part, inv, out=scratch[: part.numel()])
                found = _reduce(prod, wide, factor, sums) or found
            lo = 0
            while lo < len(small):
                hi, filled = lo, 0
                while hi < len(small) and filled + small[hi].numel() <= _CHUNK:
                    filled += small[hi].numel()
                    hi += 1
                gathered = scratch[:filled]
                torch.cat(small[lo:hi], out=gathered)
                prod = gathered if exact else gathered.mul_(inv)
                found = _reduce(prod, wide, factor, sums) or found
                lo = hi
    return found, sums


def _reduce(prod: torch.Tensor, wide: torch.Tensor, factor: float, sums: list[float]) -> bool:
    """Append the float64 sum of squares of ``prod`` (times ``factor``) to ``sums``;
    whether a value of ``prod`` is NaN or +-inf."""
    w = wide[: prod.numel()]
    w.copy_(prod)
    total = float(torch.dot(w, w))
    sums.append(total * factor)
    if math.isfinite(total):
        return False
    # float64 squares can overflow where the values are finite: check those exactly
    return prod.dtype is not torch.float64 or not bool(torch.isfinite(prod).all())


def write_clip(prepared: Plan, inv: float, coef: float) -> None:
    """Store ``(x * inv) * coef`` in every element, two roundings in the tensor's dtype."""
    with torch.no_grad():
        for dtype, (chunks, small, _) in prepared.groups.items():
            for part in chunks:  # the second product reads the chunk from cache
                part.mul_(inv)
                if coef != 1.0:
                    part.mul_(coef)
            if not small:
                continue
            if dtype in _HALF:  # _foreach_mul_ would round the factor to the half type
                for t in small:
                    t.mul_(inv)
                    if coef != 1.0:
                        t.mul_(coef)
                continue
            torch._foreach_mul_(small, inv)
            if coef != 1.0:
                torch._foreach_mul_(small, coef)
