"""Arrays of each library from host NumPy arrays and back, for the contract's checks.

:func:`check_backend` makes its inputs with NumPy and reads the results back; these
conversions do it for the built-in backends (bfloat16 too, through same-size integers
where the library and NumPy do not share it). A third-party backend passes its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import InvalidArgumentError
from ._rules import BF16, DTYPES, UINT

__all__ = [
    "cupy_conversions",
    "default_conversions",
    "mlx_conversions",
    "round_trips",
    "torch_conversions",
]


def cupy_conversions() -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    cupy = importlib.import_module("cupy")

    def asarray(a: np.ndarray) -> Any:  # through same-size uints: bfloat16 too
        a = np.array(a, order="C")
        return cupy.asarray(a.view(UINT[a.dtype.itemsize])).view(a.dtype)

    def to_numpy(x: Any) -> np.ndarray:
        return cupy.asnumpy(x.view(UINT[x.dtype.itemsize])).view(x.dtype)  # type: ignore[no-any-return]

    return asarray, to_numpy


def torch_conversions() -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    torch = importlib.import_module("torch")

    def asarray(a: np.ndarray) -> Any:  # bfloat16 through int16: NumPy has no bfloat16 for torch
        a = np.array(a, order="C")
        if a.dtype == BF16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    def to_numpy(t: Any) -> np.ndarray:
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BF16)  # type: ignore[no-any-return]
        return t.numpy()  # type: ignore[no-any-return]

    return asarray, to_numpy


def mlx_conversions() -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    mx = importlib.import_module("mlx.core")

    def asarray(a: np.ndarray) -> Any:  # mx.array alone turns float64 into float32
        a = np.array(a)
        if a.dtype == BF16:
            return mx.array(a.view(np.uint16)).view(mx.bfloat16)
        return mx.array(a, dtype=mx.bool_ if a.dtype == np.bool_ else getattr(mx, a.dtype.name))

    def to_numpy(x: Any) -> np.ndarray:
        if x.dtype == mx.bfloat16:
            return np.array(x.view(mx.uint16)).view(BF16)
        return np.array(x)

    return asarray, to_numpy


def _from_dlpack(x: Any) -> np.ndarray:
    """An Array API array as a NumPy array, through the standard's DLPack interchange
    (NumPy's own scalars, which have none, through ``np.asarray``)."""
    return np.from_dlpack(x) if hasattr(x, "__dlpack__") else np.asarray(x)


def default_conversions(
    backend: Any,
) -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    name = str(getattr(backend, "name", ""))
    if name == "numpy":
        return np.array, np.asarray
    if name == "jax":
        jnp = importlib.import_module("jax.numpy")
        return jnp.asarray, np.asarray
    if name == "cupy":
        return cupy_conversions()
    if name == "torch":
        return torch_conversions()
    if name == "mlx":
        return mlx_conversions()
    if name == "array_api":  # its namespace's own asarray, and back through DLPack
        return backend.namespace().asarray, _from_dlpack
    raise InvalidArgumentError(
        f"backend {name!r} is not one scaler-core knows how to make arrays for; pass "
        f"asarray= (a NumPy array to one of its arrays) and to_numpy= (back)"
    )


def round_trips(
    asarray: Callable[[np.ndarray], Any], to_numpy: Callable[[Any], np.ndarray]
) -> tuple[np.dtype[Any], ...]:
    out = []
    for dtype in DTYPES:
        try:
            back = np.asarray(to_numpy(asarray(np.ones(2, dtype))))
        except Exception:  # the library has no such dtype
            continue
        if back.dtype == dtype:
            out.append(dtype)
    return tuple(out)
