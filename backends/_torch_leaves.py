"""The torch backend's leaves: the one walk over a tree of tensors, and how each is read.

Every operation of the torch backend (:mod:`._torch`) walks the leaves once,
through :func:`leaves_of`, which validates every leaf before any is touched (a
tensor of float16, bfloat16, float32 or float64, dense or sparse), and reads each
as the gradient it stands for:

* A sparse COO tensor with duplicate indices stands for their sum. Detection and
  the leaf report read a coalesced temporary (:func:`elements`). The unscale
  coalesces a float16 one first, as PyTorch's GradScaler does (duplicates could
  overflow only once summed), and any other one after (its values are then exactly
  PyTorch's ``unscale_`` followed by ``coalesce()``, and checked as summed); the
  norm and the clip are those of the coalesced gradient, and the returned tree
  holds the coalesced tensor in the original's place. Every other leaf is unscaled
  in place.
* A DTensor (FSDP2's gradients) is read through its local shard, in place. Over
  the mesh dimensions it is sharded along, its squares and counts are summed
  (:func:`sum_over_shards`) and the flag OR-ed (:func:`any_over_shards`), with
  ``torch.distributed.all_reduce``, one per dimension for all leaves sharded alike,
  so the norm is the global one and every rank gets the same flag and report. A
  DTensor placed as a partial sum is refused.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from scaler_core._errors import GradientTypeError, GradientValueError
from scaler_core._tree import leaves_with_paths

from . import torch_kernels as kernels
from ._common import LeafKind

__all__ = [
    "ACCEPTED",
    "LEAVES",
    "NUMPY_DTYPES",
    "Leaf",
    "any_over_shards",
    "bfloat16",
    "coalesced",
    "elements",
    "leaves_of",
    "numpy_dtype",
    "sum_over_shards",
    "values_of",
]

#: NumPy's dtype of each accepted torch dtype but bfloat16 (see :func:`numpy_dtype`).
NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
#: The torch dtypes the backend accepts.
ACCEPTED = frozenset({*NUMPY_DTYPES, torch.bfloat16})


def numpy_dtype(dtype: Any) -> np.dtype[Any] | None:
    """NumPy's dtype for a torch dtype (``None`` for one the backend refuses). ml_dtypes,
    whose import takes over a second, is imported only for a bfloat16 tensor."""
    if dtype is torch.bfloat16:
        return bfloat16()
    return NUMPY_DTYPES.get(dtype)


def bfloat16() -> np.dtype[Any]:
    """ml_dtypes' bfloat16 as a NumPy dtype (imported on first use)."""
    import ml_dtypes  # noqa: PLC0415 - only where a bfloat16 tensor is met

    dtype: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return dtype


#: torch gradient leaves (dense or sparse COO tensors).
LEAVES = LeafKind(
    "torch",
    torch.Tensor,
    "torch.Tensor",
    "torch",
    "torch.as_tensor(x)",
    numpy_dtype=numpy_dtype,
    cast=".float()",
)


def values_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose elements are a gradient's: itself, or a sparse tensor's values."""
    return t._values() if t.is_sparse else t


class Leaf(NamedTuple):
    """One gradient as every operation sees it (the one walk over the leaves).

    ``local`` holds the elements this process reads and writes: the leaf itself, or
    a DTensor's local shard. ``spread`` is, for a DTensor sharded over some
    dimensions of its device mesh, ``(mesh, dims)``: a sum over the leaf (its
    norm, its NaN and inf counts) is all-reduced over those dimensions, and a flag
    too (PyTorch's DTensor unscale reduces its flag the same way). Replicated
    dimensions are not summed over: every rank there holds the same values.
    """

    path: str
    tensor: torch.Tensor
    local: torch.Tensor
    spread: tuple[Any, tuple[int, ...]] | None


def _shard(path: str, leaf: Any) -> tuple[torch.Tensor, tuple[Any, tuple[int, ...]] | None]:
    """A DTensor's local shard and the mesh dimensions it is sharded over."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415 - a DTensor exists

    dims = []
    for dim, placement in enumerate(leaf.placements):
        if isinstance(placement, Shard):
            dims.append(dim)
        elif not isinstance(placement, Replicate):
            raise GradientValueError(
                f"{path} is a DTensor placed {tuple(leaf.placements)} on its mesh, but the "
                f"torch backend takes sharded or replicated DTensors ({placement} holds "
                f"summands, not the gradient); redistribute it first, for example with "
                f".redistribute(placements=[Replicate()] * mesh.ndim)"
            )
    with torch.no_grad():
        local = leaf.to_local()  # the local shard itself, not a copy
    return local, ((leaf.device_mesh, tuple(dims)) if dims else None)


def _flat_leaves(grads: list[Any] | tuple[Any, ...]) -> list[Leaf] | None:
    """:func:`leaves_of` of a flat list or tuple of plain dense float tensors (and
    ``None``), as the drop-in passes an optimizer's gradients: one loop, no tree walk.
    ``None`` for anything else (the walk then validates it, and words any error)."""
    out: list[Leaf] = []
    seen: set[int] = set()
    for i, leaf in enumerate(grads):
        if leaf is None:
            continue
        if type(leaf) is not torch.Tensor or leaf.dtype not in ACCEPTED or leaf.is_sparse:
            return None
        if leaf.layout is not torch.strided:
            return None
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(Leaf(f"grads[{i}]", leaf, leaf, None))
    return out


def leaves_of(grads: Any) -> list[Leaf]:
    """Every leaf validated (nothing is touched before all are), each tensor once, at
    its first path (the same tensor twice is unscaled, counted and reported once)."""
    if type(grads) is list or type(grads) is tuple:
        flat = _flat_leaves(grads)
        if flat is not None:
            return flat
    out: list[Leaf] = []
    seen: set[int] = set()
    dtensor = kernels.dtensor_type()
    for path, leaf in leaves_with_paths(grads):
        LEAVES.check(path, leaf)
        local, spread = leaf, None
        if dtensor is not None and isinstance(leaf, dtensor):
            local, spread = _shard(path, leaf)
        if local.layout not in (torch.strided, torch.sparse_coo):
            raise GradientTypeError(
                f"{path} has layout {local.layout}, but the torch backend takes dense (strided) "
                f"and sparse COO tensors; convert it with .to_dense()"
            )
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(Leaf(path, leaf, local, spread))
    return out


def coalesced(t: torch.Tensor) -> torch.Tensor:
    """The gradient a tensor stands for: a sparse one with duplicate indices summed (a
    new tensor; the one given is left as it is), anything else itself."""
    return t.coalesce() if t.is_sparse and not t.is_coalesced() else t


def elements(leaf: Leaf) -> torch.Tensor:
    """What a read-only operation (detection, the leaf report) reads of a leaf: the
    values of the gradient it stands for, here."""
    return values_of(coalesced(leaf.local))


def _spreads(leaves: Iterable[Leaf]) -> dict[tuple[int, tuple[int, ...]], list[int]]:
    """The leaves' indices by how they are sharded (mesh and dimensions)."""
    out: dict[tuple[int, tuple[int, ...]], list[int]] = defaultdict(list)
    for i, leaf in enumerate(leaves):
        if leaf.spread is not None:
            out[id(leaf.spread[0]), leaf.spread[1]].append(i)
    return out


def _all_reduce(t: torch.Tensor, spread: tuple[Any, tuple[int, ...]], op: str) -> None:
    import torch.distributed as dist  # noqa: PLC0415 - a DTensor exists, so it is loaded

    mesh, dims = spread
    for dim in dims:
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=mesh.get_group(dim))


def sum_over_shards(leaves: Sequence[Leaf], per_leaf: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each leaf's ``per_leaf`` sum (a norm's squares, counts) summed over the ranks that
    hold its other shards; a leaf that is not sharded keeps its own. One all-reduce per
    mesh dimension for all leaves sharded alike."""
    out = list(per_leaf)
    for indices in _spreads(leaves).values():
        stacked = torch.stack([per_leaf[i] for i in indices])
        _all_reduce(stacked, cast(Any, leaves[indices[0]].spread), "SUM")
        for j, i in enumerate(indices):
            out[i] = stacked[j]
    return out


def any_over_shards(leaves: Sequence[Leaf], flag: torch.Tensor) -> torch.Tensor:
    """The flag OR-ed over the ranks that hold other shards of the leaves (so every
    rank gets the same one), as PyTorch's DTensor unscale reduces its flag."""
    spreads = _spreads(leaves)
    if not spreads:
        return flag
    for indices in spreads.values():
        leaf = leaves[indices[0]]
        wide = flag.to(leaf.local.device, torch.float32)
        _all_reduce(wide, cast(Any, leaf.spread), "MAX")
        flag = wide.to(flag.device) > 0
    return flag
