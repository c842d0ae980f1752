"""Contenders: each builds, for one gradient list, a callable that does the work once.

A contender returns ``None`` where it does not apply (a task it lacks, a library
that is not installed). Each callable returns the non-finite flag as a bool,
which the harness checks against the data it built. For unscale tasks the
callable alternates ``inv_scale`` between 2 and 1/2, so the values stay put
(powers of two multiply exactly) however many times it runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

import scaler_core as sc

Work = Callable[[], bool]
#: ``scale`` values whose ``inv_scale`` is 2 and then 1/2.
_SCALES = (0.5, 2.0)


@dataclass(frozen=True)
class Contender:
    """A named way to do a task; ``make(grads, task)`` returns the work or ``None``."""

    name: str
    make: Callable[[list[np.ndarray], str], Work | None]
    note: str


def _scaler_core(grads: list[np.ndarray], task: str) -> Work:
    if task == "detect":
        return lambda: bool(sc.find_non_finite(grads, backend="numpy"))
    scales = itertools.cycle(_SCALES)

    def work() -> bool:
        _, found = sc.unscale(grads, next(scales), backend="numpy")
        return bool(found)

    return work


def _naive(grads: list[np.ndarray], task: str) -> Work:
    if task == "detect":
        return lambda: not all(np.isfinite(g).all() for g in grads)
    factors = itertools.cycle([np.float32(1 / s) for s in _SCALES])

    def work() -> bool:
        factor = next(factors)
        found = False
        for g in grads:
            g *= factor  # noqa: PLW2901 (in place: the naive loop as people write it)
            found = found or not np.isfinite(g).all()
        return found

    return work


def _roofline(grads: list[np.ndarray], task: str) -> Work | None:
    if task != "unscale":
        return None
    factors = itertools.cycle([np.float32(1 / s) for s in _SCALES])

    def work() -> bool:
        factor = next(factors)
        for g in grads:
            np.multiply(g, factor, out=g)
        return False  # the roofline does not detect; the harness skips its check

    return work


def _bound(grads: list[np.ndarray], task: str) -> Work | None:
    """One read and one write of every element on all threads, nothing else.

    The same numba work-item walk as scaler-core's kernel without the
    detection, over an address table built once: the machine's memory (or
    cache) limit for an in-place unscale, which no unscale + detect can beat.
    """
    if task != "unscale":
        return None
    try:
        from benchmarks import _bound_kernel  # noqa: PLC0415 (numba only here)
    except ImportError:
        return None
    table = _bound_kernel.Table(grads)
    factors = itertools.cycle([np.float32(1 / s) for s in _SCALES])

    def work() -> bool:
        table.scale(next(factors))
        return False  # no detection; the harness skips its check

    return work


def _torch(grads: list[np.ndarray], task: str) -> Work | None:
    if task != "unscale":
        return None
    try:
        import torch  # noqa: PLC0415 (optional)
    except ImportError:
        return None
    tensors = [torch.from_numpy(g) for g in grads]  # shares the memory
    found = torch.zeros(1)
    invs = itertools.cycle([torch.full((1,), 1 / s) for s in _SCALES])

    def work() -> bool:
        found.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, next(invs))
        return bool(found.item())

    return work


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in [
        Contender("scaler-core", _scaler_core, "sc.unscale / sc.find_non_finite, backend='numpy'"),
        Contender("naive", _naive, "g *= s; isfinite(g).all() per array"),
        Contender("torch", _torch, "torch._amp_foreach_non_finite_check_and_unscale_"),
        Contender("roofline", _roofline, "np.multiply(g, s, out=g) per array, no detection"),
        Contender("bound", _bound, "in-place multiply on all threads, no detection (numba)"),
    ]
}

#: Contenders whose result is not a detection, so the harness does not check it.
NO_FLAG = {"roofline", "bound"}
