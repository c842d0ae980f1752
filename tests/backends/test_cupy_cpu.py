"""The CuPy backend where no GPU is needed: lazy loading, the kernel source, dispatch, errors.

These run on any machine. Arrays here are CuPy arrays over fake device memory
(``UnownedMemory`` at an address nothing may touch): a test that gets the
library's own validation error, not a CUDA error, proves validation ran before
any device work. That is what the refusal tests here add to the contract suite
(``test_contract.py``), which runs every rule on the CuPy backend only where a GPU
is. The GPU tests are in ``test_cupy_gpu.py``.

For the measure and clip passes (``unscale_and_norm`` and ``unscale_and_clip``, as the
core composes them in ``scaler_core._ops``) this file also checks, without a GPU,
the PTX of their kernels (no flushing of subnormals, no floating-point atomics,
a read-only first pass, a clip pass that reads the flag and the norm) and the
order and arguments of their launches, with the GPU replaced by a recorder.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core import _ops

KERNELS = ("float16", "bfloat16", "float32", "float64")
#: Per dtype: unscale, detection, unscale + norm, the read-only first pass of clipping
#: (flag and norm), and the clip pass; plus the one kernel that finishes a norm.
OPS = ("unscale", "detect", "unscale_norm", "norm", "clip")
ENTRIES = {f"sc_{op}_{dt}" for op in OPS for dt in KERNELS} | {"sc_norm_finish"}


def _import_cupy() -> Any:
    return pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda13x)")


def _has_gpu(cupy: Any) -> bool:
    try:
        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


def _fake(cupy: Any, shape: tuple[int, ...], dtype: Any, device: int = 0) -> Any:
    """A CuPy array over device memory that must never be touched (address 16 MiB)."""
    from cupy.cuda import memory

    mem = memory.UnownedMemory(1 << 24, 1 << 30, None, device_id=device)
    return cupy.ndarray(shape, dtype=dtype, memptr=memory.MemoryPointer(mem, 0))


@pytest.fixture
def cupy_mod() -> Any:
    return _import_cupy()


@pytest.fixture
def backend(cupy_mod: Any) -> Any:
    from scaler_core.backends import _cupy

    return _cupy.CupyBackend()


# ------------------------------------------------------------------ loading
def test_numpy_use_never_imports_cupy() -> None:
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import scaler_core as sc
        import scaler_core.cupy
        state = sc.init()
        grads = {"w": np.ones(4, np.float32) * 65536}
        grads, found = sc.unscale(grads, state)
        state = sc.update(state, found)
        scaler = sc.LossScaler()
        scaler.unscale([np.ones(3, np.float16)])
        scaler.update()
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in {"cupy", "cupyx", "jax"})
        assert not leaked, leaked
        assert "scaler_core.backends._cupy" not in sys.modules
        print("clean")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd="/"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_kernel_source_ships_as_package_data() -> None:
    src = (
        importlib.resources.files("scaler_core.backends")
        .joinpath("_cupy_kernels.cu")
        .read_text(encoding="utf-8")
    )
    for dtype in KERNELS:
        assert f"SC_KERNELS({dtype}," in src
    assert "#include" not in src  # NVRTC must compile it without any header path


@pytest.fixture(scope="module")
def nvcc_ptx(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The kernels' PTX from ``nvcc -ptx`` (skips without nvcc)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH; the kernel source is compiled on GPU machines by NVRTC")
    src = importlib.resources.files("scaler_core.backends").joinpath("_cupy_kernels.cu")
    ptx = tmp_path_factory.mktemp("ptx") / "kernels.ptx"
    with importlib.resources.as_file(src) as path:
        out = subprocess.run(
            # -ftz=true: CuPy compiles every kernel with it.
            [nvcc, "-ptx", "-arch=sm_90", "-std=c++14", "-ftz=true", "-o", str(ptx), str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    return ptx.read_text()


@pytest.fixture(scope="module")
def nvrtc_ptx() -> str:
    """The kernels' PTX from NVRTC, the run-time compiler CuPy uses (skips without libnvrtc)."""
    _import_cupy()
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as exc:
        pytest.skip(f"libnvrtc cannot be loaded here ({type(exc).__name__}); nvcc covers syntax")
    from scaler_core.backends import _cupy

    prog = nvrtc.createProgram(_cupy.kernel_source(), "scaler_core_kernels.cu", [], [])
    try:
        # The options CuPy's RawModule adds on its own.
        nvrtc.compileProgram(
            prog, ["-arch=compute_90", "-ftz=true", "--device-as-default-execution-space"]
        )
    except Exception as exc:
        raise AssertionError(nvrtc.getProgramLog(prog)) from exc
    ptx = nvrtc.getPTX(prog)
    return ptx.decode() if isinstance(ptx, bytes) else str(ptx)


def test_kernel_source_compiles_with_nvcc(nvcc_ptx: str) -> None:
    text = nvcc_ptx
    assert set(re.findall(r"\.entry\s+(\w+)", text)) == ENTRIES
    # The fast path moves 16 bytes per access; the flag costs one atomic per block.
    assert "ld.global.cs.v4.u32" in text
    assert "st.global.cs.v4.u32" in text
    # Each atomic sits behind a block-wide OR (__syncthreads_or), so it runs once per block.
    assert text.count("atom.global.or.b32") == text.count("bar.red.or.pred") > 0
    # Even under -ftz=true no instruction flushes subnormals (they must match NumPy's bits).
    assert ".ftz" not in text
    assert text.count("mul.rn.f32") > 0


def test_kernel_source_compiles_with_nvrtc(nvrtc_ptx: str) -> None:
    """The run-time compiler CuPy uses: needs libnvrtc (pip install nvidia-cuda-nvrtc), no GPU."""
    assert set(re.findall(r"\.entry\s+(\w+)", nvrtc_ptx)) == ENTRIES
    assert ".ftz" not in nvrtc_ptx


def _entries(ptx: str) -> dict[str, str]:
    """Each kernel's PTX by name (everything is inlined: one body per entry)."""
    parts = re.split(r"(?=^\.visible\s+\.entry\s)", ptx, flags=re.MULTILINE)[1:]
    return {re.search(r"\.entry\s+(\w+)", p).group(1): p for p in parts}  # type: ignore[union-attr]


def _stores(body: str) -> set[str]:
    """The store instructions of one kernel, shared memory left out."""
    return {s for s in re.findall(r"\bst\.[\w.]+", body) if not s.startswith("st.shared")}


#: f32(1e-6), the epsilon of clip_grad_norm_, as PTX writes a float32 immediate.
_EPS_PTX = "0f" + format(int(np.float32(1e-6).view(np.uint32)), "08X")


@pytest.mark.parametrize("compiler", ["nvcc", "nvrtc"])
def test_norm_and_clip_kernels_have_the_documented_shape(
    compiler: str, request: pytest.FixtureRequest
) -> None:
    """What the PTX of the norm and clip kernels must show, checked without a GPU."""
    ptx = request.getfixturevalue(f"{compiler}_ptx")
    bodies = _entries(ptx)
    assert set(bodies) == ENTRIES
    # Even under -ftz=true: the float64 sums, the conversions and the coefficient
    # arithmetic keep subnormals (and no instruction anywhere flushes them).
    assert ".ftz" not in ptx
    # Deterministic norms: no floating-point atomics (their order varies run to run).
    assert not re.search(r"\b(atom|red)\.[\w.]*\.f(16|32|64)\b", ptx)
    for dt in KERNELS:
        first = bodies[f"sc_norm_{dt}"]  # measure without write: unscale_and_clip's first pass
        assert _stores(first) == {"st.global.f64"}, dt  # its partial sum, no gradient write
        assert "fma.rn.f64" in first
        assert first.count("atom.global.or.b32") == first.count("bar.red.or.pred") > 0
        assert "ld.global.cs.v4.u32" in first
        fused = bodies[f"sc_unscale_norm_{dt}"]  # unscale's writes, the flag and the sums
        assert {"st.global.cs.v4.u32", "st.global.f64"} <= _stores(fused), dt
        assert "fma.rn.f64" in fused
        assert fused.count("atom.global.or.b32") == fused.count("bar.red.or.pred") > 0
        clip = bodies[f"sc_clip_{dt}"]  # reads the flag and the norm; writes gradients only
        assert "st.global.cs.v4.u32" in _stores(clip), dt
        assert "st.global.f64" not in _stores(clip), dt
        assert "atom." not in clip  # the flag is read, never written
        assert re.search(r"\bld(\.global)?(\.nc)?\.u8\b", clip), dt  # the skip flag
        assert "fma.rn.f64" not in clip  # no norm here
        # coef = min(1, f32(f32(1 / f32(norm + f32(1e-6))) * f32(max_norm))), IEEE float32
        for op in ("add.rn.f32", "div.rn.f32", "setp.gt.f32", "selp.f32"):
            assert op in clip, (dt, op)
        assert _EPS_PTX in clip
        assert "min.f32" not in clip  # it would turn a NaN coefficient into 1
    finish = bodies["sc_norm_finish"]
    assert _stores(finish) == {"st.global.f32"}
    for op in ("add.rn.f64", "sqrt.rn.f64", "cvt.rn.f32.f64"):
        assert op in finish, op
    assert "atom." not in finish


def test_backend_is_unavailable_with_a_clear_reason_without_a_gpu() -> None:
    try:
        import cupy
    except ImportError:
        with pytest.raises(sc.BackendUnavailableError, match=r"scaler-core\[cupy\]"):
            sc.get_backend("cupy")
        return
    if _has_gpu(cupy):
        pytest.skip("a GPU is present: the backend is available here")
    with pytest.raises(sc.BackendUnavailableError, match="needs a CUDA GPU") as info:
        sc.get_backend("cupy")
    assert isinstance(info.value, ImportError)
    assert "cupy" not in sc.available_backends()


def test_gpu_helpers_raise_backend_unavailable_without_a_gpu() -> None:
    from scaler_core import cupy as sc_cupy

    try:
        import cupy

        if _has_gpu(cupy):
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    with pytest.raises(sc.BackendUnavailableError):
        sc_cupy.to_device(sc.init())
    with pytest.raises(sc.BackendUnavailableError):
        sc_cupy.found_reducer(object())


# ----------------------------------------------------------------- dispatch
def test_cupy_arrays_dispatch_to_the_cupy_backend(cupy_mod: Any) -> None:
    from scaler_core._registry import backend_name_of

    assert backend_name_of(_fake(cupy_mod, (3,), np.float32)) == "cupy"
    if not _has_gpu(cupy_mod):
        with pytest.raises(sc.BackendUnavailableError, match="needs a CUDA GPU"):
            sc.unscale([_fake(cupy_mod, (3,), np.float32)], 2.0)


def test_mixed_numpy_and_cupy_leaves_are_rejected(cupy_mod: Any) -> None:
    grads = {"a": np.ones(3, np.float32), "b": _fake(cupy_mod, (3,), np.float32)}
    with pytest.raises(sc.GradientTypeError, match=r"grads\['b'\] is a cupy array"):
        sc.unscale(grads, 2.0)
    assert grads["a"].tolist() == [1.0, 1.0, 1.0]


# ------------------------------------------------------------------- errors
@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64, np.uint8])
def test_non_float_leaf_is_rejected_by_path(backend: Any, cupy_mod: Any, dtype: Any) -> None:
    grads = {"w": [_fake(cupy_mod, (4,), np.float32), _fake(cupy_mod, (2,), dtype)]}
    for call in (
        lambda: _ops.unscale(backend, grads, 2.0),
        lambda: _ops.find_non_finite(backend, grads),
    ):
        with pytest.raises(sc.GradientTypeError, match=r"grads\['w'\]\[1\] has dtype"):
            call()


def test_foreign_leaf_is_rejected_by_path(backend: Any, cupy_mod: Any) -> None:
    grads = [_fake(cupy_mod, (4,), np.float32), None, np.ones(2, np.float32)]
    with pytest.raises(sc.GradientTypeError, match=r"grads\[2\] is a numpy.ndarray"):
        _ops.unscale(backend, grads, 2.0)


def test_leaves_on_two_devices_are_rejected(backend: Any, cupy_mod: Any) -> None:
    grads = [_fake(cupy_mod, (4,), np.float32, 0), _fake(cupy_mod, (4,), np.float32, 1)]
    with pytest.raises(sc.GradientValueError, match=r"grads\[1\] is on GPU 1 but grads\[0\]"):
        _ops.unscale(backend, grads, 2.0)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), 1e-40, 1e39, "2"])
def test_bad_host_scale_is_rejected_first(backend: Any, cupy_mod: Any, scale: Any) -> None:
    with pytest.raises(sc.GradientValueError, match="scale="):
        _ops.unscale(backend, [_fake(cupy_mod, (4,), np.float32)], scale)


@pytest.mark.parametrize(("shape", "dtype"), [((2,), np.float32), ((), np.int32), ((1,), "f8")])
def test_bad_device_scale_is_rejected_first(
    backend: Any, cupy_mod: Any, shape: tuple[int, ...], dtype: Any
) -> None:
    scale = _fake(cupy_mod, shape, dtype)
    with pytest.raises(sc.GradientValueError, match="device scale must be a 0-d float array"):
        _ops.unscale(backend, [_fake(cupy_mod, (4,), np.float32)], scale)


@pytest.mark.parametrize("flag", [1, 0.0, None, "yes", np.array([True])])
def test_flags_must_be_booleans(backend: Any, flag: Any) -> None:
    with pytest.raises(sc.GradientTypeError, match="0-d boolean array"):
        backend.update(sc.init(), flag)
    with pytest.raises(sc.GradientTypeError, match="0-d boolean array"):
        backend.any(flag)


def test_select_rejects_trees_of_different_structure(backend: Any, cupy_mod: Any) -> None:
    a = _fake(cupy_mod, (2,), np.float32)
    flag = _fake(cupy_mod, (), np.bool_)
    with pytest.raises(sc.InvalidArgumentError, match="same structure"):
        backend.select(flag, {"w": a}, {"v": a})
    with pytest.raises(sc.InvalidArgumentError, match="same structure"):
        backend.select(flag, [a, a], [a])
    with pytest.raises(sc.InvalidArgumentError, match="cupy arrays"):
        backend.select(flag, [a], [np.ones(2)])
    with pytest.raises(sc.GradientTypeError, match="0-d boolean array"):
        backend.select(a, [a], [a])


def test_scale_loss_needs_a_cupy_loss(backend: Any) -> None:
    with pytest.raises(sc.GradientTypeError, match=r"cupy\.ndarray loss"):
        backend.scale_loss(np.float32(1.0), 2.0)


def test_nccl_reducer_validates_its_arguments(
    cupy_mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scaler_core import cupy as sc_cupy
    from scaler_core.backends import _cupy

    # Past the "no GPU" refusal (test_gpu_helpers_raise_backend_unavailable_without_a_gpu),
    # to the checks of the arguments themselves.
    monkeypatch.setattr(sc_cupy, "_cupy_backend", lambda: _cupy)
    makers = (sc_cupy.found_reducer, functools.partial(sc_cupy.reduce_found, True))
    for make in makers:
        with pytest.raises(sc.InvalidArgumentError, match=r"comm=.*NcclCommunicator"):
            make(object())

    class Comm:
        def allReduce(self, *args: Any) -> None:  # the NcclCommunicator method name
            raise AssertionError("must not be called while validating")

    for make in makers:
        with pytest.raises(sc.InvalidArgumentError, match=r"stream=.*cupy\.cuda\.Stream"):
            make(Comm(), stream="default")
    reduce_found = sc_cupy.found_reducer(Comm())
    with pytest.raises(sc.GradientTypeError, match="found="):
        reduce_found(1)
    with pytest.raises(sc.GradientTypeError, match="found="):
        sc_cupy.reduce_found(1, Comm())
    with pytest.raises(sc.InvalidArgumentError, match="reduce_found"):
        sc.LossScaler(reduce_found="not callable")  # type: ignore[arg-type]


# ------------------------------------------------- norm and clip: validation
@pytest.fixture
def no_device_work(cupy_mod: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way the backend reaches the GPU raises AssertionError (on a GPU machine too)."""
    from scaler_core.backends import _cupy

    def forbid(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("device work happened before validation finished")

    monkeypatch.setattr(_cupy._GPU, "function", forbid)
    for name in ("_group", "_new_flag", "_new_partials", "_new_norm", "_strided_copies"):
        monkeypatch.setattr(_cupy, name, forbid)
    for name in ("empty", "zeros", "full", "asarray", "ascontiguousarray", "where", "isfinite"):
        monkeypatch.setattr(cupy_mod, name, forbid)


def _message(call: Callable[[], Any]) -> tuple[type[BaseException], str]:
    with pytest.raises(sc.ScalerError) as info:
        call()
    return type(info.value), str(info.value)


_BAD_MAX_NORMS = [
    0.0,
    -1.0,
    -0.0,
    float("nan"),
    float("inf"),
    -float("inf"),
    1e39,  # past float32's range: f32(max_norm) would be inf
    1e-50,  # f32(max_norm) would be 0
    True,
    np.bool_(True),
    "1.0",
    None,
    1 + 0j,
    np.array(1.0),
]


@pytest.mark.parametrize("max_norm", _BAD_MAX_NORMS, ids=repr)
def test_bad_max_norm_is_refused_before_any_device_work(
    backend: Any, cupy_mod: Any, no_device_work: None, max_norm: Any
) -> None:
    grads = [_fake(cupy_mod, (4,), np.float32)]
    with pytest.raises(sc.InvalidArgumentError) as info:
        _ops.unscale_and_clip(backend, grads, 2.0, max_norm)
    text = str(info.value)
    # Field and value (an array is named, not shown: its repr could read it back).
    kind = type(max_norm)
    named = hasattr(max_norm, "shape") and hasattr(max_norm, "dtype")  # NumPy values
    shown = f"a {kind.__module__}.{kind.__qualname__}" if named else repr(max_norm)
    assert text.startswith(f"max_norm={shown}, but it must be"), text
    assert "max_norm=1.0" in text  # the fix
    # The same message as every other backend gives (one shared rule).
    with pytest.raises(sc.InvalidArgumentError) as numpy_info:
        _ops.unscale_and_clip(sc.get_backend("numpy"), [np.ones(4, np.float32)], 2.0, max_norm)
    assert str(numpy_info.value) == text


def test_device_array_max_norm_is_refused_without_reading_it(
    backend: Any, cupy_mod: Any, no_device_work: None
) -> None:
    grads = [_fake(cupy_mod, (4,), np.float32)]
    # Named by its type (the core's one max_norm check), never read: its memory is fake.
    with pytest.raises(sc.InvalidArgumentError, match=r"max_norm=a cupy\.ndarray, but it must"):
        _ops.unscale_and_clip(backend, grads, 2.0, _fake(cupy_mod, (), np.float32))


def test_refusals_come_in_the_numpy_backends_order(
    backend: Any, cupy_mod: Any, no_device_work: None
) -> None:
    """Several faults at once: max_norm first (the core checks it before any pass), then
    the leaves (``plan``), then the scale (the passes), as for NumPy."""
    numpy_backend = sc.get_backend("numpy")
    cases = [  # (scale, max_norm, leaf dtype) -> the error both backends raise
        (0.0, 0.0, np.float32, sc.InvalidArgumentError),
        (0.0, 1.0, np.int32, sc.GradientTypeError),
        (0.0, 1.0, np.float32, sc.GradientValueError),
        (2.0, 0.0, np.int32, sc.InvalidArgumentError),
        (2.0, 1.0, np.int32, sc.GradientTypeError),
    ]
    for scale, max_norm, dtype, error in cases:
        with pytest.raises(error):
            _ops.unscale_and_clip(backend, [_fake(cupy_mod, (4,), dtype)], scale, max_norm)
        with pytest.raises(error):
            _ops.unscale_and_clip(numpy_backend, [np.ones(4, dtype)], scale, max_norm)
    with pytest.raises(sc.GradientValueError, match="device scale must be a 0-d float array"):
        _ops.unscale_and_clip(
            backend, [_fake(cupy_mod, (4,), np.float32)], _fake(cupy_mod, (2,), "f4"), 1
        )


def test_reduce_must_be_callable(backend: Any, cupy_mod: Any, no_device_work: None) -> None:
    with pytest.raises(sc.InvalidArgumentError, match=r"reduce='or', but it must be a callable"):
        _ops.unscale_and_clip(backend, [_fake(cupy_mod, (4,), np.float32)], 2.0, 1.0, reduce="or")


@pytest.mark.parametrize(
    "max_norm", [1, 0.5, np.float32(2.5), np.int64(3), np.float64(1e-30), 3.4028234663852886e38]
)
def test_good_max_norm_becomes_its_float32(
    backend: Any, cupy_mod: Any, monkeypatch: pytest.MonkeyPatch, max_norm: Any
) -> None:
    """What the clip launch gets for ``max_norm`` (checked by the core): its float32."""
    rec = _Launches(cupy_mod, monkeypatch)
    _ops.unscale_and_clip(backend, [rec.fake((8,), np.float32)], 2.0, max_norm)
    [clip] = [entry for entry in rec.log if entry[0] == "sc_clip_float32"]
    got = clip[3][-1]
    assert type(got) is np.float32
    assert got == np.float32(max_norm)
    assert np.isfinite(got)
    assert got > 0


def _nothing_cached(before: dict[Any, Any]) -> bool:
    """No plan in the cache that was not there ``before`` (looking a tree up may drop
    a dead plan whose arrays' ids the new arrays reuse)."""
    from scaler_core.backends import _cupy

    return all(before.get(key) is plan for key, plan in _cupy._PLANS.items())


def _bad_trees(cupy_mod: Any) -> list[tuple[str, Any, Any]]:
    ok = _fake(cupy_mod, (4,), np.float32)
    return [
        ("int leaf", {"w": [ok, _fake(cupy_mod, (2,), np.int32)]}, 2.0),
        ("bool leaf", [ok, _fake(cupy_mod, (2,), np.bool_)], 2.0),
        ("numpy leaf", [ok, None, np.ones(2, np.float32)], 2.0),
        ("two GPUs", [ok, _fake(cupy_mod, (4,), np.float32, 1)], 2.0),
        ("zero scale", [ok], 0.0),
        ("nan scale", [ok], float("nan")),
        ("subnormal scale", [ok], 1e-40),
        ("str scale", [ok], "2"),
        ("1-d device scale", [ok], _fake(cupy_mod, (1,), np.float32)),
        ("int device scale", [ok], _fake(cupy_mod, (), np.int32)),
    ]


@pytest.mark.parametrize("case", range(10))
def test_norm_and_clip_refuse_exactly_as_unscale_before_any_device_work(
    backend: Any, cupy_mod: Any, no_device_work: None, case: int
) -> None:
    from scaler_core.backends import _cupy

    what, grads, scale = _bad_trees(cupy_mod)[case]
    before = dict(_cupy._PLANS)
    want = _message(lambda: _ops.unscale(backend, grads, scale))
    assert _message(lambda: _ops.unscale_and_norm(backend, grads, scale)) == want, what
    assert _message(lambda: _ops.unscale_and_clip(backend, grads, scale, 1.0)) == want, what
    assert (
        _message(lambda: _ops.unscale_and_clip(backend, grads, scale, 1.0, reduce=bool)) == want
    ), what
    assert _nothing_cached(before)  # nothing cached for a refused tree


# ------------------------------------------------ norm and clip: the launches
def _fake_at(cupy: Any, shape: tuple[int, ...], dtype: Any, address: int) -> Any:
    """A CuPy array over untouchable device memory at ``address`` (distinct per array)."""
    from cupy.cuda import memory

    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    mem = memory.UnownedMemory(address, nbytes, None, device_id=0)
    return cupy.ndarray(shape, dtype=dtype, memptr=memory.MemoryPointer(mem, 0))


class _Launches:
    """Stands in for the GPU: records every launch, buffer and copy-back, in order."""

    def __init__(self, cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        from scaler_core.backends import _cupy

        self.cupy, self.log = cupy, []
        self.next_address = 1 << 40
        self.grids: dict[str, int] = {}
        self.buffers: dict[str, Any] = {}
        monkeypatch.setattr(_cupy, "_GPU", self)
        monkeypatch.setattr(_cupy, "_group", self.group)
        monkeypatch.setattr(_cupy, "_on_device", lambda device: _cupy._NoContext())
        monkeypatch.setattr(_cupy, "_capturing", lambda: False)
        monkeypatch.setattr(_cupy, "_new_flag", lambda: self.buffer("found", (1,), np.uint32))
        monkeypatch.setattr(_cupy, "_new_norm", lambda: self.buffer("norm", (), np.float32))
        monkeypatch.setattr(
            _cupy, "_new_partials", lambda n: self.buffer("partials", (n,), np.float64)
        )
        monkeypatch.setattr(_cupy, "_strided_copies", self.strided_copies)
        monkeypatch.setattr(_cupy, "_write_back", lambda copies: self.log.append(("write", copies)))

    def fake(self, shape: tuple[int, ...], dtype: Any) -> Any:
        self.next_address += 1 << 24
        return _fake_at(self.cupy, shape, dtype, self.next_address)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        self.buffers[name] = self.fake(shape, dtype)
        return self.buffers[name]

    def group(self, device: int, dtype: Any, entries: list[tuple[int, int]]) -> Any:
        from scaler_core.backends import _cupy

        grid = 2 + len(self.grids)  # a different grid per group: the slots must follow it
        self.grids[dtype.name] = grid
        table = self.fake((2 * len(entries),), np.uint64)
        return _cupy._Group(dtype.name, table, 10 * len(entries), grid)

    def strided_copies(self, leaves: list[Any], plan: Any) -> list[tuple[Any, Any]]:
        return [(leaves[i], self.fake(leaves[i].shape, np.uint64)) for i in plan.strided]

    def function(self, device: int, name: str) -> Callable[..., None]:
        def launch(grid: tuple[int], block: tuple[int], args: tuple[Any, ...]) -> None:
            self.log.append((name, grid, block, args))

        return launch

    def copy_unless(self, src: Any, skip: Any, dst: Any) -> None:
        self.log.append(("copy_back", src, skip, dst))

    def names(self) -> list[str]:
        return [entry[0] for entry in self.log]


def _tree(rec: _Launches) -> dict[str, Any]:
    return {
        "a": rec.fake((100,), np.float32),
        "b": [rec.fake((3, 5), np.float16), None],
        "t": rec.fake((6, 4), np.float64).T,  # strided: through a contiguous copy
    }


def _check_first_pass(rec: _Launches, kernel: str, scale_args: tuple[Any, Any]) -> int:
    """The per-dtype first pass and the finish; returns how many log entries they took."""
    dtypes = ["float32", "float16", "float64"]  # contiguous groups first, then the copies
    assert rec.names()[:4] == [f"{kernel}{dt}" for dt in dtypes] + ["sc_norm_finish"]
    partials, found = rec.buffers["partials"], rec.buffers["found"]
    assert partials.size == sum(rec.grids.values())
    start = 0
    for (_, grid, block, args), dt in zip(rec.log[:3], dtypes, strict=True):
        _table, n_chunks, scale_ptr, host_inv, flag, slots = args
        assert (grid, block) == ((rec.grids[dt],), (512,))
        assert type(n_chunks) is np.int32
        assert (scale_ptr, host_inv) == scale_args
        assert type(host_inv) is np.float32
        assert flag is found  # one flag buffer for every dtype
        # Each block gets its own float64 slot: the groups' slots follow one another.
        assert slots.data.ptr == partials.data.ptr + 8 * start
        assert slots.size == rec.grids[dt]
        start += rec.grids[dt]
    _, grid, block, (all_slots, n, norm) = rec.log[3]
    assert (grid, block) == ((1,), (512,))  # one block adds the slots, in a fixed order
    assert all_slots is partials
    assert type(n) is np.int32
    assert int(n) == start
    assert norm is rec.buffers["norm"]
    return 4


def test_unscale_norm_is_one_pass_then_the_finish(
    backend: Any, cupy_mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = _Launches(cupy_mod, monkeypatch)
    grads = _tree(rec)
    out, found, norm = _ops.unscale_and_norm(backend, grads, 4.0)
    assert out is grads
    from scaler_core.backends import _cupy

    n = _check_first_pass(rec, "sc_unscale_norm_", (_cupy._NULL, np.float32(0.25)))
    assert rec.names()[n:] == ["write"]  # the strided copy goes back, as for unscale
    [(leaf, copy)] = rec.log[n][1]
    assert leaf is grads["t"]
    assert copy.shape == leaf.shape
    assert norm is rec.buffers["norm"]
    assert found.shape == ()
    assert found.dtype == np.bool_
    assert found.data.ptr == rec.buffers["found"].data.ptr


@pytest.mark.parametrize("with_reduce", [False, True])
def test_unscale_clip_reads_then_reduces_then_clips_on_the_device(
    backend: Any, cupy_mod: Any, monkeypatch: pytest.MonkeyPatch, with_reduce: bool
) -> None:
    from scaler_core.backends import _cupy

    rec = _Launches(cupy_mod, monkeypatch)
    grads = _tree(rec)
    decision = rec.fake((), np.bool_)
    seen: list[Any] = []

    def reduce(flag: Any) -> Any:
        seen.append(flag)
        rec.log.append(("reduce",))
        return decision

    out, found, norm = _ops.unscale_and_clip(
        backend, grads, 4.0, 0.1, reduce=reduce if with_reduce else None
    )
    assert out is grads
    n = _check_first_pass(rec, "sc_norm_", (_cupy._NULL, np.float32(0.25)))
    if with_reduce:
        assert rec.names()[n] == "reduce"
        [flag] = seen
        assert flag.shape == ()
        assert flag.dtype == np.bool_
        assert flag.data.ptr == rec.buffers["found"].data.ptr  # the first pass's flag
        assert found is decision
        n += 1
    else:
        assert found.data.ptr == rec.buffers["found"].data.ptr
    # The clip pass gets the decision flag and the norm as device pointers, max_norm as f32.
    assert rec.names()[n:] == [f"sc_clip_{dt}" for dt in ("float32", "float16", "float64")] + [
        "copy_back"
    ]
    pass_one = rec.log[:3]
    for first, (_, grid, block, args) in zip(pass_one, rec.log[n : n + 3], strict=True):
        assert (grid, block) == (first[1], first[2])
        assert args[:4] == first[3][:4]  # the same table, chunk count and scale
        skip, clip_norm, max_norm = args[4:]
        assert skip is found
        assert clip_norm is norm is rec.buffers["norm"]
        assert type(max_norm) is np.float32
        assert max_norm == np.float32(0.1)
    # A strided leaf's copy goes back only where the device flag says "not skipped".
    _, src, skip, dst = rec.log[-1]
    assert skip is found
    assert src.dtype == dst.dtype == np.uint64
    assert dst.data.ptr == grads["t"].data.ptr
    assert dst.strides == grads["t"].strides
    assert "write" not in rec.names()  # never the unconditional write-back


def test_unscale_clip_with_a_host_flag_from_reduce(
    backend: Any, cupy_mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reduce that answers with a host bool gets it put on the device (a fill, no copy)."""
    rec = _Launches(cupy_mod, monkeypatch)
    filled: list[Any] = []

    def full(shape: Any, value: Any, dtype: Any = None) -> Any:
        filled.append((shape, value, np.dtype(dtype)))
        return rec.buffer("filled", (), np.bool_)

    monkeypatch.setattr(cupy_mod, "full", full)
    _, found, _ = _ops.unscale_and_clip(
        backend, [rec.fake((8,), np.float32)], 2.0, 1.0, reduce=lambda f: True
    )
    assert filled == [((), True, np.dtype(np.bool_))]
    assert found is True  # the core returns reduce's answer as it is
    assert rec.log[-1][3][4] is rec.buffers["filled"]  # the clip launch reads the filled flag
    # A reduce that answers with something else is refused before the clip pass.
    before = len(rec.log)
    with pytest.raises(sc.GradientTypeError, match=r"reduce\(found\)=1"):
        _ops.unscale_and_clip(backend, [rec.fake((8,), np.float32)], 2.0, 1.0, reduce=lambda f: 1)
    assert rec.names()[before:] == ["sc_norm_float32", "sc_norm_finish"]


# -------------------------------------------------------------- chunk table
def test_chunk_table_covers_every_element_once(cupy_mod: Any) -> None:
    from scaler_core.backends import _cupy

    per = _cupy.CHUNK_BYTES // 4
    entries = [(1 << 20, 1), (1 << 24, per), (1 << 28, 2 * per + 3), (1 << 32, per - 1)]
    table = _cupy._chunk_table(entries, 4).reshape(-1, 2)
    assert table[:, 1].max() <= per
    covered: list[int] = []
    for ptr, n in table.tolist():
        covered.extend(range(ptr, ptr + 4 * n, 4))
    expected = [p + 4 * i for p, n in entries for i in range(n)]
    assert covered == expected
    assert len(table) == 1 + 1 + 3 + 1


def test_plan_rejects_before_caching(backend: Any, cupy_mod: Any) -> None:
    from scaler_core.backends import _cupy

    before = dict(_cupy._PLANS)
    grads = [_fake(cupy_mod, (4,), np.float32), _fake(cupy_mod, (4,), np.int64)]
    with pytest.raises(sc.GradientTypeError):
        _ops.unscale(backend, grads, 2.0)
    assert _nothing_cached(before)


# --------------------------------------------------------------- plan cache
def test_plan_cache_hits_the_same_arrays_and_never_keeps_them_alive(
    cupy_mod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc
    import weakref

    from scaler_core.backends import _cupy

    built: list[tuple[str, int]] = []

    def fake_group(device: int, dtype: Any, entries: list[tuple[int, int]]) -> Any:
        built.append((dtype.name, len(entries)))
        return ("group", dtype.name, tuple(entries))

    monkeypatch.setattr(_cupy, "_group", fake_group)
    monkeypatch.setattr(_cupy, "_on_device", lambda device: _cupy._NoContext())
    a = _fake(cupy_mod, (8,), np.float32)
    b = _fake(cupy_mod, (4, 3), np.float16)
    t = _fake(cupy_mod, (4, 3), np.float64).T  # non-contiguous
    backend = _cupy.CupyBackend()

    def plan_of(grads: Any) -> tuple[Any, list[Any]]:
        prepared = backend.plan(grads, writable=True)
        return _cupy._plan_of(prepared), prepared.leaves

    prepared = backend.plan([a, b, t, None], writable=True)
    assert prepared.plan is None  # validated; the plan waits for the first pass
    assert built == []
    plan, leaves = plan_of([a, b, t, None])  # None leaves are skipped
    assert [x is y for x, y in zip(leaves, [a, b, t], strict=True)] == [True] * 3
    assert plan.strided == [2]
    assert built == [("float32", 1), ("float16", 1)]
    assert backend.plan([a, b, t], writable=True).plan is plan  # the fast path: same objects
    assert plan_of({"x": [a, b], "y": t})[0] is plan  # any tree with the same leaves
    assert _cupy._plan_of(prepared) is plan  # built meanwhile: found in the cache
    assert len(built) == 2

    ref = weakref.ref(b)
    del b, leaves, prepared
    gc.collect()
    assert ref() is None  # the cache holds no strong reference to a gradient
    assert plan.valid is False
    c = _fake(cupy_mod, (4, 3), np.float16)
    assert plan_of([a, c, t])[0] is not plan


# ---------------------------------------------------------------- benchmark
def test_benchmark_sets_have_the_documented_sizes(
    repo_module: Callable[[str], ModuleType],
) -> None:
    bench = repo_module("benchmarks/bench_gpu.py")
    gpt2 = bench.gpt2_small_shapes()
    assert len(gpt2) == 148
    assert sum(int(np.prod(s)) for s in gpt2) == 124_439_808
    assert bench.SETS["2000x1024"]() == [(1024,)] * 2000


def test_benchmark_without_a_gpu_says_why_and_writes_its_json(tmp_path: Path) -> None:
    try:
        import cupy

        if _has_gpu(cupy):
            pytest.skip("a GPU is present: the benchmark would run for real")
    except ImportError:
        pass
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-P", str(path), "--json", str(out), "--quick"],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
    )
    assert run.returncode == 0, run.stderr
    assert "skipped" in run.stdout
    import json

    report = json.loads(out.read_text())
    assert report["status"] == "skipped"
    assert report["reason"]


def test_benchmark_goals_and_table_read_a_report(
    repo_module: Callable[[str], ModuleType],
) -> None:
    bench = repo_module("benchmarks/bench_gpu.py")

    def res(ms: float, frac: float, vs: float | None) -> dict[str, Any]:
        return {
            "median_ms": ms,
            "gb_per_s": 1.0,
            "fraction_of_copy_bandwidth": frac,
            "speedup_vs_torch": vs,
        }

    report = {
        "sets": {
            "gpt2-small": {
                "results": {
                    "copy": res(1.0, 1.0, 1.2),
                    "cupy": res(1.1, 0.9, 1.1),
                    "torch": res(1.2, 0.8, 1.0),
                }
            },
            "2000x1024": {"results": {"cupy": res(2.0, 0.1, 0.5), "torch": res(1.0, 0.2, 1.0)}},
        }
    }
    goals = bench.goals(report)
    assert goals["cupy >= 0.85 of copy bandwidth on gpt2-small"]["ok"] is True
    assert goals["cupy at least as fast as torch on gpt2-small"]["ok"] is True
    assert goals["cupy at least as fast as torch on 2000x1024"]["ok"] is False
    assert "| gpt2-small | cupy | 1.1000 |" in bench.table(report)
