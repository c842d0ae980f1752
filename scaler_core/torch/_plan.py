"""An optimizer's gradients as the drop-in's step reads them, planned once and reused.

PyTorch's ``unscale_`` walks ``optimizer.param_groups`` at every call: each parameter
checked, each gradient sorted by device and dtype. For a model of thousands of small
tensors that walk costs more than the kernels. :class:`Plans` does it once per
optimizer and hands the same plan back while the optimizer's parameters and their
gradients are the same objects, assuming nothing else: each call lists the
parameters and gradients again and compares them, object by object, with the
plan's (a replaced gradient, a new parameter group, a gradient set to ``None`` all
make a new plan). What a plan records of a gradient (its device, dtype and layout)
cannot change while the tensor stays the same object; its memory can (``resize_``,
``set_``), and the kernels that read memory by address check that themselves.

A plan holds the parameters (the optimizer holds them anyway) and only weak
references to the gradients, so no gradient outlives its step because of it. A
sparse gradient is never planned (PyTorch's walk may replace it by its coalesced
sum). An optimizer whose gradients are new tensors every step (``zero_grad()``'s
default) stops being kept after two misses, so it pays for the walk alone, and is
tried again every 64 steps.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = ["Plans", "Step"]

Buckets = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]


class Step(NamedTuple):
    """One call's view of an optimizer's gradients."""

    #: The optimizer's parameters, in ``param_groups`` order.
    params: list[torch.Tensor]
    #: Their gradients (``None`` where a parameter has none), in the same order.
    grads: list[torch.Tensor | None]
    #: The gradients (a sparse one's values) by device and dtype, as PyTorch's
    #: ``unscale_`` groups them.
    buckets: Buckets


def _no_grad() -> None:
    """What a plan holds for a parameter that had no gradient: it reads ``None``."""


class _Cached:
    """What a plan keeps between calls."""

    __slots__ = ("layout", "nones", "params", "refs")

    def __init__(self, params: list[torch.Tensor], grads: list[Any], buckets: Buckets) -> None:
        self.params = params
        self.refs = [_no_grad if g is None else weakref.ref(g) for g in grads]
        self.nones = _nones(grads)
        at = {id(g): i for i, g in enumerate(grads) if g is not None}
        self.layout = [
            (device, dtype, [at[id(t)] for t in tensors])
            for device, by_dtype in buckets.items()
            for dtype, tensors in by_dtype.items()
        ]

    def holds(self, params: list[torch.Tensor], grads: list[Any]) -> bool:
        """Whether ``params`` and ``grads`` are, one by one, the objects planned.

        Compared lazily, stopping at the first difference (a new gradient, most often
        the first). A planned gradient since freed reads ``None``: the count of
        ``None`` then differs from the plan's, so it is never taken for a parameter
        that has no gradient."""
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            return False
        alive = map(_CALL, self.refs)
        return all(map(operator.is_, grads, alive)) and _nones(grads) == self.nones

    def buckets(self, grads: list[Any]) -> Buckets:
        out: Buckets = {}
        for device, dtype, indices in self.layout:
            out.setdefault(device, {})[dtype] = [grads[i] for i in indices]
        return out


def _nones(grads: list[Any]) -> int:
    """How many of ``grads`` are ``None`` (by identity: ``list.count`` would ask each
    tensor's ``==``, a torch operation apiece)."""
    return sum(map(_IS_NONE, grads))


_IS_NONE = functools.partial(operator.is_, None)
#: Calls a weak reference (or :func:`_no_grad`), in C.
_CALL = operator.methodcaller("__call__")
#: After this many misses in a row (new gradients every step: ``zero_grad()``'s
#: default) an optimizer is planned afresh without keeping the plan, but for one
#: call in every ``_RETRY``, which notices a loop that now keeps its gradients.
_MISSES, _RETRY = 2, 64


class Plans:
    """The last plan of each optimizer a drop-in stepped (see the module docstring)."""

    __slots__ = ("_cached", "_misses")

    def __init__(self) -> None:
        self._cached: dict[tuple[int, bool], _Cached] = {}
        self._misses: dict[tuple[int, bool], int] = {}

    def of(
        self,
        optimizer: torch.optim.Optimizer,
        allow_fp16: bool,
        coalesce_half: Callable[[torch.Tensor], torch.Tensor],
    ) -> Step:
        """The optimizer's gradients, checked as PyTorch's ``unscale_`` checks them (its
        errors), a sparse float16 one coalesced first by ``coalesce_half`` (and put in
        ``param.grad``)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [getattr(p, "grad", None) for p in params]
        key = (id(optimizer), allow_fp16)
        cached = self._cached.get(key)
        if cached is not None and cached.holds(params, grads):
            self._misses[key] = 0
            return Step(params, grads, cached.buckets(grads))
        buckets, sparse = _walk(params, allow_fp16, coalesce_half)
        if sparse:  # a sparse float16 one may have been coalesced: never kept
            self._cached.pop(key, None)
            return Step(params, [p.grad for p in params], buckets)
        misses = self._misses[key] = self._misses.get(key, 0) + 1
        if misses <= _MISSES or misses % _RETRY == 0:
            self._cached[key] = _Cached(params, grads, buckets)
        return Step(params, grads, buckets)


def _walk(
    params: list[Any], allow_fp16: bool, coalesce_half: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[Buckets, bool]:
    """PyTorch's walk of ``unscale_``: the gradients by device and dtype, with its errors,
    and whether any is sparse."""
    buckets: Buckets = defaultdict(lambda: defaultdict(list))
    sparse = False
    with torch.no_grad():
        for param in params:
            if not isinstance(param, torch.Tensor):
                raise AssertionError(  # PyTorch's error
                    f"expected param to be torch.Tensor, got {type(param).__name__}"
                )
            grad = param.grad
            if grad is None:
                continue
            if (not allow_fp16) and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")  # PyTorch's error
            if grad.is_sparse:
                sparse = True
                if grad.dtype is torch.float16:
                    param.grad = grad = coalesce_half(grad)
                grad = grad._values()
            buckets[grad.device][grad.dtype].append(grad)
    return buckets, sparse
