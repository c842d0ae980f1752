"""The one Backend contract suite: every check of ``scaler_core.testing`` on every backend.

Each backend of scaler-core is one id (the NumPy fast path on numba, the same backend
on its pure-NumPy path, the plain reference, JAX, CuPy where a GPU is, torch), each check of
:data:`scaler_core.testing.BACKEND_CHECKS` another; a backend missing here skips with
its reason. What only one library has (NumPy's read-only arrays and plan cache, JAX
under ``jit``, CuPy's kernels) is tested beside its backend, not here.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core.testing import BACKEND_CHECKS, check_backend


def _numba() -> Any:
    if importlib.util.find_spec("numba") is None:
        pytest.skip("the NumPy fast path's kernels need numba (the fast extra)")
    from scaler_core.backends._numpy import NumpyBackend

    return NumpyBackend(use_numba=True)


def _numpy_pure() -> Any:
    from scaler_core.backends._numpy import NumpyBackend

    return NumpyBackend(use_numba=False)


def _reference() -> Any:
    from scaler_core.backends._numpy_reference import NumpyReferenceBackend

    return NumpyReferenceBackend()


def _registered(name: str) -> Callable[[], Any]:
    def load() -> Any:
        try:
            return sc.get_backend(name)
        except sc.BackendUnavailableError as exc:
            pytest.skip(f"the {name} backend is unavailable here: {exc}")

    return load


BACKENDS: dict[str, Callable[[], Any]] = {
    "numpy-numba": _numba,
    "numpy-pure": _numpy_pure,
    "numpy-reference": _reference,
    "jax": _registered("jax"),
    "cupy": _registered("cupy"),
    "torch": _registered("torch"),
}


@pytest.mark.parametrize("check", list(BACKEND_CHECKS))
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_backend_keeps_the_contract(backend: str, check: str) -> None:
    assert check_backend(BACKENDS[backend](), only=[check]) == [check]


def test_the_default_numpy_backend_is_the_numba_one_when_numba_is_there() -> None:
    backend = sc.get_backend("numpy")
    expected = "numba" if importlib.util.find_spec("numba") else "numpy"
    assert backend.path == expected  # type: ignore[attr-defined]


# ------------------------------------------------------ the suite can fail
class _Delegating:
    """The reference backend with one method replaced: a broken third-party backend."""

    name = "broken"

    def __init__(self, **replaced: Callable[..., Any]) -> None:
        self._inner = _reference()
        self._replaced = replaced

    def __getattr__(self, attr: str) -> Any:
        return self._replaced.get(attr, getattr(self._inner, attr))

    # The protocol's methods, so isinstance(..., Backend) holds.
    def unscale(self, grads: Any, scale: Any) -> Any:
        return self.__getattr__("unscale")(grads, scale)

    def find_non_finite(self, grads: Any) -> Any:
        return self.__getattr__("find_non_finite")(grads)

    def scale_loss(self, loss: Any, scale: Any) -> Any:
        return self.__getattr__("scale_loss")(loss, scale)

    def select(self, found: Any, on_skip: Any, on_step: Any) -> Any:
        return self.__getattr__("select")(found, on_skip, on_step)

    def any(self, *flags: Any) -> Any:
        return self.__getattr__("any")(*flags)

    def to_bool(self, found: Any) -> bool:
        return bool(self.__getattr__("to_bool")(found))

    def update(self, state: Any, found: Any) -> Any:
        return self.__getattr__("update")(state, found)


def _unscale_in_float16(grads: Any, scale: Any) -> Any:
    """A classic slip: multiply a float16 gradient in float16 (double rounding)."""
    for g in grads["grads"] if isinstance(grads, dict) else grads:
        if g.dtype == np.float16:
            np.multiply(g, np.float16(1.0 / scale), out=g)
    return _reference().unscale(grads, 1.0)


def _check_the_input(grads: Any, scale: Any) -> Any:
    """PyTorch's check: the flag of the *scaled* input, which misses an unscale overflow."""
    found = _reference().find_non_finite(grads)
    out, _ = _reference().unscale(grads, scale)
    return out, found


def _loss_in_float64(loss: Any, scale: Any) -> Any:
    """A scaled loss in float64: a mixed-precision loop would backpropagate in float64."""
    return _reference().scale_loss(loss, scale).astype(np.float64)


def _select_unchecked(found: Any, on_skip: Any, on_step: Any) -> Any:
    """scaler-core's NumPy select before the contract suite: no structure check."""
    return on_skip if bool(found) else on_step


@pytest.mark.parametrize(
    ("replaced", "check", "message"),
    [
        ({"unscale": _unscale_in_float16}, "unscale_values", "the rules give"),
        ({"unscale": _check_the_input}, "unscale_values", "flagged False, not True"),
        ({"select": _select_unchecked}, "select", "did not raise InvalidArgumentError"),
        ({"to_bool": bool}, "flags", "to_bool(1) did not raise"),
        ({"scale_loss": _loss_in_float64}, "scale_loss", "gave"),
    ],
    ids=["float16-arithmetic", "checks-the-input", "select-unchecked", "to_bool-int", "loss-f64"],
)
def test_check_backend_catches_a_broken_backend(
    replaced: dict[str, Callable[..., Any]], check: str, message: str
) -> None:
    broken: Any = _Delegating(**replaced)
    numpy = {"asarray": np.array, "to_numpy": np.asarray}
    with pytest.raises(sc.BackendContractError, match=rf"'{check}' failed for backend 'broken'"):
        check_backend(broken, **numpy)
    with pytest.raises(sc.BackendContractError, match=re.escape(message)):
        check_backend(broken, only=[check], **numpy)


def test_check_backend_needs_conversions_for_a_library_it_does_not_know() -> None:
    broken = _Delegating()
    with pytest.raises(sc.InvalidArgumentError, match="pass asarray="):
        check_backend(broken)  # type: ignore[arg-type]
    assert check_backend(broken, asarray=np.array, to_numpy=np.asarray)  # type: ignore[arg-type]


def test_check_backend_refuses_an_unknown_check() -> None:
    with pytest.raises(sc.InvalidArgumentError, match=r"names \['nope'\]"):
        check_backend("numpy", only=["nope"])
