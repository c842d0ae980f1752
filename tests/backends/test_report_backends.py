"""Which leaf overflowed, on the torch, JAX and CuPy backends.

The same promise as ``tests/core/test_report.py`` makes for NumPy: the reported paths
are exactly the leaves holding NaN or inf, with the counts ``np.isnan``/``np.isinf``
give on a float64 host copy, in the backend's leaf order, nothing modified, and bad
leaves raise what ``unscale`` raises. Each library's tests skip cleanly without it
(CuPy's without a GPU).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import warnings
from collections import namedtuple
from typing import Any
from unittest import mock

import numpy as np
import pytest
from common_floats import BF16, DTYPES, UINT
from common_report import expected, got, planted, same_errors, trees, walk
from hypothesis import given, settings
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core.backends import _common

SINT = {2: np.int16, 4: np.int32, 8: np.int64}
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_JAX = importlib.util.find_spec("jax") is not None


@st.composite
def hosts(draw: st.DrawFn, dtypes: list[np.dtype[Any]]) -> np.ndarray:
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(st.sampled_from([(), (0,), (1,), (7,), (3, 5), (2, 3, 4), (40,)]))
    seed, n_special = draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 4))
    return planted(dtype, shape, seed, n_special, tiny=False)


# ==================================================================== torch
torch_only = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")


def to_torch(host: np.ndarray) -> Any:
    import torch

    if host.dtype == BF16:  # NumPy has no bfloat16 for torch: through the bits
        return torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(host.copy())


def torch_host(t: Any) -> np.ndarray:
    """A host NumPy copy of a tensor (dense or sparse), bfloat16 included, bits exact."""
    import torch

    dense = t.to_dense() if t.is_sparse else t
    dtype = {
        torch.float16: np.dtype(np.float16),
        torch.bfloat16: BF16,
        torch.float32: np.dtype(np.float32),
        torch.float64: np.dtype(np.float64),
    }[dense.dtype]
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    return dense.view(ints).cpu().numpy().view(dtype).copy()


def torch_bytes(t: Any) -> bytes:
    if t.is_sparse:
        return torch_host(t._values()).tobytes() + t._indices().cpu().numpy().tobytes()
    return torch_host(t).tobytes()


@st.composite
def torch_leaves(draw: st.DrawFn) -> Any:
    host = draw(hosts(DTYPES))
    t = to_torch(host)
    layout = draw(st.sampled_from(["c", "transposed", "strided", "sparse"]))
    if layout == "transposed" and t.ndim >= 2:
        return t.mT.contiguous().mT  # column-major: not contiguous
    if layout == "strided" and t.ndim:
        import torch

        big = torch.zeros((*t.shape[:-1], t.shape[-1] * 2), dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if layout == "sparse" and t.ndim:
        return t.to_sparse()
    return t


@torch_only
@settings(max_examples=60)
@given(tree=trees(torch_leaves()), piece=st.sampled_from([1, 3, 1 << 24]))
def test_torch_reports_exactly_the_non_finite_leaves(tree: Any, piece: int) -> None:
    pairs = walk(tree)
    before = [torch_bytes(t) for _, t in pairs]
    from scaler_core.backends import _torch

    with mock.patch.object(_torch, "_COUNT_PIECE", piece):
        reports = sc.non_finite_leaves(tree)
    assert got(reports) == expected([(p, torch_host(t)) for p, t in pairs])
    assert [torch_bytes(t) for _, t in pairs] == before, "non_finite_leaves modified a tensor"
    if all(t.numel() for _, t in pairs):  # find_non_finite refuses empty tensors (_foreach_norm)
        assert bool(reports) == bool(sc.find_non_finite(tree))


@torch_only
def test_torch_example_and_order() -> None:
    import torch

    Pair = namedtuple("Pair", "w b")
    grads = {
        "layer3": {"w": torch.tensor([float("inf")] * 12 + [1.0], dtype=torch.float16)},
        "blocks": [None, Pair(torch.ones(2), torch.tensor([float("nan"), -float("inf")]))],
        "clean": torch.zeros(3, dtype=torch.bfloat16),
    }
    reports = sc.non_finite_leaves(grads)
    assert [str(r) for r in reports] == [
        "grads['layer3']['w']: 12 inf, 0 nan",
        "grads['blocks'][1].b: 1 inf, 1 nan",
    ]
    assert sc.non_finite_leaves({"w": torch.ones(3), "b": None}) == ()


@torch_only
def test_torch_tied_tensors_and_requires_grad() -> None:
    import torch

    tied = torch.tensor([float("nan"), 1.0], requires_grad=True)
    reports = sc.non_finite_leaves({"a": tied, "b": tied})
    assert got(reports) == [("grads['a']", 1, 0)]


@torch_only
def test_torch_an_uncoalesced_sparse_tensor_counts_its_stored_values() -> None:
    import torch

    t = torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 2]]), torch.tensor([np.inf, 1.0, np.nan]), (4,), check_invariants=True
    )
    assert not t.is_coalesced()
    assert got(sc.non_finite_leaves([t])) == [("grads[0]", 1, 1)]
    assert not t.is_coalesced(), "the report coalesced the caller's tensor"


def beta(make: Any) -> Any:
    """``make()`` without torch's warning that its sparse CSR support is in beta."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return make()


@torch_only
@pytest.mark.parametrize(
    "bad",
    ["int", "bool", "complex", "numpy", "float", "sparse_csr", "nested"],
)
def test_torch_bad_leaves_raise_what_unscale_raises(bad: str) -> None:
    import torch

    leaf = {
        "int": lambda: torch.arange(3),
        "bool": lambda: torch.ones(2, dtype=torch.bool),
        "complex": lambda: torch.ones(2, dtype=torch.complex64),
        "numpy": lambda: np.ones(2, np.float32),
        "float": lambda: 1.5,
        "sparse_csr": lambda: beta(lambda: torch.eye(3).to_sparse_csr()),
        "nested": lambda: [1.0, 2.0],
    }[bad]()
    same_errors({"w": torch.ones(2), "model": {"bad": leaf}}, "torch")


# ====================================================================== JAX
jax_only = pytest.mark.skipif(not HAS_JAX, reason="jax is not installed")


def jax_dtypes() -> list[np.dtype[Any]]:
    import jax

    return DTYPES if jax.config.read("jax_enable_x64") else DTYPES[:3]


@st.composite
def jax_leaves(draw: st.DrawFn) -> Any:
    import jax.numpy as jnp

    host = draw(hosts(jax_dtypes()))
    layout = draw(st.sampled_from(["plain", "transposed"]))
    leaf = jnp.asarray(host)
    return leaf.T if layout == "transposed" else leaf


@jax_only
@settings(max_examples=40)
@given(tree=trees(jax_leaves()))
def test_jax_reports_exactly_the_non_finite_leaves(tree: Any) -> None:
    pairs = walk(tree, sort_keys=True)  # JAX flattens dicts in sorted key order
    before = [np.asarray(x).tobytes() for _, x in pairs]
    reports = sc.non_finite_leaves(tree)
    assert got(reports) == expected([(p, np.asarray(x)) for p, x in pairs])
    assert [np.asarray(x).tobytes() for _, x in pairs] == before
    assert bool(reports) == bool(sc.find_non_finite(tree))


@jax_only
def test_jax_example_paths_and_pytrees() -> None:
    import jax.numpy as jnp

    Pair = namedtuple("Pair", "w b")
    grads = {
        "layer3": {"w": jnp.array([jnp.inf] * 12 + [1.0], jnp.float16)},
        "blocks": [None, Pair(jnp.ones(2), jnp.array([jnp.nan, -jnp.inf], jnp.bfloat16))],
        "clean": jnp.zeros(3),
    }
    reports = sc.non_finite_leaves(grads)
    assert [str(r) for r in reports] == [
        "grads['blocks'][1].b: 1 inf, 1 nan",  # JAX sorts dict keys: 'blocks' < 'layer3'
        "grads['layer3']['w']: 12 inf, 0 nan",
    ]
    assert sc.non_finite_leaves({"w": jnp.ones(3), "b": None}) == ()


@jax_only
def test_jax_reads_the_counts_back_once() -> None:
    import jax
    import jax.numpy as jnp

    grads = [jnp.array([jnp.nan] * (i + 1)) for i in range(5)]
    real = jax.device_get
    calls: list[Any] = []

    def counting(x: Any) -> Any:
        calls.append(x)
        return real(x)

    with mock.patch.object(jax, "device_get", counting):
        reports = sc.non_finite_leaves(grads)
    assert [r.nan for r in reports] == [1, 2, 3, 4, 5]
    assert len(calls) == 1


@jax_only
def test_jax_tied_leaves_are_reported_once_and_dataclass_pytrees_work() -> None:
    import dataclasses

    import jax
    import jax.numpy as jnp

    @dataclasses.dataclass
    class Layer:
        w: Any
        b: Any

    jax.tree_util.register_dataclass(Layer, data_fields=["w", "b"], meta_fields=[])
    tied = jnp.array([jnp.inf])
    reports = sc.non_finite_leaves({"a": Layer(tied, jnp.zeros(1)), "z": tied})
    assert got(reports) == [("grads['a'].w", 0, 1)]


@jax_only
def test_jax_inside_jit_is_refused_clearly() -> None:
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(g: Any) -> Any:
        sc.non_finite_leaves({"w": g})
        return g

    with pytest.raises(sc.GradientTypeError, match=r"grads\['w'\] is traced"):
        step(jnp.ones(2))


@jax_only
@pytest.mark.parametrize("bad", ["int", "bool", "numpy", "float", "nested"])
def test_jax_bad_leaves_raise_what_unscale_raises(bad: str) -> None:
    import jax.numpy as jnp

    leaf = {
        "int": lambda: jnp.arange(3),
        "bool": lambda: jnp.ones(2, bool),
        "numpy": lambda: np.ones(2, np.float32),
        "float": lambda: 1.5,
        "nested": lambda: ["x"],
    }[bad]()
    same_errors({"w": jnp.ones(2), "model": {"bad": leaf}}, "jax")


@jax_only
def test_jax_float64_with_x64_enabled(tmp_path: Any) -> None:
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp
        import scaler_core as sc
        assert jax.config.read("jax_enable_x64")
        g = jnp.array([jnp.nan, jnp.inf, 1e300], jnp.float64)
        assert g.dtype == jnp.float64
        (r,) = sc.non_finite_leaves({"w": g, "b": jnp.ones(2, jnp.float64)})
        assert (r.path, r.nan, r.inf) == ("grads['w']", 1, 1), r
        print("ok")
        """
    )
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@jax_only
def test_jax_leaves_on_several_devices_are_read_back_once(tmp_path: Any) -> None:
    """Four CPU devices in a subprocess: leaves committed to different devices and one
    sharded over all of them are counted where they are, and read back in one call."""
    code = textwrap.dedent(
        """
        from unittest import mock
        import jax, jax.numpy as jnp, numpy as np
        import scaler_core as sc
        devices = jax.devices()
        assert len(devices) == 4, devices
        mesh = jax.sharding.Mesh(np.array(devices), ("d",))
        spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
        host = np.zeros(16, np.float32)
        host[[0, 5, 15]] = [np.nan, np.inf, -np.inf]
        grads = {
            "a": jax.device_put(jnp.array([np.nan, 1.0]), devices[1]),
            "b": jax.device_put(jnp.array([np.inf, np.inf]), devices[0]),
            "c": jax.device_put(jnp.ones(3), devices[2]),
            "d": jax.device_put(jnp.array([-np.inf], jnp.bfloat16), devices[1]),
            "e": jax.device_put(host, spec),
        }
        calls = []
        real = jax.device_get
        with mock.patch.object(jax, "device_get", lambda x: calls.append(x) or real(x)):
            reports = sc.non_finite_leaves(grads)
        got = [(r.path, r.nan, r.inf) for r in reports]
        assert got == [
            ("grads['a']", 1, 0),
            ("grads['b']", 0, 2),
            ("grads['d']", 0, 1),
            ("grads['e']", 1, 2),
        ], got
        assert len(calls) == 1, calls
        print("ok")
        """
    )
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "JAX_PLATFORMS": "cpu",
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ===================================================================== CuPy
def _gpu_count() -> int:
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device
        return 0


gpu_only = pytest.mark.skipif(_gpu_count() == 0, reason="CuPy with a CUDA GPU is not available")


def to_cupy(host: np.ndarray) -> Any:
    import cupy

    host = np.array(host, order="C")
    return cupy.asarray(host.view(UINT[host.dtype.itemsize])).view(host.dtype)


def cupy_host(a: Any) -> np.ndarray:
    import cupy

    return cupy.asnumpy(a.view(UINT[a.dtype.itemsize])).view(a.dtype)


def cupy_leaf(host: np.ndarray, layout: str) -> Any:
    import cupy

    a = to_cupy(host)
    if layout == "strided" and a.ndim:
        big = cupy.zeros((*a.shape[:-1], a.shape[-1] * 2), a.dtype)
        big[..., ::2] = a
        return big[..., ::2]
    if layout == "transposed" and a.ndim >= 2:
        return a.T
    return a


@gpu_only
@settings(max_examples=40)
@given(
    tree=trees(st.tuples(hosts(DTYPES), st.sampled_from(["c", "strided", "transposed"]))),
    piece=st.sampled_from([1, 3, 1 << 18]),
)
def test_cupy_reports_exactly_the_non_finite_leaves(tree: Any, piece: int) -> None:
    def device(node: Any) -> Any:
        if isinstance(node, tuple) and len(node) == 2 and isinstance(node[0], np.ndarray):
            return cupy_leaf(*node)
        if isinstance(node, dict):
            return {k: device(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(device(v) for v in node)
        return node

    grads = device(tree)
    pairs = walk(grads)
    before = [cupy_host(a).tobytes() for _, a in pairs]
    with mock.patch.object(_common, "_PIECE", piece):
        reports = sc.non_finite_leaves(grads)
    assert got(reports) == expected([(p, cupy_host(a)) for p, a in pairs])
    assert [cupy_host(a).tobytes() for _, a in pairs] == before
    assert bool(reports) == bool(sc.get_backend("cupy").to_bool(sc.find_non_finite(grads)))


@gpu_only
def test_cupy_example_and_bad_leaves() -> None:
    import cupy

    grads = {"layer3": {"w": to_cupy(np.array([np.inf] * 12 + [1.0], np.float16))}}
    assert [str(r) for r in sc.non_finite_leaves(grads)] == ["grads['layer3']['w']: 12 inf, 0 nan"]
    same_errors({"w": cupy.ones(2, cupy.float32), "bad": cupy.arange(3)}, "cupy")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="CuPy is not installed")
def test_cupy_glue_on_the_cpu_with_numpy_standing_in() -> None:
    """Without a GPU: the CuPy function's own logic (first paths, one stacked transfer,
    the rows back to reports), with NumPy arrays standing in for CuPy's and a stand-in
    ``cupy`` whose counts are 0-d arrays, as CuPy's are."""
    import contextlib
    import types

    from scaler_core.backends import _cupy

    class Device:
        id = 0

    class OnGpu(np.ndarray):
        @property
        def device(self) -> Any:  # type: ignore[override]
            return Device()

    transfers: list[Any] = []

    def asnumpy(x: Any) -> np.ndarray:
        transfers.append(x)
        return np.array(x)

    standin = types.SimpleNamespace(
        count_nonzero=lambda x: np.asarray(np.count_nonzero(x)),
        stack=lambda xs: np.stack([np.asarray(x) for x in xs]),
        asarray=np.asarray,
        asnumpy=asnumpy,
    )
    tied = np.array([np.nan, np.inf, 1.0], np.float16).view(OnGpu)
    leaves = [tied, np.ones(3, np.float32).view(OnGpu), tied, np.array(-np.inf).view(OnGpu)]
    paths = ["grads['a']", "grads['b']", "grads['tied']", "grads['c']"]
    with (
        mock.patch.object(_cupy, "cupy", standin),
        mock.patch.object(_cupy, "_validated", return_value=(leaves, paths)),
        mock.patch.object(_cupy, "_on_device", return_value=contextlib.nullcontext()),
    ):
        reports = sc.non_finite_leaves(None, backend=_cupy.CupyBackend())
    assert got(reports) == [("grads['a']", 1, 1), ("grads['c']", 0, 1)]
    assert len(transfers) == 1
