"""The torch backend: unscale and detection over trees of tensors, on any device.

How a call runs: every leaf is validated first and read as the gradient it stands
for (a sparse one as its summed values, a DTensor through its local shard: see
:mod:`._torch_leaves`), then the tensors are bucketed by (device, dtype) and each
bucket goes through PyTorch's fused kernels (:mod:`.torch_kernels`, which the
PyTorch drop-in runs too). The measure (norm and clip) of dense CPU tensors by a
host scale runs the NumPy backend's kernels over the tensors' memory instead (the
CPU route; without numba, PyTorch's own in :mod:`._torch_host`).

PyTorch's unscale kernel checks its *input*. The rules check the *unscaled* values,
which is the same unless the scale is below 1 (an inverse above 1 can turn a finite
value into inf). So when the scale may be below 1 the outputs are checked too, with one
more read (``torch._foreach_norm(..., inf)``): decided on the host for a host
scale or a CPU tensor, and on the device (masked by ``inv > 1``) for a scale on
an accelerator, where reading it would synchronise.

Flags are 0-d ``torch.bool`` tensors on the gradients' device; nothing but
:meth:`TorchBackend.to_bool` synchronises.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, NamedTuple

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
from scaler_core._tree import map_pairs

from . import _numpy, _plans, _torch_host
from . import torch_kernels as kernels
from ._common import inv_scale_of, norm_of_sums
from ._torch_leaves import (
    LEAVES,
    NUMPY_DTYPES,
    Leaf,
    any_over_shards,
    bfloat16,
    coalesced,
    elements,
    leaves_of,
    sum_over_shards,
    values_of,
)
from ._torch_plans import TensorPlans

__all__ = [
    "BACKEND",
    "LEAVES",
    "UNSCALED_ON_SKIP",
    "Leaves",
    "TorchBackend",
    "TorchNamespace",
    "host_flag_of",
    "inverse_scale",
]

_HALF = (torch.float16, torch.bfloat16)
#: The dtypes the numba kernels read in place, by address.
_WIDE = (torch.float32, torch.float64)


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
        if kernels.reads_free(s.device):  # validate as a host value
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
        return (
            float(scale.detach().reshape(()).float()) if kernels.reads_free(scale.device) else None
        )
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
        return t.view(torch.int16).numpy().view(bfloat16())
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
        NUMPY_DTYPES[dtype]: ([t.data_ptr() for t in ts], [t.numel() for t in ts])
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
    if not all(
        t.is_cpu and kernels.reads_free(t.device) and t.layout is torch.strided for t in tensors
    ):
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
    leaves: Sequence[Leaf],
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
    leaves: Sequence[Leaf], inv: torch.Tensor | float, check: bool | None, default: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The flag and the norm the unscale by ``inv`` would give, read from the scaled
    values, with nothing written: ``(flag, norm)`` on ``default``.

    Two reads of each gradient: :func:`.torch_kernels.check_for_fused` for the flag
    (NaN or inf, and, unless ``check`` is ``False``, a value the unscale would
    overflow), then the float64 L2 norm of the scaled values times ``inv``, rounded
    once. PyTorch has no kernel that gives both in one pass. For a power-of-two scale
    the norm is the unscaled values' bit for bit (every product is exact); otherwise
    within a float32 ulp of it. A float16 or bfloat16 gradient is unscaled into a
    temporary of its dtype first, so its norm is of the values the unscale would
    store (rounded to half precision), as :meth:`TorchBackend.measure` defines it.
    """
    values = [elements(leaf) for leaf in leaves]
    buckets = kernels.buckets(values)
    found = {dev: torch.zeros((), dtype=torch.float32, device=dev) for dev in buckets}
    checked = None if check is False else kernels.on(inv, default).double()
    kernels.check_for_fused(buckets, checked, found)
    flag = any_over_shards(leaves, _found(found, default))
    measured: list[torch.Tensor] = []
    times: list[torch.Tensor | float] = []
    with torch.no_grad():
        for v in values:
            if v.dtype in _HALF:
                measured.append((v.float() * kernels.on(inv, v.device)).to(v.dtype))
                times.append(1.0)
            else:
                measured.append(v)
                times.append(inv)
    return flag, _norm(leaves, measured, flag.device, times)


def _unscale(
    leaves: Sequence[Leaf], scale: Any, inv: torch.Tensor | float, check: bool | None
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
            target = coalesced(target)
        targets.append(target)
    buckets = kernels.buckets(values_of(t) for t in targets)
    found = {dev: torch.zeros((), dtype=torch.float32, device=dev) for dev in buckets}
    kernels.unscale_buckets(buckets, inv, found, check)
    summed: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for i, unscaled in enumerate(targets):
        if unscaled.is_sparse and not unscaled.is_coalesced():
            targets[i] = unscaled.coalesce()
            summed[unscaled.device].append(targets[i]._values())
    with torch.no_grad():
        for device, values in summed.items():
            torch.maximum(
                found[device], kernels.non_finite(values, device).float(), out=found[device]
            )
    for leaf, target in zip(leaves, targets, strict=True):
        if target is not leaf.local:
            replaced[id(leaf.tensor)] = target
    flag = any_over_shards(leaves, _found(found, _default_device(scale)))
    return replaced, [values_of(t) for t in targets], flag


def _put(grads: Any, replaced: dict[int, torch.Tensor]) -> Any:
    """``grads`` with each coalesced sparse gradient in its original's place."""
    if not replaced:
        return grads
    return map_pairs(lambda _, a, b: replaced.get(id(b), b), grads, grads, "grads")


def _route(
    leaves: Sequence[Leaf], scale: Any, *, torch_kernels: bool = False
) -> tuple[_Prepared, float] | None:
    """:func:`_host_route` for the leaves (each tensor once, as :func:`leaves_of` gives
    them); never for a sharded one (its norm is summed over ranks between the read and
    the write)."""
    if any(leaf.spread is not None for leaf in leaves):
        return None
    return _host_route([leaf.local for leaf in leaves], scale, torch_kernels=torch_kernels)


def _kept_route(leaves: Leaves, scale: Any) -> tuple[_plans.Plan, float] | None:
    """:func:`_route` from a kept plan (:mod:`._torch_plans`), when the leaves have one
    and the CPU route would take it (numba, the CPU's values read for free, a host
    scale); ``None`` otherwise."""
    planned = leaves.planned
    if planned is None or _numpy.BACKEND.path != "numba" or not kernels.reads_free(_CPU):
        return None
    host = _host_scale(scale)
    return None if host is None else (planned, host)


class _HostPass(NamedTuple):
    """What :meth:`TorchBackend.measure` prepared on the CPU route, for :meth:`clip`."""

    #: The NumPy backend the read ran on (read per call: a test may swap it).
    numpy_backend: Any
    #: A plan for the numba kernels, one for PyTorch's (:mod:`._torch_host`, holding
    #: what the read gathered), or the NumPy backend's own prepared views.
    prepared: Any
    #: The scale as a float, and its inverse.
    host: float
    inv: float


class Leaves:
    """What :meth:`TorchBackend.plan` returns: the tree, its leaves validated (each
    tensor once), and what the measuring pass leaves for :meth:`TorchBackend.clip`.

    ``host`` is set by a read-only :meth:`~TorchBackend.measure` on the CPU route
    (dense CPU tensors, a host scale): the plan its read made, reused by the write.
    ``values`` and ``replaced`` are set by a read-only measure elsewhere (an
    accelerator, sparse or sharded gradients), which unscales in place: the values
    the clip multiplies, and the coalesced tensors that take the place of sparse
    leaves in the returned tree. ``writable`` is ``False`` for leaves that must not
    be written at all: a measure there only reads, and no clip may follow.
    """

    __slots__ = ("grads", "host", "leaves", "planned", "replaced", "values", "writable")

    def __init__(
        self,
        grads: Any,
        leaves: list[Leaf],
        writable: bool = True,
        planned: _plans.Plan | None = None,
    ) -> None:
        self.grads = grads
        self.leaves = leaves
        self.writable = writable
        #: A kept plan of these leaves for the numba kernels (:mod:`._torch_plans`).
        self.planned = planned
        self.host: _HostPass | None = None
        self.values: list[torch.Tensor] | None = None
        self.replaced: dict[int, torch.Tensor] = {}


class TorchBackend(Backend):
    """Unscale and detection for torch tensors; the flag is a 0-d ``torch.bool`` tensor.

    Args:
        unscale_skipped: Whether :meth:`clip` leaves a skipped step's gradients
            unscaled on the CPU route too, as ``torch.amp.GradScaler.unscale_`` leaves
            them and as the accelerator route does anyway (one write, on skipped steps
            only). The drop-in's clip asks for it; the backend protocol's rule (a
            skipped step writes nothing) is the default.
    """

    name = "torch"

    def __init__(self, *, unscale_skipped: bool = False) -> None:
        self.unscale_skipped = unscale_skipped

    @property
    def skipped_unscaled(self) -> TorchBackend:
        """The backend the drop-in's clip uses: PyTorch's ``unscale_`` leaves a skipped
        step's gradients unscaled, and so does this one's :meth:`clip`, on every
        route (this backend itself when it was made with ``unscale_skipped``, else
        :data:`UNSCALED_ON_SKIP`)."""
        return self if self.unscale_skipped else UNSCALED_ON_SKIP

    def clear_cache(self) -> None:
        """Drop the kept plans of lists of many small CPU tensors (:mod:`._torch_plans`)
        and with them the references to those tensors, as the NumPy backend's
        ``clear_cache`` drops its own (the dispatch of a flat container remembers no
        tensor)."""
        _KEPT.clear()

    def plan(self, grads: Any, *, writable: bool) -> Leaves:
        """See :meth:`scaler_core.Backend.plan`: every leaf validated, each tensor once.

        Tensors have no read-only flag: ``writable=False`` is kept as a promise that
        nothing is written, which :meth:`measure` keeps. A DTensor placed as a partial
        sum is refused (:class:`GradientValueError`).
        """
        kept = _KEPT.lookup(grads)
        if kept is not None:
            return Leaves(grads, kept.leaves, writable, kept.plan)
        return Leaves(grads, leaves_of(grads), writable)

    def unscale(self, leaves: Leaves, scale: Any) -> tuple[Any, torch.Tensor]:
        """See :meth:`scaler_core.Backend.unscale`: in place, one kernel per (device, dtype).

        ``scale`` may be a host float or a 0-d float tensor (a CPU one is validated;
        one on an accelerator is not read back, and a bad one fails closed). A sparse
        gradient with duplicate indices comes back coalesced (see the module's notes).
        With ``scale`` ``None``: one read, nothing written (a sparse gradient with
        duplicate indices is read as summed, in a temporary).
        """
        if scale is None:
            buckets = kernels.buckets(elements(leaf) for leaf in leaves.leaves)
            found = {
                dev: kernels.non_finite([t for ts in by_dtype.values() for t in ts], dev).float()
                for dev, by_dtype in buckets.items()
            }
            return leaves.grads, any_over_shards(leaves.leaves, _found(found, _CPU))
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
        even without ``write``, and :meth:`clip` then multiplies them by the
        coefficient alone, so a skipped step's gradients are left unscaled, as
        ``unscale_`` leaves them. For leaves made with ``writable=False`` it writes
        nothing: two reads of the scaled values (:func:`_read`), and no
        :meth:`clip` follows. A sparse gradient's norm is its coalesced sum's; a
        DTensor's is over all its shards.
        """
        inv, check = inverse_scale(scale)  # validates the scale, as unscale() does
        route: tuple[_Prepared, float] | None = _kept_route(leaves, scale)
        if route is None:
            route = _route(leaves.leaves, scale, torch_kernels=not write)
            if route is not None and isinstance(route[0], _plans.Plan):
                _KEPT.store(leaves.grads, leaves.leaves, route[0])
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
                work = numpy_backend.plan(prepared, writable=True)
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

    def clip(self, leaves: Leaves, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        """See :meth:`scaler_core.Backend.clip`, after :meth:`measure` without ``write``.

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
        leaves.host = leaves.values = None  # one clip per measure
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
                numpy_backend.clip_planned(prepared, inv, host_norm, max_norm)
            else:
                numpy_backend.clip(prepared, scale_value, host_norm, max_norm, np.False_)
            return leaves.grads
        if values is None:
            raise LifecycleError(
                "clip() ran without a measure(..., write=False) on these leaves before it; "
                "call plan(), measure(write=False), then clip() once (as "
                "scaler_core.unscale_and_clip does)"
            )
        xp = namespace_on(norm.device)
        coef = clip_coefficient(xp, norm.float(), max_norm)
        coef = torch.where(as_flag(xp, skip).to(coef.device), torch.ones_like(coef), coef)
        with torch.no_grad():
            for device, by_dtype in kernels.buckets(values).items():
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
        leaves = leaves_of(grads)  # each tensor once, at its first path
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


#: The plans of lists of many small CPU tensors, kept between calls.
_KEPT = TensorPlans()


def _default_device(scale: Any) -> torch.device:
    return scale.device if isinstance(scale, torch.Tensor) else torch.device("cpu")


def _found(found: dict[torch.device, torch.Tensor], default: torch.device) -> torch.Tensor:
    """The step flag of per-device found flags, on the first one's device (``default``
    when there is none)."""
    return kernels.any_found(found.values(), next(iter(found), default))


BACKEND = TorchBackend()
#: The drop-in's backend for its clip: a skipped step's gradients are left unscaled on
#: every route, as ``torch.amp.GradScaler.unscale_`` leaves them.
UNSCALED_ON_SKIP = TorchBackend(unscale_skipped=True)
