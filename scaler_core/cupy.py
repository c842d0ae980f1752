"""CuPy integration: a device-resident state and the cross-GPU OR of the found flag.

Importing this module imports no array library; CuPy loads when a function is
called. Typical data-parallel use, one process per GPU::

    from scaler_core.cupy import found_reducer, to_device

    scaler = LossScaler(state=to_device(init()), reduce_found=found_reducer(comm))

The same two names exist in :mod:`scaler_core.jax` (axis names) and
:mod:`scaler_core.mpi` (communicators).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import _ops
from ._backend import get_backend
from ._coerce import describe
from ._errors import InvalidArgumentError
from ._state import ScalerState, convert_fields

__all__ = ["found_reducer", "reduce_found", "to_device"]


def _cupy_backend() -> ModuleType:
    """The CuPy backend's module, once CuPy and a GPU are known to be there."""
    get_backend("cupy")  # a clear BackendUnavailableError without CuPy or a GPU
    from .backends import _cupy  # noqa: PLC0415 - CuPy loads only when asked for

    return _cupy


def to_device(state: ScalerState, device: int | None = None) -> ScalerState:
    """``state`` with every field a 0-d CuPy array (float32 scale, int32 counters).

    Use it once before the training loop: from then on :func:`scaler_core.update`
    with a CuPy flag keeps the state on the GPU with no host synchronisation.
    Nothing is read back: a recorded failure moves with the state and raises at
    the first host-side look (``state.check()``, ``current_scale()``, ``to_dict``).
    The fields are made by fill kernels (and device-to-device copies from another
    GPU), never copied from the host, as the backend's device transition makes them.

    Args:
        state: A host or device state.
        device: The GPU to place it on; the current device when omitted.

    Raises:
        BackendUnavailableError: CuPy or a GPU is missing.
        InvalidArgumentError: ``state`` is not a :class:`~scaler_core.ScalerState`.
    """
    lib = _cupy_backend()
    cupy = lib.cupy

    def here(value: Any) -> Any:
        """A CuPy array moved to the current device if it lives on another."""
        if isinstance(value, cupy.ndarray) and value.device.id != cupy.cuda.runtime.getDevice():
            return cupy.array(value, copy=True)  # allocated on the current device
        return value

    with contextlib.nullcontext() if device is None else cupy.cuda.Device(device):
        return convert_fields(
            state,
            lambda v: lib.NAMESPACE.asarray(here(v), dtype=cupy.float32),
            lambda v: lib.NAMESPACE.asarray(here(v), dtype=cupy.int32),
        )


def reduce_found(found: Any, comm: Any, *, stream: Any = None) -> Any:
    """The OR of ``found`` across the ranks of an NCCL communicator (a 0-d device bool).

    One 1-byte all-reduce (max) enqueued on the stream, no host read, so every
    rank gets the same flag and takes the same skip decision. Every rank calls it
    once per step, before :func:`scaler_core.update`.

    Args:
        found: This rank's flag (a 0-d CuPy bool array, or a host bool).
        comm: A ``cupy.cuda.nccl.NcclCommunicator`` (anything with its
            ``allReduce(sendbuf, recvbuf, count, datatype, op, stream)``).
        stream: A ``cupy.cuda.Stream``; the current stream when omitted.

    Returns:
        A 0-d CuPy bool array, the same on every rank.

    Raises:
        BackendUnavailableError: CuPy or a GPU is missing.
        InvalidArgumentError: ``comm`` or ``stream`` is not what CuPy's NCCL needs.
        GradientTypeError: ``found`` is not a flag.
    """
    lib = _cupy_backend()
    _check_nccl(lib, comm, stream)
    return _nccl_or(found, lib=lib, comm=comm, stream=stream)


def found_reducer(comm: Any, *, stream: Any = None) -> Callable[[Any], Any]:
    """:func:`reduce_found` over ``comm`` as a hook for ``LossScaler(reduce_found=...)``.

    Raises:
        BackendUnavailableError: CuPy or a GPU is missing.
        InvalidArgumentError: ``comm`` or ``stream`` is not what CuPy's NCCL
            needs (checked now, not at the first step).
    """
    lib = _cupy_backend()
    _check_nccl(lib, comm, stream)
    return functools.partial(_nccl_or, lib=lib, comm=comm, stream=stream)


def _check_nccl(lib: ModuleType, comm: Any, stream: Any) -> None:
    if not callable(getattr(comm, "allReduce", None)):
        raise InvalidArgumentError(
            f"comm={describe(comm)}, but it must be a cupy.cuda.nccl.NcclCommunicator "
            f"(with an allReduce method); create one per rank with "
            f"NcclCommunicator(n_ranks, uid, rank)"
        )
    if stream is not None and not isinstance(stream, lib.cupy.cuda.Stream):
        raise InvalidArgumentError(
            f"stream={describe(stream)}, but it must be a cupy.cuda.Stream or None "
            f"(the current stream)"
        )


def _nccl_or(found: Any, *, lib: ModuleType, comm: Any, stream: Any) -> Any:
    """The all-reduce itself, ``comm`` and ``stream`` checked; ``found`` checked here."""
    cupy = lib.cupy
    buf = _ops.as_flag(lib.NAMESPACE, found).astype(cupy.uint8)
    s = cupy.cuda.get_current_stream() if stream is None else stream
    comm.allReduce(buf.data.ptr, buf.data.ptr, 1, *_nccl_constants(), s.ptr)
    return buf.astype(cupy.bool_)


@functools.cache
def _nccl_constants() -> tuple[int, int]:
    """``(NCCL_UINT8, NCCL_MAX)``; NCCL's own values if its binding loads."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CuPy warns at import when libnccl is missing
        from cupy.cuda import nccl  # noqa: PLC0415 - only multi-GPU users load NCCL
    return int(getattr(nccl, "NCCL_UINT8", 1)), int(getattr(nccl, "NCCL_MAX", 2))
