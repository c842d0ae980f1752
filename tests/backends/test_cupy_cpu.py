"""The CuPy backend where no GPU is needed: lazy loading, the kernel source, dispatch, errors.

These run on any machine. Arrays here are CuPy arrays over fake device memory
(``UnownedMemory`` at an address nothing may touch): a test that gets the
library's own validation error, not a CUDA error, proves validation ran before
any device work. That is what the refusal tests here add to the contract suite
(``test_contract.py``), which runs every rule on the CuPy backend only where a GPU
is. The GPU tests are in ``test_cupy_gpu.py``.
"""

from __future__ import annotations

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

KERNELS = ("float16", "bfloat16", "float32", "float64")


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
        scaler = sc.GradScaler()
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


def test_kernel_source_compiles_with_nvcc(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH; the kernel source is compiled on GPU machines by NVRTC")
    src = importlib.resources.files("scaler_core.backends").joinpath("_cupy_kernels.cu")
    ptx = tmp_path / "kernels.ptx"
    with importlib.resources.as_file(src) as path:
        out = subprocess.run(
            # -ftz=true: CuPy compiles every kernel with it.
            [nvcc, "-ptx", "-arch=sm_90", "-std=c++14", "-ftz=true", "-o", str(ptx), str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    text = ptx.read_text()
    entries = set(re.findall(r"\.entry\s+(\w+)", text))
    expected = {f"sc_{op}_{dt}" for op in ("unscale", "detect") for dt in KERNELS}
    assert entries == expected
    # The fast path moves 16 bytes per access; the flag costs one atomic per block.
    assert "ld.global.cs.v4.u32" in text
    assert "st.global.cs.v4.u32" in text
    # Each atomic sits behind a block-wide OR (__syncthreads_or), so it runs once per block.
    assert text.count("atom.global.or.b32") == text.count("bar.red.or.pred") > 0
    # Even under -ftz=true no instruction flushes subnormals (they must match NumPy's bits).
    assert ".ftz" not in text
    assert text.count("mul.rn.f32") > 0


def test_kernel_source_compiles_with_nvrtc() -> None:
    """The run-time compiler CuPy uses: needs libnvrtc (pip install nvidia-cuda-nvrtc), no GPU."""
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
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert set(re.findall(r"\.entry\s+(\w+)", ptx)) == {
        f"sc_{op}_{dt}" for op in ("unscale", "detect") for dt in KERNELS
    }
    assert ".ftz" not in ptx


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
    from scaler_core._backend import _backend_name_of

    assert _backend_name_of(_fake(cupy_mod, (3,), np.float32)) == "cupy"
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
    for call in (lambda: backend.unscale(grads, 2.0), lambda: backend.find_non_finite(grads)):
        with pytest.raises(sc.GradientTypeError, match=r"grads\['w'\]\[1\] has dtype"):
            call()


def test_foreign_leaf_is_rejected_by_path(backend: Any, cupy_mod: Any) -> None:
    grads = [_fake(cupy_mod, (4,), np.float32), None, np.ones(2, np.float32)]
    with pytest.raises(sc.GradientTypeError, match=r"grads\[2\] is a numpy.ndarray"):
        backend.unscale(grads, 2.0)


def test_leaves_on_two_devices_are_rejected(backend: Any, cupy_mod: Any) -> None:
    grads = [_fake(cupy_mod, (4,), np.float32, 0), _fake(cupy_mod, (4,), np.float32, 1)]
    with pytest.raises(sc.GradientValueError, match=r"grads\[1\] is on GPU 1 but grads\[0\]"):
        backend.unscale(grads, 2.0)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf"), 1e-40, 1e39, "2"])
def test_bad_host_scale_is_rejected_first(backend: Any, cupy_mod: Any, scale: Any) -> None:
    with pytest.raises(sc.GradientValueError, match="scale="):
        backend.unscale([_fake(cupy_mod, (4,), np.float32)], scale)


@pytest.mark.parametrize(("shape", "dtype"), [((2,), np.float32), ((), np.int32), ((1,), "f8")])
def test_bad_device_scale_is_rejected_first(
    backend: Any, cupy_mod: Any, shape: tuple[int, ...], dtype: Any
) -> None:
    scale = _fake(cupy_mod, shape, dtype)
    with pytest.raises(sc.GradientValueError, match="device scale must be a 0-d float array"):
        backend.unscale([_fake(cupy_mod, (4,), np.float32)], scale)


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


def test_nccl_reducer_validates_its_arguments(cupy_mod: Any) -> None:
    from scaler_core.backends import _cupy

    with pytest.raises(sc.InvalidArgumentError, match=r"comm=.*NcclCommunicator"):
        _cupy.found_reducer(object())

    class Comm:
        def allReduce(self, *args: Any) -> None:  # the NcclCommunicator method name
            raise AssertionError("must not be called while validating")

    with pytest.raises(sc.InvalidArgumentError, match=r"stream=.*cupy\.cuda\.Stream"):
        _cupy.found_reducer(Comm(), stream="default")
    reduce_found = _cupy.found_reducer(Comm())
    with pytest.raises(sc.GradientTypeError, match="found="):
        reduce_found(1)
    with pytest.raises(sc.InvalidArgumentError, match="reduce_found"):
        sc.GradScaler(reduce_found="not callable")  # type: ignore[arg-type]


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
        backend.unscale(grads, 2.0)
    assert dict(_cupy._PLANS) == before


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
    plan, leaves = _cupy._plan([a, b, t, None])  # None leaves are skipped
    assert [x is y for x, y in zip(leaves, [a, b, t], strict=True)] == [True] * 3
    assert plan.strided == [2]
    assert built == [("float32", 1), ("float16", 1)]
    assert _cupy._plan([a, b, t])[0] is plan  # the fast path: same objects
    assert _cupy._plan({"x": [a, b], "y": t})[0] is plan  # any tree with the same leaves
    assert len(built) == 2

    ref = weakref.ref(b)
    del b, leaves
    gc.collect()
    assert ref() is None  # the cache holds no strong reference to a gradient
    assert plan.valid is False
    c = _fake(cupy_mod, (4, 3), np.float16)
    assert _cupy._plan([a, c, t])[0] is not plan


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
