"""Counting NaN and inf leaf by leaf, for :func:`scaler_core.non_finite_leaves`.

One function per library; each validates the leaves with its backend's own
leaf check (so a bad leaf raises exactly what ``unscale`` raises, read-only
arrays excepted), reads every array once and reports the arrays that hold NaN
or inf at their first path. An array that appears twice is read and reported
once, as ``unscale`` unscales it once.

NumPy and CuPy count on the bits: an element is NaN when its bits without the
sign exceed the all-ones exponent, and +-inf when they equal it. That holds for
the four accepted dtypes alike (float16 and bfloat16 through their ``uint16``
view, which needs no float arithmetic on a half type), never raises a
floating-point warning, and reads each element once, in pieces that keep the
temporaries in cache. torch counts with ``torch.isnan``/``torch.isinf`` and JAX
with ``jnp.isnan``/``jnp.isinf``, in their own dtypes.

Device backends (CuPy, torch on an accelerator, JAX) keep every count on the
device and read them back in one transfer (one per device for torch).

Only NumPy is imported here; each other library is imported by its function,
which only its backend calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import ml_dtypes
import numpy as np

from scaler_core._errors import GradientTypeError
from scaler_core._report import LeafReport

from ._numpy_reference import numpy_leaves

__all__ = [
    "cupy_non_finite_leaves",
    "jax_non_finite_leaves",
    "numpy_non_finite_leaves",
    "torch_non_finite_leaves",
]

_UINT = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
#: Per dtype: the bits without the sign, and the all-ones exponent. Above it: NaN; equal: inf.
_BITS: dict[np.dtype[Any], tuple[np.unsignedinteger[Any], np.unsignedinteger[Any]]] = {
    np.dtype(np.float16): (np.uint16(0x7FFF), np.uint16(0x7C00)),
    np.dtype(ml_dtypes.bfloat16): (np.uint16(0x7FFF), np.uint16(0x7F80)),
    np.dtype(np.float32): (np.uint32(0x7FFF_FFFF), np.uint32(0x7F80_0000)),
    np.dtype(np.float64): (np.uint64(0x7FFF_FFFF_FFFF_FFFF), np.uint64(0x7FF0_0000_0000_0000)),
}
#: Elements per piece: 0.5 to 2 MiB of input, so a piece and its temporaries stay in
#: cache (NumPy) and the temporaries stay small next to the gradients (CuPy).
_PIECE = 1 << 18
#: Elements per piece for torch, whose temporaries are bool tensors: few launches.
_TORCH_PIECE = 1 << 24


def _unique(pairs: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Each array once (by identity), at its first path, in order."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for path, leaf in pairs:
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append((path, leaf))
    return out


def _reports(paths: Iterable[str], counts: Iterable[tuple[Any, Any]]) -> tuple[LeafReport, ...]:
    out = []
    for path, (nan, inf) in zip(paths, counts, strict=True):
        if nan or inf:
            out.append(LeafReport(path, int(nan), int(inf)))
    return tuple(out)


def _pieces(a: Any, per: int) -> Iterator[Any]:
    """Views of ``a`` that together hold each element once, of at most ``per`` elements
    where the layout allows: a C-contiguous array is cut flat, others along their first
    axis (a row longer than ``per`` is cut in turn). Works for NumPy and CuPy arrays."""
    if a.ndim == 0 or a.size <= per:
        yield a
    elif a.flags.c_contiguous:
        flat = a.reshape(-1)
        for start in range(0, flat.size, per):
            yield flat[start : start + per]
    else:
        rows = a.shape[0]
        row = a.size // rows
        if row <= per:
            step = per // row
            for start in range(0, rows, step):
                yield a[start : start + step]
        else:
            for i in range(rows):
                yield from _pieces(a[i], per)


def _bit_counts(xp: Any, a: Any) -> tuple[Any, Any]:
    """``(nan, inf)`` of one NumPy or CuPy array (``xp`` its module), from its bits.

    NumPy gives ints; CuPy gives 0-d device arrays (nothing read back).
    """
    magnitude_mask, exponent = _BITS[np.dtype(a.dtype)]
    bits = a.view(_UINT[a.dtype.itemsize])  # same itemsize: a view, whatever the strides
    nan: Any = 0
    inf: Any = 0
    for piece in _pieces(bits, _PIECE):
        magnitude = piece & magnitude_mask
        nan = nan + xp.count_nonzero(magnitude > exponent)
        inf = inf + xp.count_nonzero(magnitude == exponent)
    return nan, inf


def numpy_non_finite_leaves(grads: Any) -> tuple[LeafReport, ...]:
    """The NumPy backends' ``non_finite_leaves`` (see :func:`scaler_core.non_finite_leaves`).

    Raises:
        GradientTypeError: As ``unscale``: a leaf is not a NumPy array of an
            accepted dtype.

    >>> import numpy as np
    >>> numpy_non_finite_leaves({"w": np.array([np.nan, np.inf, -np.inf], np.float32)})
    (LeafReport(path="grads['w']", nan=1, inf=2),)
    """
    leaves = numpy_leaves(grads, writable=False)  # each array once, at its first path
    return _reports((p for p, _ in leaves), [_bit_counts(np, a) for _, a in leaves])


def cupy_non_finite_leaves(grads: Any) -> tuple[LeafReport, ...]:
    """The CuPy backend's ``non_finite_leaves``: counted on the GPU, read back once.

    Raises:
        GradientTypeError: As ``unscale``: a leaf is not a CuPy array of an
            accepted dtype.
        GradientValueError: As ``unscale``: the leaves are on several GPUs.
    """
    import cupy  # noqa: PLC0415 - only the CuPy backend calls this

    from ._cupy import _on_device, _validated  # noqa: PLC0415

    leaves, paths = _validated(grads)
    pairs = _unique(zip(paths, leaves, strict=True))
    if not pairs:
        return ()
    with _on_device(pairs[0][1].device.id):
        counts = [_bit_counts(cupy, a) for _, a in pairs]
        rows = [cupy.stack([cupy.asarray(nan), cupy.asarray(inf)]) for nan, inf in counts]
        stacked = cupy.stack(rows)
        host = cupy.asnumpy(stacked)  # the one transfer
    return _reports((p for p, _ in pairs), [(int(n), int(i)) for n, i in host])


def torch_non_finite_leaves(grads: Any) -> tuple[LeafReport, ...]:
    """The torch backend's ``non_finite_leaves``: counted where each tensor lives, read
    back once per device. Leaves are read as every torch operation reads them: a sparse
    tensor with duplicate indices as summed (in a temporary), a DTensor over all its
    shards (the counts all-reduced over the ranks holding them, so every rank names
    the leaf).

    Raises:
        GradientTypeError: As ``unscale``: a leaf is not a dense or sparse COO
            tensor of an accepted dtype.
        GradientValueError: As ``unscale``: a DTensor placed as a partial sum.
    """
    import torch  # noqa: PLC0415 - only the torch backend calls this

    from ._torch import _leaves, elements, sum_over_shards  # noqa: PLC0415

    leaves = _leaves(grads)  # each tensor once, at its first path
    rows: list[torch.Tensor] = []
    with torch.no_grad():
        for leaf in leaves:
            values = elements(leaf)
            if values.is_contiguous() and values.numel() > _TORCH_PIECE:
                flat = values.reshape(-1)
                pieces = [flat[i : i + _TORCH_PIECE] for i in range(0, flat.numel(), _TORCH_PIECE)]
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
                counts[i] = (nan_count, inf_count)
    return _reports((leaf.path for leaf in leaves), counts)


_JAX_COUNTS: Any = None


def _jax_counts() -> Any:
    """The jitted ``(n, 2)`` counts of a list of leaves (built on first use)."""
    global _JAX_COUNTS  # noqa: PLW0603 - one compiled function, made once JAX is in use
    if _JAX_COUNTS is None:
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415

        def counts(leaves: list[Any]) -> Any:
            return jnp.stack(
                [jnp.stack([jnp.sum(jnp.isnan(g)), jnp.sum(jnp.isinf(g))]) for g in leaves]
            )

        _JAX_COUNTS = jax.jit(counts)
    return _JAX_COUNTS


def jax_non_finite_leaves(grads: Any) -> tuple[LeafReport, ...]:
    """The JAX backend's ``non_finite_leaves``, on any pytree (paths as in the JAX
    backend's messages: ``grads`` + ``jax.tree_util.keystr``).

    The counts of the leaves that live on the same devices are one jitted
    computation; all of them are read back in one ``jax.device_get``.

    Raises:
        GradientTypeError: As ``unscale``: a leaf is not a JAX array of an
            accepted dtype; or a leaf is traced (inside ``jax.jit`` no count can
            be read: call this outside, once ``to_bool(found)`` says the step
            was skipped).
    """
    import jax  # noqa: PLC0415 - only the JAX backend calls this

    from ._jax import jax_leaves  # noqa: PLC0415

    leaves, _, paths = jax_leaves(grads)
    pairs = _unique(zip(paths, leaves, strict=True))
    groups: dict[tuple[tuple[str, int], ...], list[int]] = {}
    for i, (path, leaf) in enumerate(pairs):
        if isinstance(leaf, jax.core.Tracer):
            raise GradientTypeError(
                f"{path} is traced (inside jax.jit, vmap or shard_map), so its NaN and inf "
                f"cannot be counted on the host; call non_finite_leaves outside, for example "
                f"once to_bool(found) says the step was skipped"
            )
        key = tuple(sorted((d.platform, d.id) for d in leaf.devices()))
        groups.setdefault(key, []).append(i)
    count = _jax_counts()
    outputs = [count([pairs[i][1] for i in indices]) for indices in groups.values()]
    counts: list[tuple[int, int]] = [(0, 0)] * len(pairs)
    for indices, host in zip(groups.values(), jax.device_get(outputs), strict=True):
        for i, (nan, inf) in zip(indices, np.asarray(host).tolist(), strict=True):
            counts[i] = (nan, inf)
    return _reports((p for p, _ in pairs), counts)
