"""The torch backend's plans of many small CPU tensors, found again call after call.

A flat list of thousands of small gradients (an optimizer's, a mixture of experts')
costs more to validate and to plan (each tensor's dtype, layout, address and
length) than the numba kernels take to read it. The same list comes back every
step while the gradients are the same tensors, so its validated leaves and its plan
of work items are kept, and handed back once the same objects are confirmed (their
identity, one by one) and each tensor's memory is confirmed unchanged: its address,
its length and its contiguity, read again at every call (``resize_`` and ``set_``
move or resize a tensor's memory under the same identity; then it is planned
again). Its dtype, device and layout cannot change under the same identity.

Only lists the plan reads wholly by address are kept: at least ``_MIN_TENSORS``
contiguous float32 or float64 CPU tensors, none sharded, at most ``_MAX_BYTES`` in
all. Like the NumPy backend's cache (:class:`._plans.PlanCache`), this one holds
the tensors it planned, so it keeps few plans and small ones.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from typing import Any

import torch

from . import _plans
from ._torch_leaves import Leaf

__all__ = ["Planned", "TensorPlans"]

#: Lists of fewer tensors are planned at each call (their planning costs little).
_MIN_TENSORS = 32
#: The most bytes of gradients the kept plans hold alive, and the most plans.
_MAX_BYTES = 64 << 20
_MAX_PLANS = 4
#: The dtypes a plan reads by address.
_WIDE = (torch.float32, torch.float64)


class Planned:
    """A list's validated leaves and its plan, and what the plan assumed."""

    __slots__ = ("children", "leaves", "nbytes", "numels", "plan", "ptrs", "tensors")

    def __init__(self, children: list[Any], leaves: list[Leaf], plan: _plans.Plan) -> None:
        self.children = children
        self.leaves = leaves
        self.plan = plan
        self.tensors = [leaf.local for leaf in leaves]
        self.ptrs = [t.data_ptr() for t in self.tensors]
        self.numels = [t.numel() for t in self.tensors]
        sizes = zip(self.numels, self.tensors, strict=True)
        self.nbytes = sum(n * t.element_size() for n, t in sizes)

    def unchanged(self) -> bool:
        """Whether every tensor still has the memory the plan reads."""
        tensors = self.tensors
        return (
            list(map(torch.Tensor.data_ptr, tensors)) == self.ptrs
            and list(map(torch.Tensor.numel, tensors)) == self.numels
            and all(map(torch.Tensor.is_contiguous, tensors))
        )


class TensorPlans:
    """The plans of the last few lists of many small CPU tensors (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.plans: OrderedDict[tuple[int, int, int], Planned] = OrderedDict()

    def clear(self) -> None:
        """Drop every plan, and with them the references to the tensors."""
        with self._lock:
            self.plans.clear()

    def lookup(self, grads: Any) -> Planned | None:
        """The plan of ``grads`` (a list or tuple) if it was planned and still holds."""
        if (type(grads) is not list and type(grads) is not tuple) or len(grads) < _MIN_TENSORS:
            return None
        key = (len(grads), id(grads[0]), id(grads[-1]))
        planned = self.plans.get(key)
        if planned is None or not all(map(operator.is_, grads, planned.children)):
            return None
        with self._lock:
            if not planned.unchanged():  # memory moved under the same tensor: plan again
                self.plans.pop(key, None)
                return None
            if key in self.plans:
                self.plans.move_to_end(key)
        return planned

    def store(self, grads: Any, leaves: list[Leaf], plan: _plans.Plan) -> None:
        """Keep ``plan`` (of ``leaves``, the validated leaves of ``grads``) if ``grads`` is
        a list the cache takes (see the module)."""
        if (type(grads) is not list and type(grads) is not tuple) or len(grads) < _MIN_TENSORS:
            return
        if plan.aliased or not all(
            leaf.spread is None
            and leaf.local.dtype in _WIDE
            and leaf.local.layout is torch.strided
            and leaf.local.is_cpu
            and leaf.local.is_contiguous()
            for leaf in leaves
        ):
            return
        planned = Planned(list(grads), leaves, plan)
        if planned.nbytes > _MAX_BYTES:
            return
        key = (len(grads), id(grads[0]), id(grads[-1]))
        with self._lock:
            self.plans[key] = planned
            total = sum(p.nbytes for p in self.plans.values())
            while len(self.plans) > _MAX_PLANS or total > _MAX_BYTES:
                _, dropped = self.plans.popitem(last=False)
                total -= dropped.nbytes
