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

The backend is its kernels (see :class:`scaler_core.Backend`): :meth:`CupyBackend.plan`
validates; :meth:`~CupyBackend.unscale` is the unscale (or, without a scale, the
detection) launch; :meth:`~CupyBackend.measure` also produces the norm from the same
walk: each block writes its float64 sum of squares to its own slot and one tiny
launch adds the slots in a fixed order, so a norm is deterministic (no
floating-point atomics); :meth:`~CupyBackend.clip` is the clip launch, which reads
the step's decision flag and the norm on the device and writes nothing on a skipped
step. Clipping (measure without writing, the core's ``reduce`` of the flag, clip)
is composed once, in ``scaler_core._ops``.

Nothing here synchronises with the host except :meth:`CupyBackend.to_bool`:
the scale may be a device scalar (read by the kernel itself), the flag is a 0-d
device ``bool`` array, and :meth:`CupyBackend.update` runs the branch-free
transition of :func:`scaler_core.device_update` as device work. After one
warm-up call (which compiles the kernels and uploads the table), a step is
capturable in a CUDA graph. The device state and the NCCL OR of the flag, which
are not kernels, are in :mod:`scaler_core.cupy`.
"""

from __future__ import annotations

import functools
import importlib.resources
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import cupy
import ml_dtypes
import numpy as np

from scaler_core._backend import Backend
from scaler_core._errors import (
    BackendUnavailableError,
    GradientTypeError,
    GradientValueError,
    InvalidArgumentError,
)
from scaler_core._f32 import FLT_MIN, f32
from scaler_core._ops import as_flag
from scaler_core._tree import first_of_each, leaves_with_paths, map_pairs

from ._common import (
    LeafKind,
    bit_counts,
    inv_scale_of,
)

# BACKEND (what the registry reads) is served by __getattr__ below.
__all__ = [
    "CHUNK_BYTES",
    "LEAVES",
    "NAMESPACE",
    "CupyBackend",
    "CupyNamespace",
    "Prepared",
    "kernel_source",
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


# ------------------------------------------------------------------ the GPU
class _Gpu:
    """Every step of the launch code below that needs a GPU, and nothing else: the
    compiled kernels (one module per device, compiled by NVRTC on first use) and
    their launch, the SM count, device memory (allocation, upload, the strided
    copies and their write-back), the device scale's check, the stream's capture
    state and the current device.

    The plans, the chunk tables, the grid sizes, the partial slots and the order of
    the passes are plain Python over these. A test puts the CPU build of the same
    kernel source in this object's place (``tests/backends/cuda_on_cpu/``) and runs
    that launch code, unchanged, on the CPU.
    """

    def __init__(self) -> None:
        self._modules: dict[int, Any] = {}
        self._functions: dict[tuple[int, str], Any] = {}
        self._sms: dict[int, int] = {}
        self._lock = threading.Lock()

    def function(self, device: int, name: str) -> Any:
        """Kernel ``name`` on ``device``: ``fn((grid,), (block,), args)`` launches it."""
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

    @staticmethod
    def upload(host: np.ndarray) -> Any:
        # Asynchronous upload on the current stream (CuPy stages it in pinned memory).
        return cupy.asarray(host)

    @staticmethod
    def zeros(shape: Any, dtype: Any) -> Any:
        return cupy.zeros(shape, dtype=dtype)

    @staticmethod
    def empty(shape: Any, dtype: Any) -> Any:
        return cupy.empty(shape, dtype=dtype)

    @staticmethod
    def contiguous(a: Any) -> Any:
        return cupy.ascontiguousarray(a)

    @staticmethod
    def copy(dst: Any, src: Any) -> None:
        dst[...] = src

    @staticmethod
    def copy_unless(src: Any, skip: Any, dst: Any) -> None:
        _copy_back_kernel()(src, skip, dst)

    @staticmethod
    def checked_scale(scale: Any) -> Any:
        # Reading the value would synchronise with the host. Instead a scale that is not
        # a positive, finite, normal float32 becomes NaN on the device: every gradient
        # is then NaN and flagged, and the update records a collapse (fail closed).
        valid = cupy.isfinite(scale) & (scale >= _FLT_MIN)
        return cupy.where(valid, scale, _NAN32)

    @staticmethod
    def capturing() -> bool:
        return bool(cupy.cuda.get_current_stream().is_capturing())

    @staticmethod
    def current() -> int:
        return int(cupy.cuda.runtime.getDevice())

    @staticmethod
    def use(device: int) -> Any:
        return cupy.cuda.Device(device)


_GPU = _Gpu()


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
        table = _GPU.upload(_chunk_table(entries, dtype.itemsize))
        with _CACHE_LOCK:
            _TABLES[key] = table
            while len(_TABLES) > _TABLE_CACHE_SIZE:
                _TABLES.popitem(last=False)
    n_chunks = table.size // 2
    return _Group(dtype.name, table, n_chunks, min(n_chunks, _GPU.max_grid(device)))


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
    device = leaves[0].device.id if leaves else _GPU.current()
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


class Prepared:
    """What :meth:`CupyBackend.plan` returns: one call's validated leaves and plan.

    The leaves are validated when it is made. The plan (its chunk tables live on
    the GPU) comes from the cache then, or is built by the first pass once that
    pass has checked its scale (:func:`_plan_of`): a refused call does no device
    work and caches nothing. A measuring pass that writes nothing keeps its launch
    groups, its contiguous copies of the strided leaves and its scale here, for the
    clip pass that follows it.
    """

    __slots__ = ("arg", "copies", "grads", "groups", "key", "leaves", "plan", "scale")

    def __init__(self, grads: Any, leaves: list[Any], key: tuple[int, ...]) -> None:
        #: The gradient tree, returned by the passes as it is (CuPy works in place).
        self.grads = grads
        self.leaves, self.key = leaves, key
        self.plan: _Plan | None = _cached(key)
        self.groups: list[_Group] | None = None
        self.copies: list[tuple[Any, Any]] = []
        self.scale: Any = None
        self.arg: tuple[Any, np.float32] | None = None


def _prepare(grads: Any) -> Prepared:
    """The validated leaves of ``grads``, with their plan if one is cached.

    The cache is keyed by the leaves' identities. A plan is dropped as soon as
    one of its arrays dies (see :class:`_Plan`), so a hit means the very same
    array objects are passed again (their pointer, size, dtype and layout cannot
    change) and validation can be skipped; the cache never keeps a gradient
    alive. A hit costs about one ``id()`` per leaf.
    """
    typ = type(grads)
    if typ is list or typ is tuple or typ is dict:
        leaves = list(grads.values()) if typ is dict else list(grads)
        prepared = Prepared(grads, leaves, tuple(map(id, leaves)))
        if prepared.plan is not None:
            return prepared
    leaves, _ = _validated(grads)
    return Prepared(grads, leaves, tuple(map(id, leaves)))


def _plan_of(prepared: Prepared) -> _Plan:
    """The plan of ``prepared``'s leaves: cached, or built (tables uploaded) and cached."""
    plan = prepared.plan
    if plan is None:
        plan = _cached(prepared.key)  # another call may have built it meanwhile
        if plan is None:
            plan = _build_plan(prepared.leaves)
            plan.watch(prepared.leaves)
            with _CACHE_LOCK:
                _PLANS[prepared.key] = plan
                while len(_PLANS) > _PLAN_CACHE_SIZE:
                    _PLANS.popitem(last=False)
        prepared.plan = plan
    return plan


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
        return _GPU.checked_scale(scale), np.float32(1.0)
    return _NULL, np.float32(inv_scale_of(scale))


def _check_device_scale(scale: Any) -> None:
    if scale.shape != () or scale.dtype.kind != "f":
        raise GradientValueError(
            f"scale is a cupy array of shape {scale.shape} and dtype {scale.dtype}, but a "
            f"device scale must be a 0-d float array; pass state.scale of a device state"
        )


def _strided_copies(leaves: list[Any], plan: _Plan) -> list[tuple[Any, Any]]:
    """Contiguous copies of the non-contiguous leaves, as ``(leaf, copy)``, via same-size uints."""
    out = []
    for i in plan.strided:
        leaf = leaves[i]
        bits = leaf.view(_UINT[leaf.dtype.itemsize])
        out.append((leaf, _GPU.contiguous(bits)))
    return out


def _strided_groups(device: int, copies: list[tuple[Any, Any]]) -> list[_Group]:
    by_dtype: dict[np.dtype[Any], list[tuple[int, int]]] = {}
    for leaf, copy in copies:
        by_dtype.setdefault(leaf.dtype, []).append((copy.data.ptr, copy.size))
    return [_group(device, dt, entries) for dt, entries in by_dtype.items()]


def _new_flag() -> Any:
    return _GPU.zeros(1, np.uint32)


def _as_bool(buf: Any) -> Any:
    # Little-endian: the kernels' atomicOr(found, 1) sets byte 0 of the word.
    return buf.view(np.bool_)[0]


def _new_partials(n: int) -> Any:
    return _GPU.empty(n, np.float64)


def _new_norm() -> Any:
    return _GPU.empty((), np.float32)


def _capturing() -> bool:
    return _GPU.capturing()


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
        _GPU.copy(leaf.view(copy.dtype), copy)


@functools.cache
def _copy_back_kernel() -> Any:
    # Same-size uints, so no float arithmetic (nor -ftz) is involved.
    return cupy.ElementwiseKernel(
        "T src, bool skip", "T dst", "if (!skip) dst = src;", "sc_copy_back_unless_skipped"
    )


def _write_back_unless(skip: Any, copies: list[tuple[Any, Any]]) -> None:
    """:func:`_write_back`, except on a skipped step (decided on the device): no write."""
    for leaf, copy in copies:
        _GPU.copy_unless(copy, skip, leaf.view(copy.dtype))


def _launch(plan: _Plan, leaves: list[Any], scale: Any | None) -> Any:
    """Run unscale (``scale`` given) or detect over the plan; the 0-d device flag."""
    found = _new_flag()
    groups, copies = _launch_groups(plan, leaves)
    if scale is None:
        for g in groups:
            fn = _GPU.function(plan.device, "sc_detect_" + g.suffix)
            fn((g.grid,), (_BLOCK,), (g.table, np.int32(g.n_chunks), found))
    else:
        scale_ptr, host_inv = scale
        for g in groups:
            fn = _GPU.function(plan.device, "sc_unscale_" + g.suffix)
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
        fn = _GPU.function(plan.device, kernel + g.suffix)
        slots = partials[start : start + g.grid]
        fn((g.grid,), (_BLOCK,), (g.table, np.int32(g.n_chunks), scale_ptr, host_inv, found, slots))
        start += g.grid
    norm = _new_norm()
    finish = _GPU.function(plan.device, "sc_norm_finish")
    finish((1,), (_BLOCK,), (partials, np.int32(start), norm))
    return _as_bool(found), norm


def _launch_clip(plan: _Plan, groups: list[_Group], scale: Any, clip: tuple[Any, ...]) -> None:
    """The clip pass; ``clip`` is ``(skip, norm, f32 max_norm)``, the first two read on
    the device. On a skipped step every block returns at once: nothing is written."""
    scale_ptr, host_inv = scale
    for g in groups:
        fn = _GPU.function(plan.device, "sc_clip_" + g.suffix)
        fn((g.grid,), (_BLOCK,), (g.table, np.int32(g.n_chunks), scale_ptr, host_inv, *clip))


def _on_device(device: int) -> Any:
    if _GPU.current() == device:
        return _NoContext()
    return _GPU.use(device)


class _NoContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --------------------------------------------------------- device transition
class CupyNamespace:
    """``cupy`` as :meth:`scaler_core.Backend.namespace` describes it: the namespace of
    :func:`device_update`, of the flag operations (and of ``scaler_core.cupy.to_device``),
    on the current device.

    Python scalars are made on the device: ``cupy.asarray(1)`` copies from the host;
    ``cupy.full`` is a fill kernel, which keeps the transition free of transfers and
    capturable in a graph.
    """

    on_host = False
    float64_missing = None
    float32, float64, int32 = cupy.float32, cupy.float64, cupy.int32
    isfinite = staticmethod(cupy.isfinite)
    isdtype = staticmethod(cupy.isdtype)
    maximum = staticmethod(cupy.maximum)
    minimum = staticmethod(cupy.minimum)
    logical_or = staticmethod(cupy.logical_or)
    map_pairs = staticmethod(map_pairs)

    @staticmethod
    def asarray(value: Any, dtype: Any = None) -> Any:
        if isinstance(value, _NDARRAY):
            return value if dtype is None or value.dtype == dtype else value.astype(dtype)
        if isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
            return cupy.full((), value, dtype=dtype)
        if np.ndim(value):  # no silent copy of a host array to the device
            raise InvalidArgumentError(
                f"a {type(value).__module__}.{type(value).__qualname__} of shape "
                f"{np.shape(value)} is where cupy arrays are needed: select() takes cupy "
                f"arrays (or None) at the same places in both trees; move it with "
                f"cupy.asarray() once, outside the step"
            )
        return cupy.asarray(value, dtype=dtype)

    @staticmethod
    def is_array(value: Any) -> bool:
        return isinstance(value, _NDARRAY)

    @staticmethod
    def flag(value: bool) -> Any:
        return cupy.full((), value, dtype=np.bool_)

    @staticmethod
    def read(flag: Any) -> bool:
        return bool(flag.get())

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        """``cupy.where``; between two arrays of one float dtype it selects the bits, so
        NaN payloads and -0.0 survive exactly."""
        dtype = getattr(a, "dtype", None)
        if dtype is not None and dtype == getattr(b, "dtype", None) and dtype.itemsize in _UINT:
            u = _UINT[dtype.itemsize]
            return cupy.where(cond, a.view(u), b.view(u)).view(dtype)
        return cupy.where(cond, a, b)


#: The namespace of the device transition and the flags (and of
#: ``scaler_core.cupy.to_device``).
NAMESPACE = CupyNamespace()


class CupyBackend(Backend):
    """The fused CUDA passes for CuPy arrays. The flag is a 0-d device ``bool`` array."""

    name = "cupy"

    def plan(self, grads: Any, *, writable: bool) -> Prepared:
        """See :meth:`scaler_core.Backend.plan`: validated leaves, and their cached plan.

        Every leaf is checked (a CuPy array of an accepted dtype, all on one GPU)
        before anything is done; a tree of the very same arrays as a cached plan
        skips the checks. CuPy arrays are always writable, so ``writable`` changes
        nothing. Nothing here touches the GPU: a new plan is built by the first
        pass, after its scale is checked.

        Raises:
            GradientTypeError: A leaf is not a CuPy array, or has an integer,
                bool, complex or object dtype.
            GradientValueError: The leaves are on several GPUs.
        """
        return _prepare(grads)

    def unscale(self, leaves: Prepared, scale: Any) -> tuple[Any, Any]:
        """See :meth:`scaler_core.Backend.unscale`: in place, one launch per dtype; with
        ``scale`` ``None``, the read-only detection launch.

        ``scale`` may be a host float (validated here) or a 0-d CuPy float
        array such as a device state's ``scale``. A device scale is read by the
        kernel, never by the host: one that is not a positive, finite, normal
        float32 makes every gradient NaN and sets the flag (fail closed).
        """
        arg = None if scale is None else _scale_arg(scale)
        plan = _plan_of(leaves)
        with _on_device(plan.device):
            return leaves.grads, _launch(plan, leaves.leaves, arg)

    def measure(self, leaves: Prepared, scale: Any, *, write: bool) -> tuple[Any, Any, Any]:
        """See :meth:`scaler_core.Backend.measure`: one launch per dtype, plus the norm's.

        With ``write``, each launch does unscale's reads, writes and detection and
        adds up each block's float64 sum of squares; without it, the same launch
        reads only (flag and sums) and its groups and copies are kept in
        ``leaves`` for :meth:`clip`. One more tiny launch adds the blocks' sums
        in a fixed order (deterministic: no floating-point atomics) and rounds the
        square root to float32. The norm is a 0-d float32 CuPy array; nothing is
        read back.
        """
        arg = _scale_arg(scale)
        plan = _plan_of(leaves)
        with _on_device(plan.device):
            groups, copies = _launch_groups(plan, leaves.leaves)
            found, norm = _launch_norm(
                plan, groups, arg, "sc_unscale_norm_" if write else "sc_norm_"
            )
            if write:
                _write_back(copies)
            else:
                leaves.groups, leaves.copies, leaves.scale, leaves.arg = groups, copies, scale, arg
            return leaves.grads, found, norm

    def clip(self, leaves: Prepared, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        """See :meth:`scaler_core.Backend.clip`: one launch per dtype, no host sync.

        The clip launch reads the decision flag ``skip`` and the norm from device
        memory: on a skipped step every block returns at once, so nothing is
        written (a non-contiguous leaf's copy is not written back either);
        otherwise it stores unscale's value times the clip coefficient. The kernel
        computes the coefficient itself, in float32 on the GPU, from the norm and
        ``f32(max_norm)``: it restates :func:`scaler_core._ops.clip_coefficient` (a
        kernel cannot call Python), and the GPU tests hold the two equal bit for bit.

        ``skip`` must be a 0-d device bool; a host bool (what a user's ``reduce``
        may return) is put on the device by a fill kernel. Anything else is
        refused as ``reduce(found)``, the only place it can come from in the core,
        before the clip launch.

        Raises:
            GradientTypeError: ``skip`` is not a flag.
        """
        kept = leaves.arg is not None and scale is leaves.scale  # measure's, no second check
        arg = leaves.arg if kept else _scale_arg(scale)
        plan = _plan_of(leaves)
        with _on_device(plan.device):
            flag = as_flag(NAMESPACE, skip, "reduce(found)")
            if leaves.groups is None:  # no measuring pass kept them: the same launch groups
                leaves.groups, leaves.copies = _launch_groups(plan, leaves.leaves)
            limit = np.float32(f32(max_norm))
            _launch_clip(plan, leaves.groups, arg, (flag, norm, limit))
            _write_back_unless(flag, leaves.copies)
            return leaves.grads

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

    def namespace(self, *values: Any) -> CupyNamespace:
        """See :meth:`scaler_core.Backend.namespace`: ``cupy``, on the current device."""
        return NAMESPACE

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


# ----------------------------------------------------------- registry entry
_INSTANCE: dict[str, CupyBackend] = {}


def __getattr__(name: str) -> Any:
    # The registry reads BACKEND on first use; checking for a GPU here (not at
    # import) keeps the module importable on a machine without one (the CPU tests
    # compile its kernels and check its refusals there).
    if name == "BACKEND":
        backend = _INSTANCE.get(name)
        if backend is None:
            error = _device_error()
            if error is not None:
                raise error
            backend = _INSTANCE.setdefault(name, CupyBackend())
        return backend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
