"""PyTorch's fused kernels, as the torch backend and the PyTorch drop-in both run them.

The torch backend (:mod:`._torch`) and ``scaler_core.torch`` unscale, check and
combine flags through these functions, so both give the same bits: this module is
public to the package, and the drop-in imports no private name of a backend.

A bucket of tensors of one (device, dtype) goes through PyTorch's own fused kernel,
``torch._amp_foreach_non_finite_check_and_unscale_`` (one dispatch for the whole
bucket; on CPU it takes all four dtypes and rounds half types as the rules do).
Where that kernel does not serve (bfloat16 on CUDA, devices other than CPU and
CUDA) ``torch._foreach_mul_`` by the same float32 inverse does, with every output
checked: the same product, rounded once, and the same flag (see
:func:`kernel_takes`; a test runs both routes on the CPU and compares bits).

Flags are 0-d tensors on the gradients' device, and nothing here reads one back:
:func:`reads_free` is the one place a caller asks whether it may.

Tests replace :func:`reads_free` and :func:`kernel_takes` on this module; callers
look them up here at call time (``torch_kernels.reads_free(device)``), never bind
them by name.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Literal, overload

import torch

__all__ = [
    "any_found",
    "buckets",
    "check_for_fused",
    "dtensor_type",
    "kernel_takes",
    "non_finite",
    "on",
    "reads_free",
    "unscale_buckets",
]


def reads_free(device: torch.device) -> bool:
    """Whether a value on ``device`` is read without a host synchronisation: the one
    place the two routes are chosen, in the torch backend and in the drop-in.

    The CPU's values are (the host route: scales and flags read, the NumPy kernels,
    a failing step raised); every other device's are not (the device route: nothing
    read back, a failure recorded in the state). A test replaces this function to
    send CPU tensors down the device route, with every host read forbidden.
    """
    return device.type == "cpu"


def dtensor_type() -> type | None:
    """DTensor's class if ``torch.distributed.tensor`` was imported (else no leaf is one)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def on(inv: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    """An inverse scale as a float32 0-d tensor on ``device`` (moved without a sync)."""
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


def buckets(
    tensors: Iterable[torch.Tensor],
) -> dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]:
    """The tensors by device, then by dtype, each once (the same tensor twice is
    unscaled once), in the order they come."""
    out: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
        lambda: defaultdict(list)
    )
    seen: set[int] = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out[t.device][t.dtype].append(t)
    return out


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
            inv_d = on(inv, device)
            flag = found[device]
            for dtype, tensors in by_dtype.items():
                if not kernel_takes(device, dtype):
                    # The same product, rounded once, and every output checked.
                    torch._foreach_mul_(tensors, inv_d)
                    torch.maximum(flag, non_finite(tensors, device).float(), out=flag)
                    continue
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_d)
                if check_outputs is False:
                    continue
                hit = non_finite(tensors, device).float()
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


def non_finite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Whether any element of ``tensors`` is NaN or inf: one read, a 0-d bool on ``device``."""
    tensors = [t for t in tensors if t.numel()]  # an empty tensor has no max norm
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    norms = torch._foreach_norm(tensors, math.inf)  # max |x|: NaN or inf propagate
    # Each norm tested in its own dtype: a float64 norm cast to float32 could overflow.
    return ~torch.stack([torch.isfinite(n) for n in norms]).all()


_CPU = torch.device("cpu")


@overload
def any_found(
    flags: Iterable[torch.Tensor], device: torch.device, *, read: Literal[False] = False
) -> torch.Tensor: ...
@overload
def any_found(
    flags: Iterable[torch.Tensor], device: torch.device, *, read: Literal[True]
) -> bool: ...
def any_found(
    flags: Iterable[torch.Tensor], device: torch.device, *, read: bool = False
) -> torch.Tensor | bool:
    """The one step flag from per-device found flags: whether any is set.

    The one place per-device flags are combined, for the backend and the drop-in
    alike. Each flag is a 0-d tensor, a float 0.0/1.0 (as :func:`unscale_buckets`
    leaves it) or a bool; a dict of them passes its ``.values()``.

    Args:
        flags: The flags.
        device: Where the combined flag lives.
        read: Answer on the host, as a Python bool: flags whose values are read for
            free (:func:`reads_free`) are read one by one, with no kernel; otherwise
            they are combined on ``device`` and read once.

    Returns:
        A 0-d ``torch.bool`` tensor on ``device`` (``False`` when there is no flag),
        with no synchronisation; with ``read``, a bool.

    >>> import torch
    >>> from scaler_core.backends.torch_kernels import any_found
    >>> cpu = torch.device("cpu")
    >>> found = {cpu: torch.tensor(1.0)}
    >>> any_found(found.values(), cpu), any_found(found.values(), cpu, read=True)
    (tensor(True), True)
    >>> any_found([], cpu)
    tensor(False)
    """
    if read:
        flags = list(flags)
        if all(f.is_cpu for f in flags) and reads_free(_CPU):
            return any(f.item() > 0 for f in flags)
        return bool(any_found(flags, device).item())
    total: torch.Tensor | None = None
    for flag in flags:
        hit = (flag > 0).to(device, non_blocking=True)
        total = hit if total is None else total | hit
    if total is None:
        return torch.zeros((), dtype=torch.bool, device=device)
    return total
