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
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core._backend import BACKEND_MEMBERS
from scaler_core.backends._numpy_reference import HostNamespace
from scaler_core.testing import BACKEND_CHECKS, NAMESPACE_DUTIES, check_backend


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


def _array_api_strict() -> Any:
    """The array_api backend bound to array-api-strict, the standard's strict reference."""
    xp = pytest.importorskip("array_api_strict", reason="array_api is checked on array-api-strict")
    from scaler_core.backends._array_api import ArrayApiBackend

    return ArrayApiBackend(xp)


BACKENDS: dict[str, Callable[[], Any]] = {
    "numpy-numba": _numba,
    "numpy-pure": _numpy_pure,
    "numpy-reference": _reference,
    "jax": _registered("jax"),
    "cupy": _registered("cupy"),
    "torch": _registered("torch"),
    "array_api-strict": _array_api_strict,
    "mlx": _registered("mlx"),
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
    """The reference backend with one method replaced: a broken third-party backend.

    Every protocol method is defined on the class (made below from the protocol's
    member list), never served by ``__getattr__``: from Python 3.12 on, neither
    ``isinstance(x, Backend)`` nor scaler-core would see it there.
    """

    name = "broken"

    def __init__(self, **replaced: Callable[..., Any]) -> None:
        self._inner = _reference()
        self._replaced = replaced

    def _method(self, attr: str) -> Any:
        return self._replaced.get(attr, getattr(self._inner, attr))


def _delegate(attr: str) -> Callable[..., Any]:
    def method(self: _Delegating, *args: Any, **kwargs: Any) -> Any:
        return self._method(attr)(*args, **kwargs)

    method.__name__ = attr
    return method


for _attr in (*(m for m in BACKEND_MEMBERS if m != "name"), "non_finite_counts"):
    setattr(_Delegating, _attr, _delegate(_attr))


def _unscale_in_float16(leaves: Any, scale: Any) -> Any:
    """A classic slip: multiply a float16 gradient in float16 (double rounding)."""
    if scale is None:
        return _reference().unscale(leaves, None)
    for g in leaves.work:
        if g.dtype == np.float16:
            np.multiply(g, np.float16(1.0 / scale), out=g)
    return _reference().unscale(leaves, 1.0)


def _unscale_with_a_soft_float16_cast(leaves: Any, scale: Any) -> Any:
    """A float16 cast that is not IEEE's (Paddle's software cast on a CPU without F16C):
    float32 products with 2**-89 <= |u| < 2**-77 become the smallest subnormal, not +-0."""
    soft = []
    if scale is not None:
        inv = np.float32(1.0) / np.float32(scale)
        for g in leaves.work:
            if g.dtype == np.float16:
                u = np.abs(g.astype(np.float32) * inv)
                soft.append((g, (u >= 2.0**-89) & (u < 2.0**-77)))
    out, found = _reference().unscale(leaves, scale)
    for g, where in soft:
        g[where] = np.float16(2.0**-24)
    return out, found


def _check_the_input(leaves: Any, scale: Any) -> Any:
    """PyTorch's check: the flag of the *scaled* input, which misses an unscale overflow."""
    _, found = _reference().unscale(leaves, None)
    if scale is None:
        return leaves.grads, found
    out, _ = _reference().unscale(leaves, scale)
    return out, found


def _loss_in_float64(loss: Any, scale: Any) -> Any:
    """A scaled loss in float64: a mixed-precision loop would backpropagate in float64."""
    return _reference().scale_loss(loss, scale).astype(np.float64)


def _counts_every_path(grads: Any) -> Any:
    """Counts at every path: an array that appears twice is reported twice."""
    from scaler_core._tree import leaves_with_paths

    return [
        (p, int(np.isnan(a).sum()), int(np.isinf(a).sum())) for p, a in leaves_with_paths(grads)
    ]


def _counts_nan_only(grads: Any) -> Any:
    """Counts NaN, forgets inf."""
    return [(p, nan, 0) for p, nan, _ in _reference().non_finite_counts(grads)]


def _select_unchecked(found: Any, on_skip: Any, on_step: Any) -> Any:
    """scaler-core's NumPy select before the contract suite: no structure check."""
    return on_skip if bool(found) else on_step


@pytest.mark.parametrize(
    ("replaced", "check", "message"),
    [
        ({"unscale": _unscale_in_float16}, "unscale_values", "the rules give"),
        ({"unscale": _check_the_input}, "unscale_values", "flagged False, not True"),
        ({"unscale": _unscale_with_a_soft_float16_cast}, "subnormals", "float16 subnormals"),
        ({"select": _select_unchecked}, "select", "did not raise InvalidArgumentError"),
        ({"to_bool": bool}, "flags", "to_bool(1) did not raise"),
        ({"scale_loss": _loss_in_float64}, "scale_loss", "gave"),
        ({"non_finite_counts": _counts_every_path}, "leaf_report", "grads['tied']"),
        ({"non_finite_counts": _counts_nan_only}, "leaf_report", "nan=2, inf=0"),
    ],
    ids=[
        "float16-arithmetic",
        "checks-the-input",
        "soft-float16-cast",
        "select-unchecked",
        "to_bool-int",
        "loss-f64",
        "report-every-path",
        "report-no-inf",
    ],
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


def _clip_unclamped(leaves: Any, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
    """The clip with no ``min(coef, 1)``: a norm of 5 under max_norm=100 multiplies by 20."""
    from scaler_core.backends._numpy_reference import clip_in_place, unscaled_copy

    if _reference().to_bool(skip):
        return leaves.grads
    inv = float(np.float32(1.0) / np.float32(scale))
    coef = np.float32(1.0) / (np.float32(norm) + np.float32(1e-6)) * np.float32(max_norm)
    unscaled = [unscaled_copy(g, inv) for g in leaves.work]
    for g, u in zip(leaves.work, unscaled, strict=True):
        clip_in_place(g, u, coef)
    return leaves.grads


def _measure_writes_all_but_the_first(leaves: Any, scale: Any, *, write: bool) -> Any:
    """A read-only pass that stores the unscaled values of every leaf after the first
    (a scratch buffer reused on the gradients): one-leaf cases cannot see it."""
    from scaler_core.backends._numpy_reference import unscaled_copy

    out = _reference().measure(leaves, scale, write=write)
    if not write:
        inv = float(np.float32(1.0) / np.float32(scale))
        for g in leaves.work[1:]:
            g[...] = unscaled_copy(g, inv)
    return out


class _DeviceNamespace(HostNamespace):
    """NumPy as a device library's namespace: flags are 0-d boolean arrays and the
    transition runs branch-free (``device_update``), where ``isfinite`` decides growth."""

    on_host = False
    flag = staticmethod(lambda value: np.asarray(value, dtype=bool))


class _MissesInf(_DeviceNamespace):
    """A finiteness test that only looks for NaN: inf counts as finite."""

    isfinite = staticmethod(lambda x: ~np.isnan(x))


class _PairsWithoutPaths(HostNamespace):
    """Written from the old table, which gave no signature: ``fn(a, b)``, no path."""

    @staticmethod
    def map_pairs(fn: Callable[..., Any], on_skip: Any, on_step: Any) -> Any:
        from scaler_core._tree import map_pairs

        return map_pairs(lambda _path, a, b: fn(a, b), on_skip, on_step)


class _AsarrayToList(HostNamespace):
    """Written from the old table, which said nothing of the result: a plain list (a
    Python scalar for a 0-d value), with no ``.shape`` or ``.dtype``."""

    @staticmethod
    def asarray(value: Any, dtype: Any = None) -> Any:
        return np.asarray(value, dtype).tolist()


def _with_namespace(namespace: type) -> Callable[[], Any]:
    """The reference backend with another namespace (a subclass: the flag operations it
    inherits from scaler_core.Backend must see the namespace, which delegation hides)."""
    from scaler_core.backends._numpy_reference import NumpyReferenceBackend

    class Broken(NumpyReferenceBackend):
        name = "broken"

        def namespace(self, *values: Any) -> Any:
            return namespace()

    return Broken


@pytest.mark.parametrize(
    ("make", "check", "member", "promise"),
    [
        (
            lambda: _Delegating(clip=_clip_unclamped),
            "norm_and_clip",
            "clip(",
            "clamped at 1",
        ),
        (
            lambda: _Delegating(measure=_measure_writes_all_but_the_first),
            "norm_and_clip",
            "measure(",
            "must write nothing",
        ),
        (_with_namespace(_MissesInf), "update", "namespace().isfinite(", "must be False for"),
        (_with_namespace(_PairsWithoutPaths), "select", "namespace().map_pairs(", "fn(path, a, b)"),
        (_with_namespace(_AsarrayToList), "select", "namespace().asarray(", ".shape"),
    ],
    ids=[
        "clip-unclamped",
        "measure-writes",
        "isfinite-misses-inf",
        "map_pairs-no-path",
        "asarray-list",
    ],
)
def test_check_backend_names_the_member_and_the_promise_it_broke(
    make: Callable[[], Any], check: str, member: str, promise: str
) -> None:
    """Broken backends a one-leaf, mid-range suite passed: each fails the whole suite and
    the check that meets the fault, with a BackendContractError (never a raw exception)
    naming the member and what it must do."""
    numpy = {"asarray": np.array, "to_numpy": np.asarray}
    for only in (None, [check]):
        with pytest.raises(sc.BackendContractError) as info:
            check_backend(make(), only=only, **numpy)
        assert member in str(info.value), (only, str(info.value))
        assert promise in str(info.value), (only, str(info.value))


def test_an_unexpected_error_from_a_member_becomes_a_contract_error_naming_it() -> None:
    def scale_loss(loss: Any, scale: Any) -> Any:
        raise KeyError("no such device")

    with pytest.raises(sc.BackendContractError, match=r"scale_loss\(.*KeyError") as info:
        check_backend(
            _Delegating(scale_loss=scale_loss),  # type: ignore[arg-type]
            only=["scale_loss"],
            asarray=np.array,
            to_numpy=np.asarray,
        )
    assert isinstance(info.value.__cause__, KeyError)


def test_the_namespace_duties_are_every_member_the_core_reads() -> None:
    """NAMESPACE_DUTIES (what the namespace check holds a namespace to) names exactly the
    ``xp.<member>`` the core's flag operations and transition read, no more, no fewer."""
    core = Path(sc.__file__).parent
    used = set()
    for module in ("_ops.py", "_state.py", "_rule.py"):
        used |= set(re.findall(r"\bxp\.(\w+)", (core / module).read_text(encoding="utf-8")))
    assert used == set(NAMESPACE_DUTIES)


def test_check_backend_needs_conversions_for_a_library_it_does_not_know() -> None:
    broken = _Delegating()
    with pytest.raises(sc.InvalidArgumentError, match="pass asarray="):
        check_backend(broken)  # type: ignore[arg-type]
    assert check_backend(broken, asarray=np.array, to_numpy=np.asarray)  # type: ignore[arg-type]


def test_check_backend_refuses_an_unknown_check() -> None:
    with pytest.raises(sc.InvalidArgumentError, match=r"names \['nope'\]"):
        check_backend("numpy", only=["nope"])


# ------------------------------------- what makes a backend, on every Python
class _Served:
    """Every Backend member served by ``__getattr__``, as a proxy or a lazy module does.

    Python 3.11's ``isinstance(x, Backend)`` followed ``__getattr__``; from 3.12 on
    ``runtime_checkable`` protocols look members up statically and do not. scaler-core's
    own check must not follow either Python: it looks statically on every version.
    """

    name = "served"

    def __getattr__(self, attr: str) -> Any:
        return getattr(_reference(), attr)


def test_members_served_by_getattr_make_no_backend_on_any_python() -> None:
    served = _Served()
    with pytest.raises(sc.InvalidArgumentError, match=r"lacks .*'unscale'.*__getattr__"):
        sc.get_backend(served)  # type: ignore[arg-type]
    with pytest.raises(sc.InvalidArgumentError, match=r"'unscale'.*__getattr__"):
        check_backend(served, only=["protocol"], asarray=np.array, to_numpy=np.asarray)  # type: ignore[arg-type]
    with pytest.raises(sc.InvalidArgumentError, match="__getattr__"):
        sc.unscale([np.ones(2, np.float32)], 2.0, backend=served)  # type: ignore[arg-type]


def test_a_backend_defining_its_members_passes_on_every_python() -> None:
    broken = _Delegating()
    assert sc.get_backend(broken) is broken  # type: ignore[arg-type]
    assert isinstance(broken, sc.Backend)  # Python's own check agrees with ours
    assert check_backend(broken, only=["protocol"], asarray=np.array, to_numpy=np.asarray)  # type: ignore[arg-type]


def test_every_built_in_backend_inherits_the_flag_operations_from_the_core() -> None:
    """select, any, to_bool and update are written once, in scaler_core.Backend: a built-in
    backend that wrote its own would be the drift the kernel protocol exists to prevent."""
    from scaler_core._backend import CORE_MEMBERS, KERNEL_MEMBERS

    assert set(CORE_MEMBERS).isdisjoint(KERNEL_MEMBERS)
    assert {*CORE_MEMBERS, *KERNEL_MEMBERS} == set(BACKEND_MEMBERS)
    classes = {"numpy": "NumpyBackend", "numpy-reference": "NumpyReferenceBackend"}
    classes |= {"jax": "JaxBackend", "torch": "TorchBackend", "cupy": "CupyBackend"}
    classes |= {"array_api": "ArrayApiBackend", "mlx": "MlxBackend"}
    checked = []
    for name, cls in classes.items():
        try:  # where the library is installed
            module = importlib.import_module(f"scaler_core.backends._{name.replace('-', '_')}")
        except ImportError:
            continue
        backend_class = getattr(module, cls)
        checked.append(name)
        for member in CORE_MEMBERS:
            assert getattr(backend_class, member) is getattr(sc.Backend, member), (name, member)
    assert "numpy" in checked


def test_numpy_flags_come_back_as_numpy_bools_whatever_host_flag_went_in() -> None:
    """On the host every flag is read by one rule: a bool, a numpy.bool_ and a 0-d boolean
    array all give a numpy.bool_ (not the array itself), as the reference promises."""
    numpy = sc.get_backend("numpy")
    for flag in (True, np.bool_(True), np.array(True)):
        out = numpy.any(flag)
        assert type(out) is np.bool_, flag
        assert out, flag
    assert type(numpy.any(np.array(False), False)) is np.bool_
