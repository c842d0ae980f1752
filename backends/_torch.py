"""The torch backend: unscale and detection over trees of tensors, on any device.

How a call runs: every leaf is validated first (a tensor of float16, bfloat16,
float32 or float64, dense or sparse), then the tensors are bucketed by (device,
dtype) and each bucket goes through PyTorch's own fused kernel,
``torch._amp_foreach_non_finite_check_and_unscale_`` (one dispatch for the whole
bucket; on CPU it takes all four dtypes and rounds half types as the rules do).
Where that kernel does not serve (bfloat16 on CUDA, devices other than CPU and
CUDA) ``torch._foreach_mul_`` by the same float32 inverse does, with every output
checked: the same product, rounded once, and the same flag (see
:func:`kernel_takes`; a test runs both routes on the CPU and compares bits).

That kernel checks its *input*. The rules check the *unscaled* values, which is
the same unless the scale is below 1 (an inverse above 1 can turn a finite value
into inf). So when the scale may be below 1 the outputs are checked too, with one
more read (``torch._foreach_norm(..., inf)``): decided on the host for a host
scale or a CPU tensor, and on the device (masked by ``inv > 1``) for a scale on
an accelerator, where reading it would synchronise.

Flags are 0-d ``torch.bool`` tensors on the gradients' device; nothing but
:meth:`TorchBackend.to_bool` synchronises.

Every operation walks the leaves once, through :func:`_leaves`, and reads each as
the gradient it stands for:

* A sparse COO tensor with duplicate indices stands for their sum. Detection and
  the leaf report read a coalesced temporary. The unscale coalesces a float16 one
  first, as PyTorch's GradScaler does (duplicates could overflow only once
  summed), and any other one after (its values are then exactly PyTorch's
  ``unscale_`` followed by ``coalesce()``, and checked as summed); the norm and
  the clip are those of the coalesced gradient, and the returned tree holds the
  coalesced tensor in the original's place. Every other leaf is unscaled in place.
* A DTensor (FSDP2's gradients) is read through its local shard, in place. Over
  the mesh dimensions it is sharded along, its squares and counts are summed and
  the flag OR-ed (``torch.distributed.all_reduce``, one per dimension for all
  leaves sharded alike), so the norm is the global one and every rank gets the same
  flag and report. A DTensor placed as a partial sum is refused.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from scaler_core._backend import Backend
from scaler_core._coerce import flag_error, host_flag
from scaler_core._errors import (
    GradientTypeError,
    GradientValueError,
    InvalidArgumentError,
    LifecycleError,
)
from scaler_core._f32 import FLT_MIN
from scaler_core._ops import as_flag, clip_coefficient
from scaler_core._tree import leaves_with_paths, map_pairs

from . import _numpy, _plans, _torch_host
from ._common import (
    LeafKind,
    inv_scale_of,
    norm_of_sums,
)

__all__ = [
    "BACKEND",
    "LEAVES",
    "UNSCALED_ON_SKIP",
    "Leaves",
    "TorchBackend",
    "TorchNamespace",
    "check_for_fused",
    "dtensor_type",
    "host_flag_of",
    "inverse_scale",
    "kernel_takes",
    "reads_free",
    "unscale_buckets",
]

#: NumPy's dtype of each accepted torch dtype but bfloat16 (see :func:`_numpy_dtype`).
_NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
#: The torch dtypes the backend accepts.
_ACCEPTED = frozenset({*_NUMPY_DTYPES, torch.bfloat16})
_HALF = (torch.float16, torch.bfloat16)
#: The dtypes the numba kernels read in place, by address.
_WIDE = (torch.float32, torch.float64)


def _numpy_dtype(dtype: Any) -> np.dtype[Any] | None:
    """NumPy's dtype for a torch dtype (``None`` for one the backend refuses). ml_dtypes,
    whose import takes over a second, is imported only for a bfloat16 tensor."""
    if dtype is torch.bfloat16:
        return _bfloat16()
    return _NUMPY_DTYPES.get(dtype)


def _bfloat16() -> np.dtype[Any]:
    import ml_dtypes  # noqa: PLC0415 - only where a bfloat16 tensor is met

    bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bfloat16


#: torch gradient leaves (dense or sparse COO tensors).
LEAVES = LeafKind(
    "torch",
    torch.Tensor,
    "torch.Tensor",
    "torch",
    "torch.as_tensor(x)",
    numpy_dtype=_numpy_dtype,
    cast=".float()",
)


def _values(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose elements are a gradient's: itself, or a sparse tensor's values."""
    return t._values() if t.is_sparse else t


class _Leaf(NamedTuple):
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


def dtensor_type() -> type | None:
    """DTensor's class if ``torch.distributed.tensor`` was imported (else no leaf is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


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


def _flat_leaves(grads: list[Any] | tuple[Any, ...]) -> list[_Leaf] | None:
    """:func:`_leaves` of a flat list or tuple of plain dense float tensors (and
    ``None``), as the drop-in passes an optimizer's gradients: one loop, no tree walk.
    ``None`` for anything else (the walk then validates it, and words any error)."""
    out: list[_Leaf] = []
    seen: set[int] = set()
    for i, leaf in enumerate(grads):
        if leaf is None:
            continue
        if type(leaf) is not torch.Tensor or leaf.dtype not in _ACCEPTED or leaf.is_sparse:
            return None
        if leaf.layout is not torch.strided:
            return None
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(_Leaf(f"grads[{i}]", leaf, leaf, None))
    return out


def _leaves(grads: Any) -> list[_Leaf]:
    """Every leaf validated (nothing is touched before all are), each tensor once, at
    its first path (the same tensor twice is unscaled, counted and reported once)."""
    if type(grads) is list or type(grads) is tuple:
        flat = _flat_leaves(grads)
        if flat is not None:
            return flat
    out: list[_Leaf] = []
    seen: set[int] = set()
    dtensor = dtensor_type()
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
            out.append(_Leaf(path, leaf, local, spread))
    return out


def _coalesced(t: torch.Tensor) -> torch.Tensor:
    """The gradient a tensor stands for: a sparse one with duplicate indices summed (a
    new tensor; the one given is left as it is), anything else itself."""
    return t.coalesce() if t.is_sparse and not t.is_coalesced() else t


def elements(leaf: _Leaf) -> torch.Tensor:
    """What a read-only operation (detection, the leaf report) reads of a leaf: the
    values of the gradient it stands for, here."""
    return _values(_coalesced(leaf.local))


def _spreads(leaves: Iterable[_Leaf]) -> dict[tuple[int, tuple[int, ...]], list[int]]:
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


def sum_over_shards(leaves: Sequence[_Leaf], per_leaf: list[torch.Tensor]) -> list[torch.Tensor]:
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


def _any_over_shards(leaves: Sequence[_Leaf], flag: torch.Tensor) -> torch.Tensor:
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


def host_flag_of(found: Any, what: str, passed: str) -> bool:
    """A step's flag as a frameworks' scaler is passed it, read on the host: a bool (a
    NumPy bool too), or a one-element bool or float tensor (nonzero, NaN included, is
    an overflow; reading it is one host synchronisation).

    Args:
        found: The flag.
        what: Its name, for the message.
        passed: What the framework passes, for the message.

    Raises:
        GradientTypeError: ``found`` is neither (another library's array, an int, a
            tensor of another shape or dtype).
    """
    if isinstance(found, torch.Tensor):
        if found.numel() != 1 or not (found.dtype == torch.bool or found.is_floating_point()):
            raise flag_error(
                what,
                f"a {found.dtype} tensor of shape {list(found.shape)} (a bool, or a "
                f"one-element bool or float tensor, is taken, as {passed})",
            )
        return bool(found.item() != 0)
    flag = host_flag(found, what)
    if flag is None:  # another library's array: not a flag the framework passes
        raise flag_error(what, repr(found))
    return flag


# ------------------------------------------------------------------------ scale
def reads_free(device: torch.device) -> bool:
    """Whether a value on ``device`` is read without a host synchronisation: the one
    place the two routes are chosen, here and in the drop-in.

    The CPU's values are (the host route: scales and flags read, the NumPy kernels,
    a failing step raised); every other device's are not (the device route: nothing
    read back, a failure recorded in the state). A test replaces this function to
    send CPU tensors down the device route, with every host read forbidden.
    """
    return device.type == "cpu"


def inverse_scale(scale: Any) -> tuple[torch.Tensor | float, bool | None]:
    """``(inv, needs_output_check)`` for a host scale or a 0-d tensor scale.

    ``inv = f32(1 / f64(scale))``. ``needs_output_check`` is whether the inverse
    exceeds 1 (the unscale may overflow), or ``None`` when that is known only on
    the device (a scale on an accelerator, not read back).

    Raises:
        GradientValueError: A host or CPU scale that is not a positive, finite,
            normal float32, or a tensor scale of another shape or dtype.
    """
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or not scale.is_floating_point():
            raise GradientValueError(
                f"scale is a tensor of shape {tuple(scale.shape)} and dtype {scale.dtype}, "
                f"but a tensor scale must hold one float; pass the scaler's scale"
            )
        s = scale.detach().reshape(()).float()
        if reads_free(s.device):  # validate as a host value
            value = float(s)
            inv_scale_of(value)
            return s.double().reciprocal().float(), value < 1.0
        # On an accelerator reading it would synchronise: a bad scale becomes NaN there,
        # so every gradient is flagged (fail closed) instead of flipped or zeroed.
        valid = torch.isfinite(s) & (s >= FLT_MIN)
        s = torch.where(valid, s, torch.full_like(s, math.nan))
        return s.double().reciprocal().float(), None
    inv = inv_scale_of(scale)
    return inv, inv > 1.0


def _on(inv: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(inv, torch.Tensor):
        return inv.to(device, non_blocking=True)
    return torch.full((), inv, dtype=torch.float32, device=device)


def kernel_takes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether PyTorch's fused unscale kernel serves ``dtype`` on ``device``.

    On CPU it takes all four dtypes; on CUDA all but bfloat16. Elsewhere (and for
    bfloat16 on CUDA) ``torch._foreach_mul_`` by the same float32 inverse serves,
    with every output checked: the same product, rounded once, the same flag.
    """
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype is not torch.bfloat16


def unscale_buckets(
    buckets: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]],
    inv: torch.Tensor | float,
    found: dict[torch.device, torch.Tensor],
    check_outputs: bool | None,
) -> None:
    """Unscale each (device, dtype) bucket in place; set ``found[device]`` to 1.0 when
    a value is NaN or inf after unscaling (it stays 0.0 or 1.0, as PyTorch's kernel
    leaves it: fused optimizers skip only where ``found_inf == 1``).

    ``check_outputs``: ``True`` or ``False`` as decided on the host, ``None`` to
    decide on the device (outputs checked, the result masked by ``inv > 1``).
    """
    with torch.no_grad():
        for device, by_dtype in buckets.items():
            inv_d = _on(inv, device)
            flag = found[device]
            for dtype, tensors in by_dtype.items():
                if not kernel_takes(device, dtype):
                    # The same product, rounded once, and every output checked.
                    torch._foreach_mul_(tensors, inv_d)
                    torch.maximum(flag, _non_finite(tensors, device).float(), out=flag)
                    continue
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_d)
                if check_outputs is False:
                    continue
                hit = _non_finite(tensors, device).float()
                if check_outputs is None:
                    # Above 1 the unscale may overflow; a NaN inverse (a bad device
                    # scale, made NaN to fail closed) made every output NaN: both count.
                    hit = hit * (~(inv_d <= 1.0)).float()
                # 1.0, never more: fused optimizers skip only where found_inf == 1
                torch.maximum(flag, hit, out=flag)


def check_for_fused(
    buckets: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]],
    inv: torch.Tensor | None,
    found: dict[torch.device, torch.Tensor],
) -> None:
    """Set ``found[device]`` to 1.0 where a fused optimizer's own unscale by ``inv``
    would meet a non-finite value: one read per bucket, nothing written.

    A fused optimizer unscales inside its kernel; this checks for it. A bucket is
    flagged when its largest ``|g|`` is NaN or inf, or when ``|g| * inv`` (in
    float64) exceeds the dtype's largest finite value, a hair more cautious than
    rounding (a value within half an ulp of the maximum rounds to it, and is
    flagged). Only an inverse above 1 can overflow; ``inv`` is a 0-d tensor,
    masked on the device, never read back, or ``None`` where the scale cannot
    fall below 1 (the finiteness check alone).
    """
    with torch.no_grad():
        for device, by_dtype in buckets.items():
            inv_d = None if inv is None else inv.to(device, torch.float64, non_blocking=True)
            flag = found[device]
            for dtype, tensors in by_dtype.items():
                norms = torch._foreach_norm(list(tensors), math.inf)  # NaN and inf propagate
                biggest = torch.stack([n.double() for n in norms]).max()
                hit = ~torch.isfinite(biggest)
                if inv_d is not None:
                    # NaN-safe: a NaN inverse (a bad device scale) flags the bucket.
                    hit |= ~(biggest * inv_d <= torch.finfo(dtype).max) & ~(inv_d <= 1.0)
                torch.maximum(flag, hit.float(), out=flag)


def _non_finite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether any element of ``tensors`` is NaN or inf: one read, a 0-d bool on ``device``."""
    tensors = [t for t in tensors if t.numel()]  # an empty tensor has no max norm
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    norms = torch._foreach_norm(tensors, math.inf)  # max |x|: NaN or inf propagate
    # Each norm tested in its own dtype: a float64 norm cast to float32 could overflow.
    return ~torch.stack([torch.isfinite(n) for n in norms]).all()


def _buckets(
    tensors: Iterable[torch.Tensor],
) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
    out: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
        lambda: defaultdict(list)
    )
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:  # the same tensor twice is unscaled once
            seen.add(id(t))
            out[t.device][t.dtype].append(t)
    return out


def _combine(flags: dict[torch.device, torch.Tensor], default: torch.device) -> torch.Tensor:
    """One 0-d bool flag on the first device, from per-device float flags (no sync)."""
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=default)
    items = list(flags.items())
    first = items[0][0]
    total = items[0][1] > 0
    for _, f in items[1:]:
        total = total | (f > 0).to(first, non_blocking=True)
    return total


# --------------------------------------------------------- device transition
class _DType:
    """A torch dtype for :func:`device_update`: callable to make a 0-d tensor."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device

    def __call__(self, value: Any) -> torch.Tensor:
        return torch.full((), value, dtype=self.dtype, device=self.device)


class TorchNamespace:
    """torch as :meth:`scaler_core.Backend.namespace` describes it, on one device: the
    array namespace of :func:`scaler_core.device_update` and of the flag operations.

    Python scalars become 0-d tensors with ``torch.full`` (a fill, not a copy from
    the host), so a transition on an accelerator stays free of transfers.
    """

    on_host = False
    float64_missing = None
    map_pairs = staticmethod(map_pairs)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.float32 = _DType(torch.float32, device)
        self.float64 = _DType(torch.float64, device)
        self.int32 = _DType(torch.int32, device)

    def _dtype(self, dtype: Any) -> torch.dtype | None:
        if dtype is None:
            return None
        if isinstance(dtype, _DType):
            return dtype.dtype
        if dtype is bool:
            return torch.bool
        return dtype  # type: ignore[no-any-return]

    def asarray(self, value: Any, dtype: Any = None) -> torch.Tensor:
        dt = self._dtype(dtype)
        if isinstance(value, torch.Tensor):
            return value.to(device=self.device, dtype=dt or value.dtype, non_blocking=True)
        if isinstance(value, np.ndarray | list | tuple) and np.ndim(value):
            return torch.as_tensor(value, dtype=dt, device=self.device)
        if isinstance(value, np.generic | np.ndarray):
            value = value.item()
        if dt is None:
            dt = torch.bool if isinstance(value, bool) else torch.get_default_dtype()
        return torch.full((), value, dtype=dt, device=self.device)

    def flag(self, value: bool) -> torch.Tensor:
        return torch.full((), value, dtype=torch.bool, device=self.device)

    @staticmethod
    def is_array(value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    @staticmethod
    def read(flag: torch.Tensor) -> bool:
        return bool(flag.item())

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> torch.Tensor:
        """``torch.where``, on ``b``'s device when it is a tensor (a flag or an old
        value on another device moves there, without a sync)."""
        if isinstance(b, torch.Tensor):
            if cond.device != b.device:
                cond = cond.to(b.device, non_blocking=True)
            if isinstance(a, torch.Tensor) and a.device != b.device:
                a = a.to(b.device, non_blocking=True)
        return torch.where(cond, a, b)

    @staticmethod
    def logical_or(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """On ``a``'s device."""
        return a | (b if b.device == a.device else b.to(a.device, non_blocking=True))

    @staticmethod
    def isfinite(a: torch.Tensor) -> torch.Tensor:
        return torch.isfinite(a)

    @staticmethod
    def isdtype(dtype: Any, kind: str) -> bool:
        """The Array API's ``isdtype`` for the kinds the core asks (torch has none)."""
        if kind == "bool":
            return dtype is torch.bool
        if kind == "real floating":
            return isinstance(dtype, torch.dtype) and dtype.is_floating_point
        raise InvalidArgumentError(
            f"kind={kind!r}, but the torch namespace answers 'bool' and 'real floating'"
        )

    @staticmethod
    def maximum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum(a, b)

    @staticmethod
    def minimum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``b`` where it is below ``a``, else ``a``: a NaN ``a`` comes back bit for bit,
        as ``torch.clamp(a, max=...)`` returns it (``torch.minimum`` would return a NaN
        of its own), so the clip coefficient keeps the bits PyTorch's clamp gives."""
        return torch.where(b < a, b, a)


_NAMESPACES: dict[torch.device, TorchNamespace] = {}
_CPU = torch.device("cpu")


def namespace_on(device: torch.device) -> TorchNamespace:
    """The :class:`TorchNamespace` of ``device`` (one per device, made once)."""
    ns = _NAMESPACES.get(device)
    if ns is None:
        ns = _NAMESPACES.setdefault(device, TorchNamespace(device))
    return ns


# ---------------------------------------------------------------- the backend
def _host_scale(scale: Any) -> float | None:
    """The scale as a float when it is one on the host (a float, a CPU tensor), else None."""
    if isinstance(scale, torch.Tensor):
        return float(scale.detach().reshape(()).float()) if reads_free(scale.device) else None
    return float(scale)


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (bfloat16 through its int16 bits).

    A negative view (``torch._neg_view``) is viewed as the memory it negates: what
    the CPU route does (multiply by positive factors, test finiteness, sum squares)
    gives exactly the negated bits, since rounding is symmetric about zero.
    """
    t = t.detach()
    if t.is_neg():
        t = torch._neg_view(t)  # the memory itself, its sign bit no longer flipped
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(_bfloat16())
    return t.numpy()


def _numpy_plan(tensors: Sequence[torch.Tensor]) -> _plans.Plan:
    """A plan for the numba kernels over distinct dense CPU tensors: contiguous float32
    and float64 ones by address (``data_ptr``: a fraction of a microsecond, where a
    NumPy view and its address cost several), the rest through NumPy views (a
    negative view is its memory, as in :func:`_numpy_view`)."""
    arrays: list[np.ndarray] = []
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.dtype in _WIDE and t.is_contiguous():
            by_dtype.setdefault(t.dtype, []).append(t)
        else:
            arrays.append(_numpy_view(t))
    blocks = {
        _NUMPY_DTYPES[dtype]: ([t.data_ptr() for t in ts], [t.numel() for t in ts])
        for dtype, ts in by_dtype.items()
    }
    return _plans.plan_blocks(arrays, blocks, list(tensors))


#: What the CPU route hands on: NumPy views (the NumPy backend validates and plans
#: them), a plan for the numba kernels, or one for PyTorch's (:mod:`._torch_host`).
_Prepared = list[np.ndarray] | _plans.Plan | _torch_host.Plan


def _host_route(
    tensors: Sequence[torch.Tensor], scale: Any, *, torch_kernels: bool = False
) -> tuple[_Prepared, float] | None:
    """The gradients (distinct tensors) prepared for the NumPy backend's kernels and the
    scale as a float, when every gradient is a dense CPU tensor and the scale is on the
    host: then one pass gives the flag and the norm, and a skipped step writes nothing.
    ``None`` otherwise.

    With numba, a plan of the tensors' memory (unless two tensors overlap). Without
    it, with ``torch_kernels``, the tensors planned for :mod:`._torch_host` (PyTorch's
    kernels, the same results; the NumPy path would run on one thread, slower than
    PyTorch's own pair), when it serves them. Else NumPy views.
    """
    if not all(t.is_cpu and reads_free(t.device) and t.layout is torch.strided for t in tensors):
        return None
    host = _host_scale(scale)
    if host is None:
        return None
    numpy_backend = _numpy.BACKEND  # read per call: a test or benchmark may swap it
    if numpy_backend.path == "numba":
        planned = _numpy_plan(tensors)
        if not planned.aliased:
            return planned, host
    elif torch_kernels:
        prepared = _torch_host.plan(tensors)
        if prepared is not None:
            return prepared, host
    return [_numpy_view(t) for t in tensors], host


def _norm(
    leaves: Sequence[_Leaf],
    values: Sequence[torch.Tensor],
    default: torch.device,
    times: Sequence[torch.Tensor | float] | None = None,
) -> torch.Tensor:
    """The global L2 norm of the leaves' ``values`` (a sharded leaf's over all its shards),
    each value's squares summed in float64 (times the square of its ``times`` entry),
    as a float32 0-d tensor on ``default``: rounded once."""
    if not values:
        return torch.zeros((), dtype=torch.float32, device=default)
    per_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, v in enumerate(values):
        per_device[v.device].append(i)
    squares: list[torch.Tensor] = [torch.zeros(())] * len(values)
    for indices in per_device.values():
        norms = torch._foreach_norm([values[i] for i in indices], 2, dtype=torch.float64)
        for i, n in zip(indices, norms, strict=True):
            factor = 1.0 if times is None else times[i]
            if isinstance(factor, torch.Tensor):
                squares[i] = (n * factor.to(n.device, torch.float64, non_blocking=True)).square()
            else:
                squares[i] = n.square() if factor == 1.0 else (n * factor).square()
    squares = sum_over_shards(leaves, squares)
    return torch.stack([q.to(default) for q in squares]).sum().sqrt().float()


def _read(
    leaves: Sequence[_Leaf], inv: torch.Tensor | float, check: bool | None, default: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flag and the norm the unscale by ``inv`` would give, read from the scaled
    values, with nothing written: ``(flag, norm)`` on ``default``.

    Two reads of each gradient: :func:`check_for_fused` for the flag (NaN or inf, and,
    unless ``check`` is ``False``, a value the unscale would overflow), then the
    float64 L2 norm of the scaled values times ``inv``, rounded once. PyTorch has no
    kernel that gives both in one pass. For a power-of-two scale the norm is the
    unscaled values' bit for bit (every product is exact); otherwise within a float32
    ulp of it. A float16 or bfloat16 gradient is unscaled into a temporary of its
    dtype first, so its norm is of the values the unscale would store (rounded to
    half precision), as :meth:`TorchBackend.measure` defines it.
    """
    values = [elements(leaf) for leaf in leaves]
    buckets = _buckets(values)
    found = {dev: torch.zeros((), dtype=torch.float32, device=dev) for dev in buckets}
    checked = None if check is False else _on(inv, default).double()
    check_for_fused(buckets, checked, found)
    flag = _any_over_shards(leaves, _combine(found, default))
    measured: list[torch.Tensor] = []
    times: list[torch.Tensor | float] = []
    with torch.no_grad():
        for v in values:
            if v.dtype in _HALF:
                measured.append((v.float() * _on(inv, v.device)).to(v.dtype))
                times.append(1.0)
            else:
                measured.append(v)
                times.append(inv)
    return flag, _norm(leaves, measured, flag.device, times)


def _unscale(
    leaves: Sequence[_Leaf], scale: Any, inv: torch.Tensor | float, check: bool | None
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Unscale the leaves in place: ``(replaced, values, flag)``.

    A sparse gradient is the sum it stands for. A float16 one with duplicate indices
    is coalesced before the unscale, as PyTorch's GradScaler does (its duplicates
    could overflow only once summed); any other after it, so its values are exactly
    PyTorch's ``unscale_`` followed by ``coalesce()``, and checked as summed.
    ``replaced`` maps the id of each such leaf to its coalesced tensor; ``values``
    are what the norm and the clip read, leaf by leaf; the flag is the same on every
    rank holding a shard of a DTensor leaf.
    """
    replaced: dict[int, torch.Tensor] = {}
    targets = []
    for leaf in leaves:
        target = leaf.local
        if target.is_sparse and target.dtype == torch.float16:
            target = _coalesced(target)
        targets.append(target)
    buckets = _buckets(_values(t) for t in targets)
    found = {dev: torch.zeros((), dtype=torch.float32, device=dev) for dev in buckets}
    unscale_buckets(buckets, inv, found, check)
    summed: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for i, unscaled in enumerate(targets):
        if unscaled.is_sparse and not unscaled.is_coalesced():
            targets[i] = unscaled.coalesce()
            summed[unscaled.device].append(targets[i]._values())
    with torch.no_grad():
        for device, values in summed.items():
            torch.maximum(found[device], _non_finite(values, device).float(), out=found[device])
    for leaf, target in zip(leaves, targets, strict=True):
        if target is not leaf.local:
            replaced[id(leaf.tensor)] = target
    flag = _any_over_shards(leaves, _combine(found, _default_device(scale)))
    return replaced, [_values(t) for t in targets], flag


def _put(grads: Any, replaced: dict[int, torch.Tensor]) -> Any:
    """``grads`` with each coalesced sparse gradient in its original's place."""
    if not replaced:
        return grads
    return map_pairs(lambda _, a, b: replaced.get(id(b), b), grads, grads, "grads")


def _route(
    leaves: Sequence[_Leaf], scale: Any, *, torch_kernels: bool = False
) -> tuple[_Prepared, float] | None:
    """:func:`_host_route` for the leaves (each tensor once, as :func:`_leaves` gives
    them); never for a sharded one (its norm is summed over ranks between the read and
    the write)."""
    if any(leaf.spread is not None for leaf in leaves):
        return None
    return _host_route([leaf.local for leaf in leaves], scale, torch_kernels=torch_kernels)


class _HostPass(NamedTuple):
    """What :meth:`TorchBackend.measure` prepared on the CPU route, for :meth:`rescale`."""

    #: The NumPy backend the read ran on (read per call: a test may swap it).
    numpy_backend: Any
    #: A plan for the numba kernels, one for PyTorch's (:mod:`._torch_host`, holding
    #: what the read gathered), or the NumPy backend's own prepared views.
    prepared: Any
    #: The scale as a float, and its inverse.
    host: float
    inv: float


class Leaves:
    """What :meth:`TorchBackend.leaves` returns: the tree, its leaves validated (each
    tensor once), and what the measuring pass leaves for :meth:`TorchBackend.rescale`.

    ``host`` is set by a read-only :meth:`~TorchBackend.measure` on the CPU route
    (dense CPU tensors, a host scale): the plan its read made, reused by the write.
    ``values`` and ``replaced`` are set by a read-only measure elsewhere (an
    accelerator, sparse or sharded gradients), which unscales in place: the values
    the clip multiplies, and the coalesced tensors that take the place of sparse
    leaves in the returned tree. ``writable`` is ``False`` for leaves that must not
    be written at all: a measure there only reads, and no rescale may follow.
    """

    __slots__ = ("grads", "host", "leaves", "replaced", "values", "writable")

    def __init__(self, grads: Any, leaves: list[_Leaf], writable: bool = True) -> None:
        self.grads = grads
        self.leaves = leaves
        self.writable = writable
        self.host: _HostPass | None = None
        self.values: list[torch.Tensor] | None = None
        self.replaced: dict[int, torch.Tensor] = {}


class TorchBackend(Backend):
    """Unscale and detection for torch tensors; the flag is a 0-d ``torch.bool`` tensor.

    Args:
        unscale_skipped: Whether :meth:`rescale` leaves a skipped step's gradients
            unscaled on the CPU route too, as ``torch.amp.GradScaler.unscale_`` leaves
            them and as the accelerator route does anyway (one write, on skipped steps
            only). The drop-in's clip asks for it; the backend protocol's rule (a
            skipped step writes nothing) is the default.
    """

    name = "torch"

    def __init__(self, *, unscale_skipped: bool = False) -> None:
        self.unscale_skipped = unscale_skipped

    def leaves(self, grads: Any, *, writable: bool) -> Leaves:
        """See :meth:`scaler_core.Backend.leaves`: every leaf validated, each tensor once.

        Tensors have no read-only flag: ``writable=False`` is kept as a promise that
        nothing is written, which :meth:`measure` keeps. A DTensor placed as a partial
        sum is refused (:class:`GradientValueError`).
        """
        return Leaves(grads, _leaves(grads), writable)

    def unscale(self, leaves: Leaves, scale: Any) -> tuple[Any, torch.Tensor]:
        """See :meth:`scaler_core.Backend.unscale`: in place, one kernel per (device, dtype).

        ``scale`` may be a host float or a 0-d float tensor (a CPU one is validated;
        one on an accelerator is not read back, and a bad one fails closed). A sparse
        gradient with duplicate indices comes back coalesced (see the module's notes).
        With ``scale`` ``None``: one read, nothing written (a sparse gradient with
        duplicate indices is read as summed, in a temporary).
        """
        if scale is None:
            buckets = _buckets(elements(leaf) for leaf in leaves.leaves)
            found = {
                dev: _non_finite([t for ts in by_dtype.values() for t in ts], dev).float()
                for dev, by_dtype in buckets.items()
            }
            return leaves.grads, _any_over_shards(
                leaves.leaves, _combine(found, torch.device("cpu"))
            )
        inv, check = inverse_scale(scale)
        replaced, _, flag = _unscale(leaves.leaves, scale, inv, check)
        return _put(leaves.grads, replaced), flag

    def measure(
        self, leaves: Leaves, scale: Any, *, write: bool
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """See :meth:`scaler_core.Backend.measure`.

        On CPU (dense tensors, a host scale) the NumPy kernels do it in one pass, on
        the tensors' memory (without numba and without ``write``, PyTorch's kernels,
        :mod:`._torch_host`); the flag and the norm come back as CPU tensors.

        Elsewhere (an accelerator, sparse or sharded gradients) PyTorch's unscale
        kernel, then ``_foreach_norm`` in float64 (a second read: PyTorch has no fused
        kernel for both). For writable leaves this route stores the unscaled values
        even without ``write``, and :meth:`rescale` then multiplies them by the
        coefficient alone, so a skipped step's gradients are left unscaled, as
        ``unscale_`` leaves them. For leaves made with ``writable=False`` it writes
        nothing: two reads of the scaled values (:func:`_read`), and no
        :meth:`rescale` follows. A sparse gradient's norm is its coalesced sum's; a
        DTensor's is over all its shards.
        """
        inv, check = inverse_scale(scale)  # validates the scale, as unscale() does
        route = _route(leaves.leaves, scale, torch_kernels=not write)
        if route is not None:
            prepared, host = route
            numpy_backend = _numpy.BACKEND  # the one _route planned for
            host_inv = inv_scale_of(host)
            work: Any = prepared
            found: Any
            if isinstance(prepared, _torch_host.Plan):  # made for the read-only pass only
                found, sums = _torch_host.measure(prepared, host_inv)
                norm = norm_of_sums(sums)
            elif isinstance(prepared, _plans.Plan):
                found, norm = numpy_backend.measure_planned(prepared, host_inv, write=write)
            else:  # NumPy views: the NumPy backend validates and plans them
                work = numpy_backend.leaves(prepared, writable=True)
                _, found, norm = numpy_backend.measure(work, host, write=write)
            if not write:
                leaves.host = _HostPass(numpy_backend, work, host, host_inv)
            return leaves.grads, torch.tensor(bool(found)), torch.tensor(float(norm))
        if not (write or leaves.writable):
            return (leaves.grads, *_read(leaves.leaves, inv, check, _default_device(scale)))
        replaced, values, flag = _unscale(leaves.leaves, scale, inv, check)
        if not write:
            leaves.values, leaves.replaced = values, replaced
        return _put(leaves.grads, replaced), flag, _norm(leaves.leaves, values, flag.device)

    def rescale(self, leaves: Leaves, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        """See :meth:`scaler_core.Backend.rescale`, after :meth:`measure` without ``write``.

        On CPU: unless ``skip`` (a CPU flag, read for free), one write of the unscaled
        values times the coefficient, through the plan the read made (with
        ``unscale_skipped``, a skipped step's unscaled values). Elsewhere the
        values are unscaled already (see :meth:`measure`): one ``_foreach_mul_`` by the
        coefficient, which is 1 where ``skip`` (decided on the device, never read
        back), so a skipped step's gradients stay unscaled.

        Raises:
            LifecycleError: :meth:`measure` without ``write`` did not run on ``leaves``
                first (or this pass already did).
        """
        host, values = leaves.host, leaves.values
        leaves.host = leaves.values = None  # one rescale per measure
        if host is not None:
            numpy_backend, prepared, scale_value, inv = host
            if self.to_bool(skip):
                if self.unscale_skipped:  # a coefficient of 1 (a norm of 0): unscale()'s values
                    norm, max_norm = np.float32(0.0), 1.0
                else:
                    return leaves.grads
            host_norm = np.float32(float(norm))
            if isinstance(prepared, _torch_host.Plan):
                with np.errstate(all="ignore"):
                    coef = clip_coefficient(np, host_norm, max_norm)
                if inv != 1.0 or coef != 1.0:  # else nothing would change: write nothing
                    _torch_host.write_clip(prepared, inv, float(coef))
            elif isinstance(prepared, _plans.Plan):
                numpy_backend.rescale_planned(prepared, inv, host_norm, max_norm)
            else:
                numpy_backend.rescale(prepared, scale_value, host_norm, max_norm, np.False_)
            return leaves.grads
        if values is None:
            raise LifecycleError(
                "rescale() ran without a measure(..., write=False) on these leaves before it; "
                "call leaves(), measure(write=False), then rescale() once (as "
                "scaler_core.unscale_and_clip does)"
            )
        xp = namespace_on(norm.device)
        coef = clip_coefficient(xp, norm.float(), max_norm)
        coef = torch.where(as_flag(xp, skip).to(coef.device), torch.ones_like(coef), coef)
        with torch.no_grad():
            for device, by_dtype in _buckets(values).items():
                for tensors in by_dtype.values():
                    torch._foreach_mul_(tensors, coef.to(device, non_blocking=True))
        return _put(leaves.grads, leaves.replaced)

    def scale_loss(self, loss: Any, scale: Any) -> torch.Tensor:
        """See :meth:`scaler_core.Backend.scale_loss`: float32 (or float64) on the loss's device."""
        if not isinstance(loss, torch.Tensor):
            raise GradientTypeError(
                f"loss is a {type(loss).__qualname__}, but the torch backend needs a tensor loss"
            )
        wide = loss.float() if loss.dtype in _HALF else loss
        if isinstance(scale, torch.Tensor):
            inverse_scale(scale)  # validates it as far as it can be
            return wide * scale.detach().reshape(()).float().to(loss.device)
        inv_scale_of(scale)
        return wide * float(np.float32(scale))

    def namespace(self, *values: Any) -> TorchNamespace:
        """See :meth:`scaler_core.Backend.namespace`: torch on the first tensor's device
        among ``values`` (the CPU where there is none)."""
        for value in values:
            if isinstance(value, torch.Tensor):
                return namespace_on(value.device)
        return namespace_on(_CPU)

    def non_finite_counts(self, grads: Any) -> list[tuple[str, int, int]]:
        """See :class:`scaler_core.Backend` (``non_finite_counts``): counted where each tensor
        lives (``torch.isnan``/``torch.isinf``, in pieces of :data:`_COUNT_PIECE`
        elements), read back once per device. Leaves are read as every torch
        operation reads them: a sparse tensor with duplicate indices as summed (in a
        temporary), a DTensor over all its shards (the counts all-reduced over the
        ranks holding them, so every rank names the leaf).

        Raises:
            GradientTypeError: As ``unscale``: a leaf is not a dense or sparse COO
                tensor of an accepted dtype.
            GradientValueError: As ``unscale``: a DTensor placed as a partial sum.
        """
        leaves = _leaves(grads)  # each tensor once, at its first path
        rows: list[torch.Tensor] = []
        with torch.no_grad():
            for leaf in leaves:
                values = elements(leaf)
                if values.is_contiguous() and values.numel() > _COUNT_PIECE:
                    flat = values.reshape(-1)
                    pieces = [
                        flat[i : i + _COUNT_PIECE] for i in range(0, flat.numel(), _COUNT_PIECE)
                    ]
                else:
                    pieces = [values]
                nan = torch.zeros((), dtype=torch.int64, device=values.device)
                inf = torch.zeros((), dtype=torch.int64, device=values.device)
                for piece in pieces:
                    nan = nan + torch.isnan(piece).sum()
                    inf = inf + torch.isinf(piece).sum()
                rows.append(torch.stack([nan, inf]))
            rows = sum_over_shards(leaves, rows)
            by_device: dict[torch.device, list[int]] = {}
            for i, row in enumerate(rows):
                by_device.setdefault(row.device, []).append(i)
            counts: list[tuple[int, int]] = [(0, 0)] * len(leaves)
            for indices in by_device.values():
                host = torch.stack([rows[i] for i in indices]).tolist()  # one read per device
                for i, (nan_count, inf_count) in zip(indices, host, strict=True):
                    counts[i] = (int(nan_count), int(inf_count))
        return [(leaf.path, n, i) for leaf, (n, i) in zip(leaves, counts, strict=True)]


#: Elements per piece when counting NaN and inf: the temporaries are bool tensors, so
#: large pieces (few launches) stay small next to the gradients.
_COUNT_PIECE = 1 << 24


def _default_device(scale: Any) -> torch.device:
    return scale.device if isinstance(scale, torch.Tensor) else torch.device("cpu")


BACKEND = TorchBackend()
#: The drop-in's backend for its clip: a skipped step's gradients are left unscaled on
#: every route, as ``torch.amp.GradScaler.unscale_`` leaves them.
UNSCALED_ON_SKIP = TorchBackend(unscale_skipped=True)
