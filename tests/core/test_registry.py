"""The registry: which backend serves a value, which library it is, whether it is a host value."""

from __future__ import annotations

import gc
import types
import weakref
from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core import _registry


def _array_type(module: str, *, namespace: bool = True) -> type:
    """A third-party array type defined in ``module`` (with ``__array_namespace__``)."""
    body: dict[str, Any] = {"__module__": module, "shape": (3,), "dtype": "float32"}
    if namespace:
        body["__array_namespace__"] = lambda self, api_version=None: types.SimpleNamespace()
    return type("Array", (), body)


def test_a_library_with_the_array_api_goes_to_the_array_api_backend_as_itself() -> None:
    a = _array_type("fakelib_a.core")()
    owner = _registry.claim(a)
    assert owner == _registry.Claim(_registry.ARRAY_API, "fakelib_a", host=False)
    assert _registry.library_of(a) == "fakelib_a"
    assert not _registry.is_host(a)


def test_two_array_api_libraries_in_one_call_are_refused_naming_both() -> None:
    a, b = _array_type("fakelib_a")(), _array_type("fakelib_b")()
    with pytest.raises(sc.GradientTypeError, match=r"fakelib_b array but .* fakelib_a array"):
        sc.backend_for({"a": a, "b": b})


def test_a_type_without_the_array_api_is_served_by_nobody() -> None:
    x = _array_type("fakelib_c", namespace=False)()
    assert _registry.claim(x) is None
    with pytest.raises(sc.GradientTypeError, match="which no backend handles"):
        sc.backend_for([x])


def test_the_built_in_libraries_keep_their_backends_before_the_array_api() -> None:
    # NumPy 2's arrays carry __array_namespace__ too: NumPy's backend keeps them.
    assert hasattr(np.ndarray, "__array_namespace__")
    assert _registry.claim(np.ones(2)) == _registry.Claim("numpy", "numpy", host=True)
    assert _registry.is_host(np.float32(1.0))
    assert _registry.is_host(1.5)
    assert _registry.library_of(np.ones(2)) == "numpy"


def test_jaxlib_arrays_are_jax_arrays() -> None:
    jnp = pytest.importorskip("jax.numpy")
    x = jnp.ones(2)
    assert type(x).__module__.startswith("jaxlib")
    assert _registry.library_of(x) == "jax"
    assert _registry.backend_name_of(x) == "jax"


def test_a_registered_backend_claims_its_modules_and_names_them(request: Any) -> None:
    request.addfinalizer(lambda: _registry._REGISTRY.pop("fakelib_d", None))
    request.addfinalizer(_registry._CLAIMS.clear)
    x = _array_type("fakelib_d.sub")()
    assert _registry.claim(x) is not None
    assert _registry.claim(x).backend == "array_api"
    sc.register_backend("fakelib_d", lambda: sc.get_backend("numpy"), array_modules=["fakelib_d"])
    assert _registry.claim(x) == _registry.Claim("fakelib_d", "fakelib_d", host=False)


@pytest.mark.parametrize(
    ("modules", "match"),
    [
        (
            "mylib",
            r"array_modules='mylib', but it must be a list of module names; pass \['mylib'\]",
        ),
        (["mylib.core"], "each must be a top-level module name"),
        ([""], "each must be a top-level module name"),
    ],
)
def test_array_modules_must_be_top_level_names(modules: Any, match: str) -> None:
    with pytest.raises(sc.InvalidArgumentError, match=match):
        sc.register_backend("mylib_bad", lambda: sc.get_backend("numpy"), array_modules=modules)
    assert "mylib_bad" not in _registry.registered()


def _counting_claims(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    seen: list[object] = []
    claim = _registry.claim

    def counted(value: object) -> Any:
        seen.append(value)
        return claim(value)

    monkeypatch.setattr(_registry, "claim", counted)
    return seen


@pytest.mark.parametrize("kind", [list, tuple, dict])
def test_a_flat_container_of_the_same_arrays_finds_its_backend_without_a_walk(
    monkeypatch: pytest.MonkeyPatch, kind: type
) -> None:
    arrays = [np.ones(3, np.float32) for _ in range(50)]
    grads = dict(enumerate(arrays)) if kind is dict else kind(arrays)
    assert sc.backend_for(grads).name == "numpy"
    seen = _counting_claims(monkeypatch)
    assert sc.backend_for(grads).name == "numpy"
    assert seen == []  # one comparison of the list with the one remembered


@pytest.mark.parametrize("change", ["replace", "append", "replace_equal", "dict"])
def test_a_changed_flat_list_is_walked_again(change: str) -> None:
    """Whatever changed in the list (an array of another library in place of one, a
    leaf added, an equal array that is another object), it is dispatched afresh: a
    remembered backend is used only for the very same arrays."""
    torch = pytest.importorskip("torch")
    grads = [np.ones(3, np.float32), np.ones(3, np.float32)]
    assert sc.backend_for(grads).name == "numpy"
    if change == "replace":
        grads[1] = torch.ones(3)
    elif change == "append":
        grads.append("x")
    elif change == "dict":  # a dict of the same arrays, then one of them replaced
        tree = {"a": grads[0], "b": grads[1]}
        assert sc.backend_for(tree).name == "numpy"
        tree["b"] = torch.ones(3)
        with pytest.raises(sc.GradientTypeError, match=r"grads\['b'\] is a torch array"):
            sc.backend_for(tree)
        return
    else:
        grads[1] = np.ones(3, np.float32)  # value-equal: the same backend, found again
        assert sc.backend_for(grads).name == "numpy"
        return
    with pytest.raises(sc.GradientTypeError, match=r"grads\[1\] is|which no backend handles"):
        sc.backend_for(grads)


def test_single_element_arrays_are_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two one-element arrays of equal value compare equal by value: such a list is not
    remembered, since == could not tell another array from the same one."""
    from scaler_core import _backend  # its memory of the last dispatch

    sc.backend_for([np.ones(2, np.float32), np.ones(3, np.float32)])
    assert _backend._LAST_FLAT[0] is not None
    grads = [np.ones(1, np.float32), np.ones(1, np.float32)]
    assert sc.backend_for(grads) is sc.get_backend("numpy")
    assert _backend._LAST_FLAT[0] is None  # forgotten, not replaced by these


def test_a_new_list_of_arrays_is_dispatched_by_its_types_not_leaf_by_leaf(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two lists used in turn (two optimizers' gradients): each call is a new list, found
    from the distinct types of its arrays, one claim per type."""
    first = [np.ones(4, np.float32) for _ in range(100)]
    second = [np.ones(4, np.float64) for _ in range(99)] + [np.ones(4, np.float32)]
    sc.backend_for(first)
    seen = _counting_claims(monkeypatch)
    for _ in range(3):
        assert sc.backend_for(second) is sc.get_backend("numpy")
        assert sc.backend_for(first) is sc.get_backend("numpy")
    assert len(seen) <= 6  # one claim per type and call, not 100


def test_no_jax_tracer_is_compared_across_two_traces() -> None:
    """A flat dict of tracers dispatched inside one jax.jit is not compared by value in
    the next trace: that would pull the first trace's tracers into the second
    (UnexpectedTracerError when it runs)."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    tree = {"a": jnp.ones(4), "b": jnp.full(4, jnp.inf)}
    found = jax.jit(sc.find_non_finite)(tree)
    out = jax.jit(lambda g: sc.unscale(g, 2.0)[0])(tree)
    assert bool(found)
    assert out["a"].tolist() == [0.5] * 4


def test_a_new_registration_forgets_the_remembered_dispatch(request: Any) -> None:
    request.addfinalizer(lambda: _registry._REGISTRY.pop("fakelib_e", None))
    request.addfinalizer(_registry._CLAIMS.clear)
    kind = _array_type("fakelib_e")
    grads = [kind(), kind()]
    assert sc.backend_for(grads).name == "array_api"
    numpy = sc.get_backend("numpy")
    sc.register_backend("fakelib_e", lambda: numpy, array_modules=["fakelib_e"])
    assert sc.backend_for(grads) is numpy


def test_a_device_librarys_arrays_are_not_held_after_their_call() -> None:
    """Remembering a device library's arrays would keep a step's gradients alive on the
    device until the next call: they are dispatched by their types, and let go."""
    torch = pytest.importorskip("torch")
    grads = [torch.ones(4) for _ in range(8)]
    assert sc.backend_for(grads).name == "torch"
    held = weakref.ref(grads[0])
    del grads
    gc.collect()
    assert held() is None


def test_clear_cache_forgets_the_remembered_host_arrays() -> None:
    grads = [np.ones(4, np.float32) for _ in range(8)]
    assert sc.backend_for(grads).name == "numpy"
    held = weakref.ref(grads[0])
    del grads
    gc.collect()
    assert held() is not None  # remembered: the next call with them is one comparison
    sc.get_backend("numpy").clear_cache()
    gc.collect()
    assert held() is None
