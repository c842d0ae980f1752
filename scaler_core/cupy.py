"""CuPy integration: a device-resident state and the cross-GPU OR of the found flag.

Importing this module imports no array library; CuPy loads when a function is
called. Typical data-parallel use, one process per GPU::

    from scaler_core.cupy import found_reducer, to_device

    scaler = GradScaler(state=to_device(init()), reduce_found=found_reducer(comm))

The same two names exist in :mod:`scaler_core.jax` (axis names) and
:mod:`scaler_core.mpi` (communicators).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from ._backend import get_backend
from ._state import ScalerState

__all__ = ["found_reducer", "reduce_found", "to_device"]


def _cupy_backend() -> ModuleType:
    get_backend("cupy")  # a clear BackendUnavailableError without CuPy or a GPU
    from .backends import _cupy  # noqa: PLC0415 - CuPy loads only when asked for

    return _cupy


def to_device(state: ScalerState, device: int | None = None) -> ScalerState:
    """``state`` with every field a 0-d CuPy array (float32 scale, int32 counters).

    From then on :func:`scaler_core.update` with a CuPy flag keeps the state on
    the GPU with no host synchronisation. Nothing is read back: a recorded
    failure moves with the state and raises at the first host-side look
    (``state.check()``, ``current_scale()``, ``to_dict``).

    Args:
        state: A host or device state.
        device: The GPU to place it on; the current device when omitted.

    Raises:
        BackendUnavailableError: CuPy or a GPU is missing.
        InvalidArgumentError: ``state`` is not a :class:`~scaler_core.ScalerState`.
    """
    return _cupy_backend().to_device(state, device)  # type: ignore[no-any-return]


def reduce_found(found: Any, comm: Any, *, stream: Any = None) -> Any:
    """The OR of ``found`` across the ranks of an NCCL communicator (a 0-d device bool).

    One 1-byte all-reduce (max) on the stream, no host read, so every rank takes
    the same skip decision. Every rank calls it once per step, before
    :func:`scaler_core.update`.

    Args:
        found: This rank's flag.
        comm: A ``cupy.cuda.nccl.NcclCommunicator``.
        stream: A ``cupy.cuda.Stream``; the current stream when omitted.

    Raises:
        BackendUnavailableError: CuPy or a GPU is missing.
        InvalidArgumentError: ``comm`` or ``stream`` is not what CuPy's NCCL needs.
    """
    return _cupy_backend().reduce_found(found, comm, stream=stream)


def found_reducer(comm: Any, *, stream: Any = None) -> Callable[[Any], Any]:
    """:func:`reduce_found` over ``comm`` as a hook for ``GradScaler(reduce_found=...)``.

    Raises:
        BackendUnavailableError: CuPy or a GPU is missing.
        InvalidArgumentError: ``comm`` or ``stream`` is not what CuPy's NCCL
            needs (checked now, not at the first step).
    """
    return _cupy_backend().found_reducer(comm, stream=stream)  # type: ignore[no-any-return]
