"""The renamed names: each old one still works, gives what its new one gives, and warns.

docs/reference.md lists them ("Renamed"). Every warning is a DeprecationWarning that
names the new name and points at the caller's line; these tests are the only place the
old names are used.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core._backend import BACKEND_MEMBERS
from scaler_core.backends._numpy_reference import NumpyReferenceBackend
from scaler_core.testing import BACKEND_CHECKS, check_backend

REF = NumpyReferenceBackend()
NUMPY = {"asarray": np.array, "to_numpy": np.asarray}


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(g).tobytes() for g in tree]


def _grads() -> list[np.ndarray]:
    return [
        np.array([3072.0, 4096.0, -1024.0], np.float32),
        np.array([[2048.0, 512.0]], np.float16),
    ]


# ------------------------------------------------------------ the facade
def test_gradscaler_is_the_lossscaler_and_warns_naming_it() -> None:
    with pytest.warns(DeprecationWarning, match=r"scaler_core\.LossScaler") as caught:
        from scaler_core import GradScaler  # the import itself warns
    assert caught[0].filename == __file__
    assert GradScaler is sc.LossScaler
    with pytest.warns(DeprecationWarning, match=r"scaler_core\.GradScaler to scaler_core\.Loss"):
        assert sc.GradScaler is sc.LossScaler  # type: ignore[attr-defined]
    assert "GradScaler" not in sc.__all__
    with pytest.raises(AttributeError, match="no attribute 'GradScalr'"):
        sc.GradScalr  # type: ignore[attr-defined]  # noqa: B018


def test_the_old_facade_name_trains_as_the_new_one() -> None:
    with pytest.warns(DeprecationWarning, match="LossScaler"):
        old = sc.GradScaler(sc.ScalerConfig(growth_interval=2))  # type: ignore[attr-defined]
    new = sc.LossScaler(sc.ScalerConfig(growth_interval=2))
    for scaler in (old, new):
        for value in (1.0, np.inf, 1.0, 1.0):
            scaler.unscale([np.full(3, value, np.float32)])
            scaler.update()
    assert old.state == new.state
    assert repr(old) == repr(new)


def test_the_facades_scale_property_warns_and_reads_current_scale() -> None:
    scaler = sc.LossScaler(sc.ScalerConfig(init_scale=1024.0))
    with pytest.warns(DeprecationWarning, match=r"LossScaler\.current_scale\(\)") as caught:
        scale = scaler.scale
    assert caught[0].filename == __file__
    assert scale == scaler.current_scale() == 1024.0


# ----------------------------------------------------- the backend members
def test_the_protocol_has_the_new_members_only() -> None:
    assert {"clip", "plan"} <= set(BACKEND_MEMBERS)
    assert not {"leaves", "rescale"} & set(BACKEND_MEMBERS)
    assert sc._backend.missing_members(object())[:2] == ["any", "clip"]


def test_the_old_members_call_the_new_ones_on_a_built_in_backend() -> None:
    backend = sc.get_backend("numpy")
    old, new = _grads(), _grads()
    with pytest.warns(DeprecationWarning, match=r"Backend\.leaves to Backend\.plan") as caught:
        plan = backend.leaves(old, writable=True)  # type: ignore[attr-defined]
    assert caught[0].filename == __file__
    _, found, norm = backend.measure(plan, 1024.0, write=False)
    with pytest.warns(DeprecationWarning, match=r"Backend\.rescale to Backend\.clip"):
        backend.rescale(plan, 1024.0, norm, 1.0, found)  # type: ignore[attr-defined]
    sc.unscale_and_clip(new, 1024.0, 1.0, backend="numpy")
    assert _bits(old) == _bits(new)


def _old_style() -> type:
    """A Backend subclass written against the old member names (a new class per call,
    since a class warns once)."""

    class OldStyle(sc.Backend):
        name = "old-style"

        def leaves(self, grads: Any, *, writable: bool) -> Any:
            return REF.plan(grads, writable=writable)

        def unscale(self, leaves: Any, scale: Any) -> Any:
            return REF.unscale(leaves, scale)

        def measure(self, leaves: Any, scale: Any, *, write: bool) -> Any:
            return REF.measure(leaves, scale, write=write)

        def rescale(self, leaves: Any, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
            return REF.clip(leaves, scale, norm, max_norm, skip)

        def scale_loss(self, loss: Any, scale: Any) -> Any:
            return REF.scale_loss(loss, scale)

        def namespace(self, *values: Any) -> Any:
            return REF.namespace(*values)

        def non_finite_counts(self, grads: Any) -> Any:
            return REF.non_finite_counts(grads)

    return OldStyle


def test_an_old_style_subclass_warns_once_and_keeps_the_contract() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old_style = _old_style()
        backend = old_style()
        assert check_backend(backend, **NUMPY) == list(BACKEND_CHECKS)  # type: ignore[arg-type]
        old, new = _grads(), _grads()
        sc.unscale_and_clip(old, 1024.0, 1.0, backend=backend)
    assert [str(w.message) for w in caught] == [
        "scaler-core renamed the Backend members leaves and rescale to plan and clip; "
        "_old_style.<locals>.OldStyle defines the old names, which still work, deprecated, "
        "until the next release removes them"
    ]
    assert caught[0].category is DeprecationWarning
    assert caught[0].filename == __file__
    sc.unscale_and_clip(new, 1024.0, 1.0, backend="numpy")
    assert _bits(old) == _bits(new)


def test_an_old_style_subclass_registers_and_serves_its_arrays(request: Any) -> None:
    from scaler_core import _registry

    request.addfinalizer(lambda: _registry._REGISTRY.pop("old-style", None))
    request.addfinalizer(lambda: _registry.LOADED.pop("old-style", None))
    with pytest.warns(DeprecationWarning, match="leaves and rescale to plan and clip"):
        old_style = _old_style()
    sc.register_backend("old-style", old_style)
    assert check_backend("old-style", **NUMPY) == list(BACKEND_CHECKS)
    old, new = _grads(), _grads()
    _, found = sc.unscale(old, 2.0, backend="old-style")
    assert not found
    sc.unscale(new, 2.0, backend="numpy")
    assert _bits(old) == _bits(new)


def test_overriding_an_old_name_of_a_built_in_backend_overrides_its_new_one() -> None:
    calls: list[float] = []
    with pytest.warns(DeprecationWarning, match=r"members rescale to clip; .*Counting"):

        class Counting(NumpyReferenceBackend):
            def rescale(
                self, leaves: Any, scale: Any, norm: Any, max_norm: float, skip: Any
            ) -> Any:
                calls.append(max_norm)
                return super().rescale(leaves, scale, norm, max_norm, skip)  # type: ignore[misc]

    old, new = _grads(), _grads()
    with pytest.warns(DeprecationWarning, match=r"Backend\.rescale to Backend\.clip"):
        sc.unscale_and_clip(old, 1024.0, 1.0, backend=Counting())
    assert calls == [1.0]  # the core's clip is the override, and super() reached the parent
    sc.unscale_and_clip(new, 1024.0, 1.0, backend=REF)
    assert _bits(old) == _bits(new)


def _old_duck() -> type:
    """A backend that does not derive from Backend, written against the old names."""

    def delegate(name: str) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(REF, name)(*args, **kwargs)

        return method

    members = {m: delegate(m) for m in BACKEND_MEMBERS if m not in ("name", "plan", "clip")}
    members |= {"leaves": delegate("plan"), "rescale": delegate("clip"), "name": "old-duck"}
    members["non_finite_counts"] = delegate("non_finite_counts")
    return type("OldDuck", (), members)


def test_an_old_style_backend_that_is_no_subclass_is_accepted_once_warned(request: Any) -> None:
    from scaler_core import _registry

    request.addfinalizer(lambda: _registry._REGISTRY.pop("old-duck", None))
    request.addfinalizer(lambda: _registry.LOADED.pop("old-duck", None))
    old_duck = _old_duck()
    sc.register_backend("old-duck", old_duck)
    with pytest.warns(DeprecationWarning, match="OldDuck defines the old names") as caught:
        assert check_backend("old-duck", **NUMPY) == list(BACKEND_CHECKS)
    assert len(caught) == 1
    assert sc.get_backend(old_duck()) is not None  # the class has the new names: no warning
    old, new = _grads(), _grads()
    sc.unscale_and_clip(old, 1024.0, 1.0, backend=old_duck())
    sc.unscale_and_clip(new, 1024.0, 1.0, backend=REF)
    assert _bits(old) == _bits(new)


def test_a_backend_missing_members_under_any_name_is_still_refused() -> None:
    """An object with some members, old names among them, is refused as before, naming
    the members it lacks, and warns of nothing."""
    members = {"name": "half", "leaves": REF.plan, "unscale": REF.unscale}
    half = type("Half", (), members)
    with pytest.raises(sc.InvalidArgumentError, match=r"lacks \['any', 'clip', 'measure'"):
        sc.get_backend(half())  # type: ignore[arg-type]


# ------------------------------------------------------------------- optax
def test_the_old_optax_names_warn_and_give_the_new_ones_results() -> None:
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    import scaler_core.optax as sco

    with pytest.warns(DeprecationWarning, match=r"optax\.with_loss_scaling") as caught:
        from scaler_core.optax import loss_scaled
    assert caught[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"optax\.loss_scale to scaler_core\.optax\.cur"):
        loss_scale = sco.loss_scale  # type: ignore[attr-defined]
    assert (loss_scaled, loss_scale) == (sco.with_loss_scaling, sco.current_scale)
    params = {"w": jnp.ones(2)}
    tx = sco.with_loss_scaling(optax.sgd(0.1))
    _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, tx.init(params), params)
    with pytest.warns(DeprecationWarning, match=r"LossScaledState\.skipped") as caught:
        found = state.found
    assert caught[0].filename == __file__
    assert found is state.skipped
    assert bool(found)
    assert float(sco.scale_loss(jnp.float32(2.0), state)) == 2.0 * float(loss_scale(state))
