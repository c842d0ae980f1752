"""The CuPy backend: one fused kernel launch per dtype over all gradients.

How a call runs: the gradient tree is flattened and validated (types, dtypes,
one device) before anything is touched. Contiguous arrays are cut into chunks
of at most 64 KiB and described by a table of ``(pointer, count)`` pairs; the
table is uploaded once and cached by its contents, so a training loop whose
gradients keep their addresses (the CuPy memory pool makes that the rule) never
copies it again. Then one kernel per dtype present multiplies and checks every
element in a single pass over memory (``backends/_cupy_kernels.cu``). A
non-contiguous array is copied into a contiguous buffer, goes through the same
launch, and is copied back.

The norm (``unscale_norm``, ``unscale_clip``) comes from the same walk: each
block writes its float64 sum of squares to its own slot and one tiny launch adds
the slots in a fixed order, so a norm is deterministic (no floating-point
atomics). Clipping is a read-only first pass (flag and norm), the optional
``reduce`` of the flag, and a second pass that reads the decision flag and the
norm on the device: it writes nothing on a skipped step.

Nothing here synchronises with the host except :meth:`CupyBackend.to_bool`:
the scale may be a device scalar (read by the kernel itself), the flag is a 0-d
device ``bool`` array, and :meth:`CupyBackend.update` runs the branch-free
transition of :func:`scaler_core.device_update` as device work. After one
warm-up call (which compiles the kernels and uploads the table), a step is
capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
import importlib.resources
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import cupy
import ml_dtypes
import numpy as np

from scaler_core._errors import (
    BackendUnavailableError,
    GradientTypeError,
    GradientValueError,
    InvalidArgumentError,
)
from scaler_core._f32 import FLT_MIN, f32
from scaler_core._state import ScalerState, convert_fields, device_update
from scaler_core._tree import first_of_each, leaves_with_paths, map_pairs

from ._common import (
    LeafKind,
    bit_counts,
    check_select_pair,
    flag_error,
    host_flag,
    inv_scale_of,
    max_norm_of,
)

# BACKEND (what the registry reads) is served by __getattr__ below.
__all__ = [
    "CHUNK_BYTES",
    "LEAVES",
    "CupyBackend",
    "found_reducer",
    "kernel_source",
    "reduce_found",
    "to_device",
]

#: Largest piece of one array that one block handles per table entry. Small enough
#: that GPT-2 small gives ~8000 blocks (the last wave's idle tail is ~1% of the
#: run), large enough that reading the table costs nothing.
CHUNK_BYTES = 64 * 1024
_BLOCK = 512  # SC_BLOCK in the kernel source
_BLOCKS_PER_SM = 4  # 2048 resident threads per SM / 512
_BF16 = np.dtype(ml_dtypes.bfloat16)
_UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_NDARRAY = cupy.ndarray
_TABLE_CACHE_SIZE = 64
_PLAN_CACHE_SIZE = 16
_NULL = np.uint64(0)
_FLT_MIN, _NAN32 = np.float32(FLT_MIN), np.float32(np.nan)

#: CuPy gradient leaves.
LEAVES = LeafKind(
    "cupy",
    _NDARRAY,
    "cupy.ndarray",
    "cupy",
    "cupy.asarray(x) (or cupy.from_dlpack(t) for a framework's GPU tensor)",
)


def kernel_source() -> str:
    """The CUDA source of the fused kernels (shipped as package data)."""
    return (
        importlib.resources.files("scaler_core.backends")
        .joinpath("_cupy_kernels.cu")
        .read_text(encoding="utf-8")
    )


def _device_error() -> BackendUnavailableError | None:
    """Why CuPy cannot run here (no driver, no device), or ``None``."""
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError, or a driver library that fails to load
        return BackendUnavailableError(
            f"backend='cupy' needs a CUDA GPU, but CuPy cannot reach one: {exc}. "
            f"Use backend='numpy' on this machine, or run where a GPU and driver are present"
        )
    if count < 1:
        return BackendUnavailableError(
            "backend='cupy' needs a CUDA GPU, but CuPy found 0 devices; use backend='numpy'"
        )
    return None


# ------------------------------------------------------------------ kernels
class _Kernels:
    """The compiled module, one per device (compiled by NVRTC on first use)."""

    def __init__(self) -> None:
        self._modules: dict[int, Any] = {}
        self._functions: dict[tuple[int, str], Any] = {}
        self._sms: dict[int, int] = {}
        self._lock = threading.Lock()

    def function(self, device: int, name: str) -> Any:
        fn = self._functions.get((device, name))
        if fn is None:
            with self._lock:
                module = self._modules.get(device)
                if module is None:
                    # No fast-math: subnormals and IEEE rounding must match NumPy.
                    module = cupy.RawModule(code=kernel_source())
                    self._modules[device] = module
                fn = module.get_function(name)
                self._functions[(device, name)] = fn
        return fn

    def max_grid(self, device: int) -> int:
        sms = self._sms.get(device)
        if sms is None:
            sms = int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
            self._sms[device] = sms
        # Past this many chunks, blocks loop over the table (grid-stride).
        return sms * _BLOCKS_PER_SM * 64


_KERNELS = _Kernels()


# -------------------------------------------------------------------- plans
class _Group:
    """Every contiguous array of one dtype: its chunk table and launch size."""

    __slots__ = ("grid", "n_chunks", "suffix", "table")

    def __init__(self, suffix: str, table: Any, n_chunks: int, grid: int) -> None:
        self.suffix, self.table, self.n_chunks, self.grid = suffix, table, n_chunks, grid


class _Plan:
    """What one gradient tree needs: groups of contiguous arrays, strided leaves.

    ``valid`` drops to false when any of the plan's arrays is garbage collected
    (a weak-reference callback), so while it is true the identities the plan
    was cached under still name the very same, live array objects.
    """

    __slots__ = ("__weakref__", "device", "groups", "refs", "strided", "valid")

    def __init__(self, device: int, groups: list[_Group], strided: list[int]) -> None:
        self.device, self.groups, self.strided = device, groups, strided
        self.valid = True
        self.refs: list[Any] = []

    def watch(self, leaves: list[Any]) -> None:
        invalidate = _invalidator(weakref.ref(self))
        self.refs = [weakref.ref(x, invalidate) for x in leaves]


def _invalidator(plan_ref: Any) -> Callable[[Any], None]:
    def invalidate(_dead: Any) -> None:
        plan = plan_ref()
        if plan is not None:
            plan.valid = False

    return invalidate


_TABLES: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_PLANS: OrderedDict[tuple[int, ...], _Plan] = OrderedDict()
_CACHE_LOCK = threading.Lock()
_PINNED: list[Any] = []  # tables used by captured CUDA graphs


def _chunk_table(entries: list[tuple[int, int]], itemsize: int) -> np.ndarray:
    """``(pointer, count)`` rows, every array cut into chunks of CHUNK_BYTES (counts > 0)."""
    per = CHUNK_BYTES // itemsize
    ptrs = np.array([p for p, _ in entries], dtype=np.uint64)
    sizes = np.array([n for _, n in entries], dtype=np.int64)
    counts = -(-sizes // per)  # chunks per array
    owner = np.repeat(np.arange(len(entries)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    start = (np.arange(int(counts.sum()), dtype=np.int64) - first) * per  # element offsets
    table = np.empty((owner.size, 2), dtype=np.uint64)
    table[:, 0] = ptrs[owner] + (start * itemsize).astype(np.uint64)
    table[:, 1] = np.minimum(per, sizes[owner] - start).astype(np.uint64)
    return table.reshape(-1)


def _group(device: int, dtype: np.dtype[Any], entries: list[tuple[int, int]]) -> _Group:
    """The launch for ``entries`` (pointer, count) of one dtype; tables cached by content."""
    key = (device, dtype.name, *entries)
    with _CACHE_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
    if table is None:
        host = _chunk_table(entries, dtype.itemsize)
        # Asynchronous upload on the current stream (CuPy stages it in pinned memory).
        table = cupy.asarray(host)
        with _CACHE_LOCK:
            _TABLES[key] = table
            while len(_TABLES) > _TABLE_CACHE_SIZE:
                _TABLES.popitem(last=False)
    n_chunks = table.size // 2
    return _Group(dtype.name, table, n_chunks, min(n_chunks, _KERNELS.max_grid(device)))


def _validated(grads: Any) -> tuple[list[Any], list[str]]:
    """Every leaf with its path, validated like the NumPy backend does."""
    leaves: list[Any] = []
    paths: list[str] = []
    device: int | None = None
    first = ""
    for path, leaf in leaves_with_paths(grads):
        LEAVES.check(path, leaf)
        dev = leaf.device.id
        if device is None:
            device, first = dev, path
        elif dev != device:
            raise GradientValueError(
                f"{path} is on GPU {dev} but {first} is on GPU {device}; one call takes the "
                f"gradients of one device: make one call per device and OR the flags"
            )
        leaves.append(leaf)
        paths.append(path)
    return leaves, paths


def _build_plan(leaves: list[Any]) -> _Plan:
    device = leaves[0].device.id if leaves else cupy.cuda.Device().id
    seen: set[int] = set()
    by_dtype: dict[np.dtype[Any], list[tuple[int, int]]] = {}
    strided: list[int] = []
    for i, leaf in enumerate(leaves):
        if id(leaf) in seen:
            continue  # the same array twice is unscaled once
        seen.add(id(leaf))
        if leaf.size == 0:
            continue
        if leaf.flags.c_contiguous:
            by_dtype.setdefault(leaf.dtype, []).append((leaf.data.ptr, leaf.size))
        else:
            strided.append(i)
    with _on_device(device):  # the tables live on the arrays' GPU
        groups = [_group(device, dt, entries) for dt, entries in by_dtype.items()]
    return _Plan(device, groups, strided)


def _cached(key: tuple[int, ...]) -> _Plan | None:
    with _CACHE_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            if plan.valid:
                _PLANS.move_to_end(key)
                return plan
            del _PLANS[key]
    return None


def _plan(grads: Any) -> tuple[_Plan, list[Any]]:
    """The validated plan for ``grads`` and its leaves; cached for repeated trees.

    The cache is keyed by the leaves' identities. A plan is dropped as soon as
    one of its arrays dies (see :class:`_Plan`), so a hit means the very same
    array objects are passed again (their pointer, size, dtype and layout cannot
    change) and validation can be skipped; the cache never keeps a gradient
    alive. A hit costs about one ``id()`` per leaf.
    """
    typ = type(grads)
    if typ is list or typ is tuple or typ is dict:
        leaves = list(grads.values()) if typ is dict else list(grads)
        plan = _cached(tuple(map(id, leaves)))
        if plan is not None:
            return plan, leaves
    leaves, _ = _validated(grads)
    key = tuple(map(id, leaves))
    plan = _cached(key)
    if plan is not None:
        return plan, leaves
    plan = _build_plan(leaves)
    plan.watch(leaves)
    with _CACHE_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    return plan, leaves


# ------------------------------------------------------------------ launches
def _scale_arg(scale: Any) -> tuple[Any, np.float32]:
    """``(device scale or null, host inv_scale)`` for the kernel, validated.

    Raises:
        GradientValueError: ``scale`` is not a real number / positive normal
            float32 (host), or not a 0-d real CuPy array (device).
    """
    if isinstance(scale, _NDARRAY):
        _check_device_scale(scale)
        if scale.dtype != np.float32:
            scale = scale.astype(np.float32)
        # Reading the value would synchronise with the host. Instead a scale that is not
        # a positive, finite, normal float32 becomes NaN on the device: every gradient
        # is then NaN and flagged, and the update records a collapse (fail closed).
        valid = cupy.isfinite(scale) & (scale >= _FLT_MIN)
        return cupy.where(valid, scale, _NAN32), np.float32(1.0)
    return _NULL, np.float32(inv_scale_of(scale))


def _check_device_scale(scale: Any) -> None:
    if scale.shape != () or scale.dtype.kind != "f":
        raise GradientValueError(
            f"scale is a cupy array of shape {scale.shape} and dtype {scale.dtype}, but a "
            f"device scale must be a 0-d float array; pass state.scale of a device state"
        )


def _check_scale(scale: Any) -> None:
    """:func:`_scale_arg`'s refusals alone: host checks, no device work."""
    if isinstance(scale, _NDARRAY):
        _check_device_scale(scale)
    else:
        inv_scale_of(scale)


def _strided_copies(leaves: list[Any], plan: _Plan) -> list[tuple[Any, Any]]:
    """Contiguous copies of the non-contiguous leaves, as ``(leaf, copy)``, via same-size uints."""
    out = []
    for i in plan.strided:
        leaf = leaves[i]
        bits = leaf.view(_UINT[leaf.dtype.itemsize])
        out.append((leaf, cupy.ascontiguousarray(bits)))
    return out


def _strided_groups(device: int, copies: list[tuple[Any, Any]]) -> list[_Group]:
    by_dtype: dict[np.dtype[Any], list[tuple[int, int]]] = {}
    for leaf, copy in copies:
        by_dtype.setdefault(leaf.dtype, []).append((copy.data.ptr, copy.size))
    return [_group(device, dt, entries) for dt, entries in by_dtype.items()]


def _new_flag() -> Any:
    return cupy.zeros(1, dtype=np.uint32)


def _as_bool(buf: Any) -> Any:
    # Little-endian: the kernels' atomicOr(found, 1) sets byte 0 of the word.
    return buf.view(np.bool_)[0]


def _new_partials(n: int) -> Any:
    return cupy.empty(n, dtype=np.float64)


def _new_norm() -> Any:
    return cupy.empty((), dtype=np.float32)


def _capturing() -> bool:
    return bool(cupy.cuda.get_current_stream().is_capturing())


def _launch_groups(plan: _Plan, leaves: list[Any]) -> tuple[list[_Group], list[tuple[Any, Any]]]:
    """The plan's groups plus those of contiguous copies of its strided leaves."""
    copies = _strided_copies(leaves, plan)
    groups = plan.groups + _strided_groups(plan.device, copies) if copies else plan.groups
    if _capturing():
        # A CUDA graph replays these launches with these table addresses: never free them.
        _PINNED.extend(g.table for g in groups)
    return groups, copies


def _write_back(copies: list[tuple[Any, Any]]) -> None:
    for leaf, copy in copies:
        leaf.view(copy.dtype)[...] = copy


@functools.cache
def _copy_back_kernel() -> Any:
    # Same-size uints, so no float arithmetic (nor -ftz) is involved.
    return cupy.ElementwiseKernel(
        "T src, bool skip", "T dst", "if (!skip) dst = src;", "sc_copy_back_unless_skipped"
    )


def _write_back_unless(skip: Any, copies: list[tuple[Any, Any]]) -> None:
    """:func:`_write_back`, except on a skipped step (decided on the device): no write."""
    for leaf, copy in copies:
        _copy_back_kernel()(copy, skip, leaf.view(copy.dtype))


def _launch(plan: _Plan, leaves: list[Any], scale: Any | None) -> Any:
    """Run unscale (``scale`` given) or detect over the plan; the 0-d device flag."""
    found = _new_flag()
    groups, copies = _launch_groups(plan, leaves)
    if scale is None:
        for g in groups:
            fn = _KERNELS.function(plan.device, "sc_detect_" + g.suffix)
            fn((g.grid,), (_BLOCK,), (g.table, np.int32(g.n_chunks), found))
    else:
        scale_ptr, host_inv = scale
        for g in groups:
            fn = _KERNELS.function(plan.device, "sc_unscale_" + g.suffix)
            fn((g.grid,), (_BLOCK,), (g.table, np.int32(g.n_chunks), scale_ptr, host_inv, found))
        _write_back(copies)
    return _as_bool(found)


def _launch_norm(plan: _Plan, groups: list[_Group], scale: Any, kernel: str) -> tuple[Any, Any]:
    """One pass of ``kernel`` (``sc_unscale_norm_``: writes; ``sc_norm_``: reads only)
    over the groups; the 0-d device flag and the 0-d float32 norm.

    Each block writes its float64 sum of squares to its own slot of one buffer
    (the groups' slots one after another), and ``sc_norm_finish`` adds the slots
    up in a fixed order: the same gradients give the same bits on every run.
    """
    scale_ptr, host_inv = scale
    found = _new_flag()
    partials = _new_partials(sum(g.grid for g in groups))
    start = 0
    for g in groups:
        fn = _KERNELS.function(plan.device, kernel + g.suffix)
        slots = partials[start : start + g.grid]
        fn((g.grid,), (_BLOCK,), (g.table, np.int32(g.n_chunks), scale_ptr, host_inv, found, slots))
        start += g.grid
    norm = _new_norm()
    finish = _KERNELS.function(plan.device, "sc_norm_finish")
    finish((1,), (_BLOCK,), (partials, np.int32(start), norm))
    return _as_bool(found), norm


def _launch_clip(plan: _Plan, groups: list[_Group], scale: Any, clip: tuple[Any, ...]) -> None:
    """The clip pass; ``clip`` is ``(skip, norm, f32 max_norm)``, the first two read on
    the device. On a skipped step every block returns at once: nothing is written."""
    scale_ptr, host_inv = scale
    for g in groups:
        fn = _KERNELS.function(plan.device, "sc_clip_" + g.suffix)
        fn((g.grid,), (_BLOCK,), (g.table, np.int32(g.n_chunks), scale_ptr, host_inv, *clip))


def _max_norm_arg(max_norm: Any) -> np.float32:
    """``f32(max_norm)`` for the clip kernel, validated (the shared rule of every backend)."""
    if isinstance(max_norm, _NDARRAY):
        # repr() of a device array would copy it to the host.
        max_norm = _Shown(_describe(max_norm))
    limit: np.float32 = np.float32(f32(max_norm_of(max_norm)))
    return limit


class _Shown:
    """A value that reprs as a given text (a device array named without reading it)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _check_reduce(reduce: Any) -> None:
    if reduce is not None and not callable(reduce):
        raise InvalidArgumentError(
            f"reduce={_describe(reduce)}, but it must be a callable that turns this call's "
            f"flag into the step's decision flag (e.g. a found_reducer(comm)), or None"
        )


def _on_device(device: int) -> Any:
    if cupy.cuda.runtime.getDevice() == device:
        return _NoContext()
    return cupy.cuda.Device(device)


class _NoContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --------------------------------------------------------- device transition
class _DeviceNamespace:
    """``cupy`` for :func:`device_update`, with Python scalars made on the device.

    ``cupy.asarray(1)`` copies from the host; ``cupy.full`` is a fill kernel,
    which keeps the transition free of transfers and capturable in a graph.
    """

    float32 = cupy.float32
    int32 = cupy.int32
    where = staticmethod(cupy.where)
    isfinite = staticmethod(cupy.isfinite)
    maximum = staticmethod(cupy.maximum)

    def __getattr__(self, name: str) -> Any:
        return getattr(cupy, name)

    @staticmethod
    def asarray(value: Any, dtype: Any = None) -> Any:
        if isinstance(value, _NDARRAY):
            return value if dtype is None or value.dtype == dtype else value.astype(dtype)
        if isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
            return cupy.full((), value, dtype=dtype)
        return cupy.asarray(value, dtype=dtype)


_XP = _DeviceNamespace()


def to_device(state: ScalerState, device: int | None = None) -> ScalerState:
    """``state`` with every field a 0-d CuPy array (float32 scale, int32 counters).

    Use it once before the training loop; from then on :func:`scaler_core.update`
    with a device flag keeps the state on the GPU with no host synchronisation.
    Nothing is read back: a recorded failure moves with the state and raises at
    the first host-side look.

    Args:
        state: A host or device state.
        device: The GPU to put it on; the current device when omitted.

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`~scaler_core.ScalerState`.
    """
    with _NoContext() if device is None else cupy.cuda.Device(device):
        return convert_fields(
            state,
            lambda v: _XP.asarray(_on_current(v), dtype=np.float32),
            lambda v: _XP.asarray(_on_current(v), dtype=np.int32),
        )


def _on_current(value: Any) -> Any:
    """A CuPy array moved to the current device if it lives on another (device to device)."""
    if isinstance(value, _NDARRAY) and value.device.id != cupy.cuda.runtime.getDevice():
        return cupy.array(value, copy=True)  # allocated on the current device
    return value


# ---------------------------------------------------------------- the backend
def _device_flag(found: Any, what: str = "found") -> Any:
    if isinstance(found, _NDARRAY):
        if found.shape == () and found.dtype == np.bool_:
            return found
        raise flag_error(what, _describe(found))
    host = host_flag(found, what)
    if host is None:
        raise flag_error(what, _describe(found))
    return cupy.full((), host, dtype=np.bool_)


def _describe(value: Any) -> str:
    # repr() of a device array copies it to the host; name its type, shape and dtype instead.
    if isinstance(value, _NDARRAY):
        return f"<cupy array shape={value.shape} dtype={value.dtype}>"
    return repr(value)


def _where(flag: Any, a: Any, b: Any) -> Any:
    if a.dtype.itemsize in _UINT:
        # Select the bits, so NaN payloads and -0.0 survive exactly (any float dtype).
        u = _UINT[a.dtype.itemsize]
        return cupy.where(flag, a.view(u), b.view(u)).view(a.dtype)
    return cupy.where(flag, a, b)


class CupyBackend:
    """Unscale and detection for CuPy arrays. The flag is a 0-d device ``bool`` array."""

    name = "cupy"

    def unscale(self, grads: Any, scale: Any) -> tuple[Any, Any]:
        """See :meth:`scaler_core.Backend.unscale`: in place, one launch per dtype.

        ``scale`` may be a host float (validated here) or a 0-d CuPy float
        array such as a device state's ``scale``. A device scale is read by the
        kernel, never by the host: one that is not a positive, finite, normal
        float32 makes every gradient NaN and sets the flag (fail closed).
        """
        arg = _scale_arg(scale)
        plan, leaves = _plan(grads)
        with _on_device(plan.device):
            return grads, _launch(plan, leaves, arg)

    def unscale_norm(self, grads: Any, scale: Any) -> tuple[Any, Any, Any]:
        """See :meth:`scaler_core.Backend.unscale_norm`: unscale's one pass, plus the norm.

        One launch per dtype does unscale's reads, writes and detection and adds
        up each block's float64 sum of squares; one more tiny launch adds the
        blocks' sums in a fixed order (deterministic: no floating-point
        atomics) and rounds the square root to float32. The norm is a 0-d
        float32 CuPy array; nothing is read back.
        """
        arg = _scale_arg(scale)
        plan, leaves = _plan(grads)
        with _on_device(plan.device):
            groups, copies = _launch_groups(plan, leaves)
            found, norm = _launch_norm(plan, groups, arg, "sc_unscale_norm_")
            _write_back(copies)
            return grads, found, norm

    def unscale_clip(
        self,
        grads: Any,
        scale: Any,
        max_norm: float,
        reduce: Callable[[Any], Any] | None = None,
    ) -> tuple[Any, Any, Any]:
        """See :meth:`scaler_core.Backend.unscale_clip`: two reads, one write, no host sync.

        The first launch per dtype reads every gradient and writes nothing (the
        flag and the blocks' sums of squares); ``reduce``, if given, then gets
        the flag as a 0-d device bool and must return one (or a host bool).
        The clip launch reads that decision flag and the norm from device
        memory: on a skipped step it returns at once, so nothing is written
        (a non-contiguous leaf's copy is not written back either); otherwise it
        stores unscale's value times PyTorch's clip coefficient, computed on the
        GPU in float32.

        Raises:
            InvalidArgumentError: ``max_norm`` is not a positive, finite real
                number in float32's range, or ``reduce`` is not callable (checked
                after the scale's host-side checks, before any GPU work).
            GradientTypeError: As :meth:`unscale`.
            GradientValueError: As :meth:`unscale`.
        """
        _check_scale(scale)  # the order of the NumPy backend: scale, max_norm, leaves
        limit = _max_norm_arg(max_norm)
        _check_reduce(reduce)
        arg = _scale_arg(scale)
        plan, leaves = _plan(grads)
        with _on_device(plan.device):
            groups, copies = _launch_groups(plan, leaves)
            found, norm = _launch_norm(plan, groups, arg, "sc_norm_")
            if reduce is not None:
                found = _device_flag(reduce(found), "reduce(found)")
            _launch_clip(plan, groups, arg, (found, norm, limit))
            _write_back_unless(found, copies)
            return grads, found, norm

    def find_non_finite(self, grads: Any) -> Any:
        """See :meth:`scaler_core.Backend.find_non_finite`: one read-only pass."""
        plan, leaves = _plan(grads)
        with _on_device(plan.device):
            return _launch(plan, leaves, None)

    def scale_loss(self, loss: Any, scale: Any) -> Any:
        """See :meth:`scaler_core.Backend.scale_loss`: float32 or wider result."""
        if not isinstance(loss, _NDARRAY):
            raise GradientTypeError(
                f"loss is a {type(loss).__qualname__}, but the cupy backend needs a cupy.ndarray "
                f"loss"
            )
        scale_dev, _ = _scale_arg(scale)
        dtype = np.result_type(loss.dtype, np.float32)
        if dtype not in (np.float32, np.float64):
            raise GradientTypeError(
                f"loss has dtype {loss.dtype}, but it must be a float16, bfloat16, float32 or "
                f"float64 array"
            )
        if isinstance(scale_dev, _NDARRAY):
            factor = scale_dev.astype(dtype)
        else:  # the scale is a float32 value, as on a device state
            factor = dtype.type(np.float32(scale))
        if loss.dtype == _BF16:
            # Widen by bits (exact), so no bfloat16 arithmetic kernel is needed.
            bits = cupy.left_shift(loss.view(np.uint16).astype(np.uint32), np.uint32(16))
            wide = bits.view(np.float32).astype(dtype, copy=False)
        else:
            wide = loss.astype(dtype, copy=False)
        return cupy.multiply(wide, factor)

    def select(self, found: Any, on_skip: Any, on_step: Any) -> Any:
        """See :meth:`scaler_core.Backend.select`: ``cupy.where`` leaf by leaf, no sync.

        Raises:
            InvalidArgumentError: The trees differ in structure, a leaf is not
                a CuPy array, or a pair of leaves differs in shape or dtype.
        """
        flag = _device_flag(found)

        def choose(path: str, a: Any, b: Any) -> Any:
            if not (isinstance(a, _NDARRAY) and isinstance(b, _NDARRAY)):
                raise InvalidArgumentError(
                    f"{path} is a {type(b).__qualname__} in on_step and a "
                    f"{type(a).__qualname__} in on_skip; select() needs cupy arrays (or None) "
                    f"at the same places in both trees"
                )
            check_select_pair(path, a, b)
            return _where(flag, a, b)

        return map_pairs(choose, on_skip, on_step)

    def any(self, *flags: Any) -> Any:
        """See :meth:`scaler_core.Backend.any`: a 0-d device bool."""
        if not flags:
            return cupy.zeros((), dtype=np.bool_)
        out = _device_flag(flags[0], "flags[0]")
        for i, f in enumerate(flags[1:], 1):
            out = cupy.logical_or(out, _device_flag(f, f"flags[{i}]"))
        return out

    def to_bool(self, found: Any) -> bool:
        """See :meth:`scaler_core.Backend.to_bool`: the one host synchronisation."""
        if isinstance(found, (bool, np.bool_)):
            return bool(found)
        return bool(_device_flag(found).get())

    def update(self, state: ScalerState, found: Any, grad_norm: Any = None) -> ScalerState:
        """See :meth:`scaler_core.Backend.update`: the transition as device work.

        The result is a device state; a refused step is recorded in
        ``state.failure`` and raised at the first host-side look.
        """
        return device_update(_XP, state, _device_flag(found, "found_non_finite"), grad_norm)

    def non_finite_counts(self, grads: Any) -> list[tuple[str, int, int]]:
        """See :class:`scaler_core.Backend` (``non_finite_counts``): counted on the GPU from
        the bits (:func:`bit_counts`), read back in one transfer.

        Raises:
            GradientTypeError: As ``unscale``: a leaf is not a CuPy array of an
                accepted dtype.
            GradientValueError: As ``unscale``: the leaves are on several GPUs.
        """
        leaves, paths = _validated(grads)
        pairs = first_of_each(zip(paths, leaves, strict=True))
        if not pairs:
            return []
        with _on_device(pairs[0][1].device.id):
            rows = [cupy.stack([cupy.asarray(n) for n in bit_counts(cupy, a)]) for _, a in pairs]
            host = cupy.asnumpy(cupy.stack(rows))  # the one transfer
        return [(path, int(n), int(i)) for (path, _), (n, i) in zip(pairs, host, strict=True)]


# ------------------------------------------------------------- multi-GPU
def reduce_found(found: Any, comm: Any, *, stream: Any = None) -> Any:
    """The OR of ``found`` across the ranks of an NCCL communicator, as a device flag.

    One 1-byte ``allReduce`` (max) enqueued on the stream; nothing is read back
    to the host, so every rank gets the same flag and takes the same skip
    decision. Every rank must call it once per step.

    Args:
        found: This rank's flag (a 0-d CuPy bool array, or a host bool).
        comm: A ``cupy.cuda.nccl.NcclCommunicator`` (anything with its
            ``allReduce(sendbuf, recvbuf, count, datatype, op, stream)``).
        stream: The CuPy stream to enqueue on; the current stream when omitted.

    Returns:
        A 0-d CuPy bool array, the same on every rank.

    Raises:
        InvalidArgumentError: ``comm`` has no ``allReduce``, or ``stream`` is
            not a CuPy stream.
        GradientTypeError: ``found`` is not a flag.
    """
    _check_nccl(comm, stream)
    return _nccl_or(found, comm, stream)


def _check_nccl(comm: Any, stream: Any) -> None:
    if not callable(getattr(comm, "allReduce", None)):
        raise InvalidArgumentError(
            f"comm={_describe(comm)}, but it must be a cupy.cuda.nccl.NcclCommunicator (with an "
            f"allReduce method); create one per rank with NcclCommunicator(n_ranks, uid, rank)"
        )
    if stream is not None and not isinstance(stream, cupy.cuda.Stream):
        raise InvalidArgumentError(
            f"stream={_describe(stream)}, but it must be a cupy.cuda.Stream or None "
            f"(the current stream)"
        )


def _nccl_or(found: Any, comm: Any, stream: Any) -> Any:
    buf = _device_flag(found).astype(np.uint8)
    s = cupy.cuda.get_current_stream() if stream is None else stream
    comm.allReduce(buf.data.ptr, buf.data.ptr, 1, *_nccl_constants(), s.ptr)
    return buf.astype(np.bool_)


def found_reducer(comm: Any, *, stream: Any = None) -> Callable[[Any], Any]:
    """:func:`reduce_found` over ``comm`` as a hook for ``GradScaler(reduce_found=...)``.

    ``comm`` and ``stream`` are checked now, not at the first step.

    Raises:
        InvalidArgumentError: As :func:`reduce_found`.
    """
    _check_nccl(comm, stream)
    return functools.partial(_nccl_or, comm=comm, stream=stream)


@functools.cache
def _nccl_constants() -> tuple[int, int]:
    """``(NCCL_UINT8, NCCL_MAX)``; NCCL's own values if its binding loads."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CuPy warns at import when libnccl is missing
        from cupy.cuda import nccl  # noqa: PLC0415 - only multi-GPU users load NCCL
    return int(getattr(nccl, "NCCL_UINT8", 1)), int(getattr(nccl, "NCCL_MAX", 2))


# ----------------------------------------------------------- registry entry
_INSTANCE: dict[str, CupyBackend] = {}


def __getattr__(name: str) -> Any:
    # The registry reads BACKEND on first use; checking for a GPU here (not at
    # import) keeps the module importable for its helpers on a machine without one.
    if name == "BACKEND":
        backend = _INSTANCE.get(name)
        if backend is None:
            error = _device_error()
            if error is not None:
                raise error
            backend = _INSTANCE.setdefault(name, CupyBackend())
        return backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
