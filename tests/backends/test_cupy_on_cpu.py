"""The CUDA kernels, executed on the CPU: the CuPy backend's own launch code drives
the CPU build of ``backends/_cupy_kernels.cu`` (``cuda_on_cpu/``), bit for bit
against the NumPy reference.

The source is compiled unchanged but for its inline PTX (each statement rewritten
into a C++ function of the same IEEE rounding), every CUDA thread a fiber, blocks one
after another. The backend's ``_Gpu`` (compiling, launching, allocating, copying) is
replaced by ``HostGpu``; everything else (validation, plans, chunk tables, grid
sizes, partial slots, the device-scale path, the passes of norm and clip) is the
backend's. What only a GPU proves is in docs/cupy.md ("What the CPU build proves").
Skips where no C++ compiler or no CuPy is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from common_floats import DTYPES, UINT, bits
from common_loading import load_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaler_core import _ops
from scaler_core.testing import BACKEND_CHECKS, check_backend

ROOT = Path(__file__).resolve().parents[2]
SOURCE = (ROOT / "backends" / "_cupy_kernels.cu").read_text(encoding="utf-8")


BUILD = load_file(ROOT / "tests" / "backends" / "cuda_on_cpu" / "build.py", "cuda_on_cpu_build")


@pytest.fixture(scope="module")
def cupy() -> Any:
    return pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda13x)")


@pytest.fixture(scope="module")
def kernels(cupy: Any) -> Any:
    if BUILD.compiler() is None:
        pytest.skip("no C++ compiler (g++) on PATH: the CUDA kernels cannot be built for the CPU")
    return BUILD.build(SOURCE)


class Run:
    """The CuPy backend with ``gpu`` in place of its GPU, and the NumPy reference."""

    def __init__(self, gpu: Any) -> None:
        from scaler_core.backends import _cupy, _numpy_reference

        self.gpu, self.cupy = gpu, gpu.cupy
        self.backend = _cupy.CupyBackend()
        self.reference = _numpy_reference.BACKEND

    def both(self, op: str, host: list[np.ndarray], scale: Any, **kw: Any) -> tuple[Any, Any]:
        """``op`` on views of ``host`` through the backend, and on copies through the
        reference; each as ``(arrays, found, norm)`` in NumPy."""
        ref = [a.copy() for a in host]
        dev = [self.gpu.view(a) for a in host]
        device_scale = scale if not isinstance(scale, np.ndarray) else self.gpu.view(scale)
        ref_scale = scale if not isinstance(scale, np.ndarray) else float(scale)
        got = _call(op, self.backend, dev, device_scale, **kw)
        with np.errstate(all="ignore"):  # the reference's dot warns on special values
            want = _call(op, self.reference, ref, ref_scale, **kw)
        found = None if got[0] is None else bool(self.gpu.host(got[0]))
        norm = None if got[1] is None else np.float32(self.gpu.host(got[1]))
        return (host, found, norm), (ref, bool(want[0]), want[1])


def _call(op: str, backend: Any, grads: list[Any], scale: Any, **kw: Any) -> tuple[Any, Any]:
    if op == "unscale":
        return _ops.unscale(backend, grads, scale)[1], None
    if op == "detect":
        return _ops.find_non_finite(backend, grads), None
    if op == "unscale_norm":
        _, found, norm = _ops.unscale_and_norm(backend, grads, scale)
        return found, norm
    _, found, norm = _ops.unscale_and_clip(backend, grads, scale, kw["max_norm"])
    return found, norm


def assert_same(got: tuple[Any, Any, Any], want: tuple[Any, Any, Any], case: str) -> None:
    arrays, found, norm = got
    ref, ref_found, ref_norm = want
    for i, (a, r) in enumerate(zip(arrays, ref, strict=True)):
        diff = np.flatnonzero(bits(a).ravel() != bits(r).ravel())
        assert diff.size == 0, (
            f"{case}: leaf {i} ({a.dtype}, {a.size} elements) differs at {diff[:5]}: "
            f"{bits(a).ravel()[diff[:5]]} != reference {bits(r).ravel()[diff[:5]]}"
        )
    assert found == ref_found, f"{case}: found {found}, the reference {ref_found}"
    if norm is not None:
        if np.isnan(ref_norm):
            assert np.isnan(norm), f"{case}: norm {norm}, the reference NaN"
        else:
            # One float32 ulp, as the backend contract states: the blocks sum in another
            # order than the reference's chunks.
            ulps = abs(
                int(np.float32(norm).view(np.int32)) - int(np.float32(ref_norm).view(np.int32))
            )
            assert ulps <= 1, f"{case}: norm {norm!r}, the reference {ref_norm!r} ({ulps} ulps)"


def values(rng: np.random.Generator, dtype: np.dtype[Any], n: int, special: bool) -> np.ndarray:
    """``n`` elements: random bit patterns (every NaN payload, inf, subnormal) or ordinary
    values spread over the dtype's range."""
    if special:
        return (
            rng.integers(0, 2 ** (8 * dtype.itemsize), n, dtype=np.uint64)
            .astype(UINT[dtype.itemsize])
            .view(dtype)
        )
    return (rng.standard_normal(n) * 2.0 ** rng.integers(-12, 12, n)).astype(dtype)


OPS = ("unscale", "detect", "unscale_norm", "clip")
KERNEL_OPS = ("unscale", "detect", "unscale_norm", "norm", "clip")
KERNEL_DTYPES = ("float16", "bfloat16", "float32", "float64")
SCALES: tuple[Any, ...] = (65536.0, 3.0, 1.0, 0.25)


@pytest.fixture
def run(kernels: Any, cupy: Any, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Run]:
    from scaler_core.backends import _cupy

    def make(**kw: Any) -> Run:
        gpu = BUILD.HostGpu(kernels, cupy, **kw)
        monkeypatch.setattr(_cupy, "_GPU", gpu)
        monkeypatch.setattr(_cupy, "_TABLES", type(_cupy._TABLES)())
        monkeypatch.setattr(_cupy, "_PLANS", type(_cupy._PLANS)())
        return Run(gpu)

    return make


def test_every_entry_point_runs_bit_for_bit_for_every_dtype(
    run: Callable[..., Run], summary_line: Callable[[str], None]
) -> None:
    """Each of the 21 kernels launched, over every dtype, sizes around the chunk and the
    vector width, misaligned and strided leaves, special values, and the scales that
    take each branch (1: nothing written; 0.25: overflows made by the unscale)."""
    r = run(max_grid=3)
    rng = np.random.default_rng(0)
    cases = 0
    for dtype in DTYPES:
        per_chunk = 64 * 1024 // dtype.itemsize
        for special in (False, True):
            for op in OPS:
                for scale in SCALES:
                    block = values(rng, dtype, per_chunk + 37, special)
                    strided = values(rng, dtype, 30, special).reshape(5, 6).T
                    host = [
                        values(rng, dtype, 1, special),
                        values(rng, dtype, 513, special),
                        block,
                        values(rng, dtype, 2 * per_chunk + 9, special)[1:],  # misaligned
                        np.empty(0, dtype),
                    ]
                    got, want = r.both(op, host, scale, max_norm=0.5)
                    assert_same(got, want, f"{op} {dtype} special={special} scale={scale}")
                    # the strided leaf goes through a contiguous copy and back
                    got, want = r.both(op, [strided], scale, max_norm=0.5)
                    assert_same(got, want, f"{op} {dtype} strided scale={scale}")
                    cases += 2
    entry = {f"sc_{op}_{dt}" for op in KERNEL_OPS for dt in KERNEL_DTYPES} | {"sc_norm_finish"}
    launched = {name for name, _ in r.gpu.launches}
    assert launched == entry, sorted(entry ^ launched)
    summary_line(
        f"CUDA kernels on the CPU: {cases} cases bit for bit, {len(r.gpu.launches)} launches "
        f"of all {len(launched)} entry points, 4 dtypes"
    )


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    sizes = draw(st.lists(st.integers(0, 40_000 // dtype.itemsize), min_size=1, max_size=4))
    return {
        "op": draw(st.sampled_from(OPS)),
        "dtype": dtype,
        "sizes": sizes,
        "offsets": draw(st.lists(st.integers(0, 7), min_size=len(sizes), max_size=len(sizes))),
        "special": draw(st.booleans()),
        "scale": draw(st.sampled_from([*SCALES, 2.0**-20, 1e30, 0.7])),
        "device_scale": draw(st.booleans()),
        "max_norm": draw(st.sampled_from([1e-3, 1.0, 1e6])),
        "grid": draw(st.integers(1, 5)),
        "seed": draw(st.integers(0, 3)),
        "rng": draw(st.integers(0, 2**32 - 1)),
    }


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # make() resets
@given(case=cases())
def test_any_layout_scale_and_grid_gives_the_references_bits(
    run: Callable[..., Run], case: dict[str, Any]
) -> None:
    """Sizes, misaligned starts, host and device scales, grid caps (the grid-stride loop)
    and the order threads run between barriers (``seed``): always the reference's bits."""
    r = run(max_grid=case["grid"], seed=case["seed"])
    rng = np.random.default_rng(case["rng"])
    dtype = case["dtype"]
    host = [
        values(rng, dtype, n + off, case["special"])[off:]
        for n, off in zip(case["sizes"], case["offsets"], strict=True)
    ]
    scale = case["scale"]
    device = np.array(scale, np.float32) if case["device_scale"] else scale
    got, want = r.both(case["op"], host, device, max_norm=case["max_norm"])
    assert_same(got, want, str({k: v for k, v in case.items() if k != "rng"}))


@pytest.mark.parametrize("bad", [0.0, np.inf, np.nan, -2.0, 1e-45])
def test_a_bad_device_scale_fails_closed_on_every_element(
    run: Callable[..., Run], bad: float
) -> None:
    """A device scale is never read back: a bad one makes every unscaled element NaN and
    sets the flag, in the kernels themselves."""
    r = run()
    host = [np.ones(100, dtype) for dtype in DTYPES]
    dev = [r.gpu.view(a) for a in host]
    _, found = _ops.unscale(r.backend, dev, r.gpu.view(np.array(bad, np.float32)))
    assert bool(r.gpu.host(found))
    assert all(np.isnan(a.astype(np.float64)).all() for a in host)


#: Kernel bugs a CPU run must catch: (what, the source's text, the bug).
PLANTED = {
    "reduction tree one level short": (
        "for (int s = SC_BLOCK / 2; s > 0; s >>= 1)",
        "for (int s = SC_BLOCK / 2; s > 1; s >>= 1)",
    ),
    "tail loop one short": (
        "for (long long i = done + threadIdx.x; i < n; i += blockDim.x)",
        "for (long long i = done + threadIdx.x; i < n - 1; i += blockDim.x)",
    ),
    "the OR taken from one thread": (
        "if (__syncthreads_or(bad) && threadIdx.x == 0)",
        "if (__syncthreads_or(bad && threadIdx.x == 0) && threadIdx.x == 0)",
    ),
    "a missing barrier in the block's sum": (
        "sums[threadIdx.x + s]);\n        __syncthreads();",
        "sums[threadIdx.x + s]);\n",
    ),
}


def _sweep(r: Run) -> None:
    """A short run of the first test's checks (the bugs above show in any dtype)."""
    rng = np.random.default_rng(1)
    for op in ("unscale", "unscale_norm", "clip"):
        host = [values(rng, np.dtype(np.float32), 70_001, special=False)]
        host[0][rng.integers(0, host[0].size, 3)] = np.nan if op == "unscale" else 1.0
        got, want = r.both(op, host, 3.0, max_norm=0.5)
        assert_same(got, want, op)


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_planted_kernel_bug_is_caught(
    kernels: Any, cupy: Any, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    from scaler_core.backends import _cupy

    text, bug = PLANTED[name]
    assert SOURCE.count(text) == 1, f"the kernel source no longer holds {text!r}"
    broken = BUILD.build(SOURCE.replace(text, bug))
    monkeypatch.setattr(_cupy, "_TABLES", type(_cupy._TABLES)())
    monkeypatch.setattr(_cupy, "_PLANS", type(_cupy._PLANS)())
    monkeypatch.setattr(_cupy, "_GPU", BUILD.HostGpu(kernels, cupy, max_grid=2))
    _sweep(Run(_cupy._GPU))  # the real kernels pass the sweep
    monkeypatch.setattr(_cupy, "_PLANS", type(_cupy._PLANS)())
    monkeypatch.setattr(_cupy, "_GPU", BUILD.HostGpu(broken, cupy, max_grid=2))
    with pytest.raises((AssertionError, RuntimeError)):
        _sweep(Run(_cupy._GPU))


def test_the_build_refuses_an_instruction_it_does_not_know() -> None:
    """A new PTX instruction in the source stops the CPU build instead of being skipped."""
    with pytest.raises(BUILD.BuildError, match=r"min\.f32"):
        BUILD.rewrite(SOURCE.replace("mul.rn.f32 %0, %1, %2;", "min.f32 %0, %1, %2;"))
    extra = (
        'float f(float a) { float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(a)); }'
    )
    with pytest.raises(BUILD.BuildError, match="13 asm statements"):
        BUILD.rewrite(SOURCE + "\n" + extra + "\n")


#: The contract's checks that run CuPy's own elementwise kernels (the leaf report's
#: counts, the loss's product, the namespace's operations, the device transition), not
#: ours: those run on a GPU.
GPU_ONLY_CHECKS = ("leaf_report", "namespace", "scale_loss", "update")


@pytest.mark.parametrize("check", [c for c in BACKEND_CHECKS if c not in GPU_ONLY_CHECKS], ids=str)
def test_the_contract_suite_passes_on_the_cpu_build(
    kernels: Any, cupy: Any, monkeypatch: pytest.MonkeyPatch, check: str
) -> None:
    """The CuPy backend, its GPU replaced by the CPU build and its flags by NumPy on the
    same memory, keeps every rule of the contract that its kernels carry."""
    from scaler_core.backends import _cupy

    gpu = BUILD.HostGpu(kernels, cupy, max_grid=3)
    monkeypatch.setattr(_cupy, "_GPU", gpu)
    monkeypatch.setattr(_cupy, "_TABLES", type(_cupy._TABLES)())
    monkeypatch.setattr(_cupy, "_PLANS", type(_cupy._PLANS)())
    monkeypatch.setattr(_cupy, "NAMESPACE", BUILD.host_namespace(gpu, _cupy.CupyNamespace))
    ran = check_backend(
        _cupy.CupyBackend(),
        asarray=lambda a: gpu.view(np.array(a, copy=True)),
        to_numpy=lambda a: gpu.host(a).copy(),
        only=[check],
    )
    assert ran == [check]
