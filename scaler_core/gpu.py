"""GPU helpers for the CuPy backend: a device-resident state and a cross-GPU flag.

Importing this module imports no array library; CuPy loads when a function is
called. Typical data-parallel use, one process per GPU::

    from scaler_core.gpu import nccl_reduce_found, state_to_device

    scaler = GradScaler(state=state_to_device(init()),
                        reduce_found=nccl_reduce_found(comm))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._backend import get_backend
from ._state import ScalerState

__all__ = ["nccl_reduce_found", "state_to_device"]


def _cupy_module() -> Any:
    get_backend("cupy")  # a clear BackendUnavailableError without CuPy or a GPU
    from .backends import _cupy  # noqa: PLC0415 - CuPy loads only when asked for

    return _cupy


def state_to_device(state: ScalerState, device: int | None = None) -> ScalerState:
    """``state`` with every field a 0-d CuPy array (float32 scale, int32 counters).

    From then on :func:`scaler_core.update` with a CuPy flag keeps the state on
    the GPU with no host synchronisation; a refused step is recorded in
    ``state.failure`` and raised at the first host-side look.

    Args:
        state: A host or device state.
        device: The GPU to place it on; the current device when omitted.

    Raises:
        BackendUnavailableError: CuPy or a GPU is missing.
        ScaleCollapseError: ``state`` has a recorded failure.
    """
    return _cupy_module().state_to_device(state, device)  # type: ignore[no-any-return]


def nccl_reduce_found(comm: Any, *, stream: Any = None) -> Callable[[Any], Any]:
    """A ``reduce_found`` OR-ing the found flag across the ranks of an NCCL communicator.

    One 1-byte all-reduce (max) per step on the stream, no host read, so every
    rank takes the same skip decision. Use it as ``GradScaler(reduce_found=...)``
    or call it on the flag before :func:`scaler_core.update`.

    Args:
        comm: A ``cupy.cuda.nccl.NcclCommunicator``.
        stream: A ``cupy.cuda.Stream``; the current stream when omitted.

    Raises:
        BackendUnavailableError: CuPy or a GPU is missing.
        InvalidConfigError: ``comm`` or ``stream`` is not what CuPy's NCCL needs.
    """
    return _cupy_module().nccl_reduce_found(comm, stream=stream)  # type: ignore[no-any-return]
