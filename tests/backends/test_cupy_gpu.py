"""The CuPy backend on a real GPU: NumPy-equal results, no host sync, CUDA graphs.

Where CuPy sees no GPU, the cases run on the CPU build of the same kernels
(``cuda_on_cpu/``, as ``test_cupy_on_cpu.py`` uses it): the backend's own launch code
and the kernels' arithmetic, on CuPy arrays over host memory. The cases that need
what only a GPU has (CuPy's own elementwise kernels, as the device transition and
``scale_loss`` use; streams, CUDA graphs, NCCL, DLPack, PyTorch's CUDA kernels, the
no-synchronisation guards) are marked ``gpu_only`` and skipped there, with the
reason. Skipped altogether where CuPy, or (without a GPU) a C++ compiler, is
missing. Everything is
compared with the NumPy reference backend: values bit for bit (a NaN may carry
another payload: GPUs produce the canonical NaN), flags exactly. Norms are
compared with an exactly summed float64 reference and with the NumPy backend's,
to within one float32 ulp; clipped values bit for bit with the reference
arithmetic given the same coefficient.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from common_floats import BF16, DTYPES, UINT
from common_loading import load_file
from hypothesis import given, settings

import scaler_core as sc
from scaler_core import _ops
from scaler_core._state import DATA_FIELDS, convert_fields, host_update
from scaler_core.testing import configs, flag_sequences

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda13x)")
try:
    _N_GPUS = int(cupy.cuda.runtime.getDeviceCount())
    _WHY = "" if _N_GPUS > 0 else "CuPy sees 0 CUDA devices"
except Exception as exc:  # no driver / no device
    _N_GPUS, _WHY = 0, f"no usable CUDA GPU ({type(exc).__name__}: {exc})"
#: No GPU: the cases run on the CPU build of the kernels.
ON_CPU = _N_GPUS == 0
_HERE = Path(__file__).resolve().parent
if ON_CPU:
    BUILD = load_file(_HERE / "cuda_on_cpu" / "build.py", "cuda_on_cpu")
    if BUILD.compiler() is None:
        pytest.skip(
            f"GPU tests of the CuPy backend: {_WHY}, and no C++ compiler to build the kernels "
            f"for the CPU",
            allow_module_level=True,
        )
    HOST = BUILD.HostGpu(
        BUILD.build((_HERE.parents[1] / "backends" / "_cupy_kernels.cu").read_text("utf-8")),
        cupy,
        max_grid=6,
    )
gpu_only = pytest.mark.skipif(ON_CPU, reason=f"needs a GPU ({_WHY}): not in the CPU build")

from scaler_core import cupy as sc_cupy  # noqa: E402
from scaler_core._ops import clip_coefficient  # noqa: E402
from scaler_core.backends import _cupy  # noqa: E402 - only where CuPy and a GPU exist
from scaler_core.backends._common import inv_scale_of  # noqa: E402
from scaler_core.backends._numpy_reference import (  # noqa: E402
    NumpyReferenceBackend,
    clip_in_place,
    unscaled_copy,
)

NP = NumpyReferenceBackend()  # the reference implementation is the oracle
CP = _cupy.CupyBackend() if ON_CPU else sc.get_backend("cupy")
NUMPY = sc.get_backend("numpy")  # the fast NumPy backend, for the norms


@pytest.fixture(autouse=True, scope="module")
def _cpu_build() -> Iterator[None]:
    """Without a GPU: the backend's GPU is the CPU build, its flags NumPy on the same memory."""
    if not ON_CPU:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_cupy, "_GPU", HOST)
        mp.setattr(_cupy, "NAMESPACE", BUILD.host_namespace(HOST, _cupy.CupyNamespace))
        mp.setattr(_cupy, "_TABLES", type(_cupy._TABLES)())
        mp.setattr(_cupy, "_PLANS", type(_cupy._PLANS)())
        yield


class _HostArrays:
    """What the cases make arrays with, on the CPU build: NumPy memory seen as CuPy."""

    @staticmethod
    def asarray(value: Any, dtype: Any = None) -> Any:
        return HOST.view(np.array(value, dtype=dtype))

    @staticmethod
    def ones(shape: Any, dtype: Any = np.float64) -> Any:
        return HOST.view(np.ones(shape, dtype))

    @staticmethod
    def zeros(shape: Any, dtype: Any = np.float64) -> Any:
        return HOST.view(np.zeros(shape, dtype))

    @staticmethod
    def full(shape: Any, value: Any, dtype: Any = None) -> Any:
        return HOST.view(np.full(shape, value, dtype))


#: Array creation: CuPy's on a GPU, host memory seen as CuPy arrays on the CPU build.
xp: Any = _HostArrays() if ON_CPU else cupy


def get(dev: Any) -> Any:
    """A device array's value on the host (``dev.get()``)."""
    return HOST.host(dev).copy() if ON_CPU else dev.get()


def to_device(state: sc.ScalerState) -> sc.ScalerState:
    """``scaler_core.cupy.to_device``; on the CPU build, the fields as host-memory arrays."""
    if not ON_CPU:
        return sc_cupy.to_device(state)
    return convert_fields(
        state,
        lambda v: HOST.view(np.array(v, np.float32)),
        lambda v: HOST.view(np.array(v, np.int32)),
    )


def put(dev: Any, index: Any, value: Any) -> None:
    """``dev[index] = value`` (through the host memory on the CPU build)."""
    if ON_CPU:
        HOST.host(dev)[index] = value
    else:
        dev[index] = value


# ------------------------------------------------------------------ helpers
@pytest.fixture(autouse=True, scope="module")
def _quiet_numpy_reference() -> Any:
    # The NumPy reference overflows to inf on purpose here; NumPy would warn about it.
    with np.errstate(all="ignore"):
        yield


def plan_of(grads: Any) -> Any:
    """The backend's launch plan for ``grads`` (the cached one for arrays seen before)."""
    return _cupy._plan_of(CP.plan(grads, writable=True))


def device_copy(host: np.ndarray) -> Any:
    """A contiguous device copy (through a same-size uint view: works for bfloat16 too)."""
    host = np.array(host, order="C")  # a copy; unlike ascontiguousarray it keeps 0-d arrays 0-d
    if ON_CPU:
        return HOST.view(host)
    return cupy.asarray(host.view(UINT[host.dtype.itemsize])).view(host.dtype)


def to_host(dev: Any) -> np.ndarray:
    if ON_CPU:
        return HOST.host(dev).copy()
    return cupy.asnumpy(dev.view(UINT[dev.dtype.itemsize])).view(dev.dtype)


def copy_into(dst: Any, src: Any) -> None:
    """``dst[...] = src`` through same-size uint views (no bfloat16 arithmetic kernels)."""
    u = UINT[dst.dtype.itemsize]
    if ON_CPU:
        HOST.host(dst.view(u))[...] = HOST.host(src.view(u))
    else:
        dst.view(u)[...] = src.view(u)


def set_value(dev: Any, host: np.ndarray, index: int, value: float) -> None:
    """Write ``value`` at ``index`` of a 1-D device array and its host twin."""
    host[index] = value
    u = UINT[dev.dtype.itemsize]
    put(dev.view(u), index, int(np.asarray(value, dev.dtype).view(u)))


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert got.dtype == want.dtype, what
    assert got.shape == want.shape, what
    got, want = np.array(got).reshape(-1), np.array(want).reshape(-1)
    gnan = np.isnan(got.astype(np.float64))
    wnan = np.isnan(want.astype(np.float64))
    np.testing.assert_array_equal(gnan, wnan, err_msg=f"NaN positions differ {what}")
    u = UINT[got.dtype.itemsize]
    gb, wb = got.view(u)[~gnan], want.view(u)[~wnan]
    bad = np.flatnonzero(gb != wb)
    assert bad.size == 0, (
        f"{bad.size} elements differ {what}: got {got[~gnan][bad[:5]]!r}, "
        f"want {want[~wnan][bad[:5]]!r}"
    )


def values(rng: np.random.Generator, shape: Any, dtype: np.dtype[Any], p_special: float) -> Any:
    """Values over the dtype's whole range (subnormals and near-max included), some NaN/inf."""
    n = int(np.prod(shape))
    top = {2: 14, 4: 100, 8: 300}[dtype.itemsize] if dtype != BF16 else 100
    low = {2: -24, 4: -140, 8: -1060}[dtype.itemsize] if dtype != BF16 else -130
    mag = rng.standard_normal(n) * 2.0 ** rng.integers(low, top, n).astype(np.float64)
    finite = float(ml_dtypes.finfo(dtype).max)
    x = np.clip(mag, -finite, finite).astype(dtype)
    special = rng.random(n) < p_special
    x[special] = rng.choice(np.array([np.nan, np.inf, -np.inf]), special.sum()).astype(dtype)
    return x.reshape(shape)


def layouts(rng: np.random.Generator, dtype: np.dtype[Any], p: float) -> list[tuple[str, Any]]:
    """``(name, host array)`` in every layout the backend must handle."""
    return [
        ("0-d", values(rng, (), dtype, p)),
        ("empty", values(rng, (0,), dtype, p)),
        ("small odd", values(rng, (7,), dtype, p)),
        ("2-D", values(rng, (33, 65), dtype, p)),
        ("multi-chunk", values(rng, (_cupy.CHUNK_BYTES // dtype.itemsize * 2 + 13,), dtype, p)),
        ("transposed", values(rng, (40, 31), dtype, p)),
        ("strided", values(rng, (301,), dtype, p)),
        ("misaligned", values(rng, (1001,), dtype, p)),
    ]


def device_layout(name: str, host: np.ndarray) -> Any:
    """A device array holding ``host``'s values in the named layout."""
    if name == "transposed":
        return device_copy(host.T).T
    if name == "strided":
        big = np.zeros(host.size * 3, host.dtype)
        big[::3] = host
        return device_copy(big)[::3]
    if name == "misaligned":
        big = np.concatenate([np.zeros(1, host.dtype), host])
        return device_copy(big)[1:]
    return device_copy(host)


def make_case(
    seed: int, dtypes: list[np.dtype[Any]], p: float
) -> tuple[list[Any], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    dev, host = [], []
    for dt in dtypes:
        for name, h in layouts(rng, dt, p):
            d = device_layout(name, h)
            assert d.flags.c_contiguous == (name not in ("transposed", "strided")), name
            dev.append(d)
            host.append(h.copy())
    return dev, host


# ---------------------------------------------------------- the protocol
@gpu_only
def test_backend_is_found_from_cupy_arrays() -> None:
    assert isinstance(CP, sc.Backend)
    assert sc.backend_for([xp.ones(3, np.float32)]) is CP
    assert "cupy" in sc.available_backends()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 65536.0, 3.0, 2.0**-10, 1e-30, 2.0**120])
@pytest.mark.parametrize("p_special", [0.0, 0.001])
def test_unscale_equals_numpy_bit_for_bit(dtype: Any, scale: float, p_special: float) -> None:
    dev, host = make_case(1234, [dtype], p_special)
    _, found = _ops.unscale(CP, dev, scale)
    _, want = _ops.unscale(NP, host, scale)
    assert isinstance(found, cupy.ndarray)
    assert found.shape == ()
    assert found.dtype == np.bool_
    assert bool(get(found)) == bool(want)
    for d, h in zip(dev, host, strict=True):
        assert_same_bits(to_host(d), h, f"{d.shape} {d.strides}")


@pytest.mark.parametrize("where", ["float16", "bfloat16", "float32", "float64", "none"])
def test_mixed_dtypes_in_one_call(where: str) -> None:
    dev, host = make_case(7, DTYPES, 0.0)
    for d, h in zip(dev, host, strict=True):
        if d.dtype.name == where and d.ndim == 1 and d.size > 100:
            set_value(d, h, -1, np.nan)
            assert np.isnan(to_host(d).astype(np.float64)).any()
    _, found = _ops.unscale(CP, {"layers": dev}, 512.0)
    _, want = _ops.unscale(NP, {"layers": host}, 512.0)
    assert bool(get(found)) == bool(want) == (where != "none")
    for d, h in zip(dev, host, strict=True):
        assert_same_bits(to_host(d), h)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_overflow_made_by_the_unscale_itself_is_found(dtype: Any) -> None:
    finite = {"float16": 65504.0, "bfloat16": 1e38, "float32": 1e33, "float64": 1e303}
    big = np.array([finite[dtype.name], 0.0], dtype)
    g = device_copy(big)
    assert not bool(get(_ops.find_non_finite(CP, [g])))
    _, found = _ops.unscale(CP, [g], 2.0**-20)
    assert bool(get(found))
    assert np.isinf(to_host(g).astype(np.float64)).tolist() == [True, False]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_find_non_finite_reads_only(dtype: Any) -> None:
    for p in (0.0, 0.0005):
        dev, host = make_case(99, [dtype], p)
        before = [to_host(d).copy() for d in dev]
        found = _ops.find_non_finite(CP, dev)
        assert bool(get(found)) == bool(_ops.find_non_finite(NP, host))
        for d, b in zip(dev, before, strict=True):
            assert_same_bits(to_host(d), b)


def test_single_inf_anywhere_in_a_large_array_is_found() -> None:
    n = _cupy.CHUNK_BYTES // 4 * 3 + 5
    g = xp.ones(n, np.float32)
    assert not bool(get(_ops.find_non_finite(CP, [g])))
    for pos in (0, 1, _cupy.CHUNK_BYTES // 4 - 1, _cupy.CHUNK_BYTES // 4, n // 2, n - 1):
        put(g, pos, np.inf)
        assert bool(get(_ops.find_non_finite(CP, [g]))), pos
        put(g, pos, 1.0)


def test_two_thousand_small_arrays_reuse_one_plan_and_table() -> None:
    rng = np.random.default_rng(3)
    host = [rng.standard_normal(1024 + (i % 3)).astype(np.float32) for i in range(2000)]
    host[1999][17] = np.nan
    dev = [device_copy(h) for h in host]
    _, found = _ops.unscale(CP, dev, 4.0)
    _, want = _ops.unscale(NP, host, 4.0)
    assert bool(get(found))
    assert bool(want)
    for d, h in zip(dev, host, strict=True):
        assert_same_bits(to_host(d), h)
    plan = plan_of(dev)
    tables = dict(_cupy._TABLES)
    put(dev[1999], 17, 1.0)
    _, found = _ops.unscale(CP, dev, 4.0)
    assert not bool(get(found))
    assert plan_of(dev) is plan
    assert dict(_cupy._TABLES).keys() == tables.keys()


def test_same_array_twice_is_unscaled_once() -> None:
    g = xp.full(10, 8.0, np.float32)
    _ops.unscale(CP, {"a": g, "b": [g, None]}, 2.0)
    assert to_host(g).tolist() == [4.0] * 10


def test_device_scale_gives_the_host_scale_result() -> None:
    state = to_device(sc.init(sc.ScalerConfig(init_scale=3.0)))
    a, host = make_case(5, DTYPES, 0.001)
    b, _ = make_case(5, DTYPES, 0.001)
    _, fa = _ops.unscale(CP, a, state.scale)
    _, fb = _ops.unscale(CP, b, 3.0)
    _, fh = sc.unscale(host, 3.0)
    assert bool(get(fa)) == bool(get(fb)) == bool(fh)
    for x, y, h in zip(a, b, host, strict=True):
        assert_same_bits(to_host(x), to_host(y))
        assert_same_bits(to_host(x), h)


def test_rejected_call_modifies_nothing() -> None:
    good = xp.full(5, 4.0, np.float32)
    for grads, scale in (([good, xp.ones(3, np.int32)], 2.0), ([good], 0.0)):
        with pytest.raises(sc.InvalidGradientError):
            _ops.unscale(CP, grads, scale)
        assert to_host(good).tolist() == [4.0] * 5


# ------------------------------------------------------- the rest of the API
@gpu_only
def test_select_any_and_scale_loss() -> None:
    a = device_copy(np.array([np.nan, -0.0, 1.5], np.float32))
    b = xp.zeros(3, np.float32)
    t, f = xp.asarray(True), xp.asarray(False)
    out = CP.select(t, {"p": [a, None]}, {"p": [b, None]})
    assert out["p"][1] is None
    assert_same_bits(to_host(out["p"][0]), to_host(a))
    assert_same_bits(to_host(CP.select(f, [a], [b])[0]), np.zeros(3, np.float32))
    assert bool(get(CP.any(f, f))) is False
    assert bool(get(CP.any(f, t, False))) is True
    assert bool(get(CP.any())) is False
    for dtype in DTYPES:
        loss = device_copy(np.array(1.5, dtype))
        got = CP.scale_loss(loss, 1024.0)
        want = NP.scale_loss(np.array(1.5, dtype), 1024.0)
        assert got.dtype == np.asarray(want).dtype
        assert float(get(got)) == float(want)
    state = to_device(sc.init())
    assert float(get(CP.scale_loss(xp.asarray(2.0, np.float32), state.scale))) == 131072.0


def test_to_bool_is_the_one_read() -> None:
    assert CP.to_bool(xp.asarray(True)) is True
    assert CP.to_bool(np.bool_(False)) is False


@gpu_only
def test_collapse_is_recorded_on_device_and_raised_at_the_first_host_look() -> None:
    cfg = sc.ScalerConfig(init_scale=2.0**-125, backoff_factor=0.5)
    state = to_device(sc.init(cfg))
    yes = xp.asarray(True)
    state = sc.update(state, yes)  # 2**-126: still normal
    state = sc.update(state, yes)  # would be subnormal: refused, recorded
    state = sc.update(state, yes)  # frozen
    assert int(get(state.failure)) == int(sc.Failure.COLLAPSE)
    assert float(get(state.scale)) == 2.0**-126
    for look in (state.check, state.current_scale, lambda: sc.to_dict(state)):
        with pytest.raises(sc.ScaleCollapseError, match="recorded"):
            look()
    # to_device moves the recorded failure along (as scaler_core.jax.to_device does).
    moved = to_device(state)
    assert int(get(moved.failure)) == int(sc.Failure.COLLAPSE)
    with pytest.raises(sc.ScaleCollapseError, match="recorded"):
        moved.check()


@gpu_only
@settings(max_examples=25, deadline=None)
@given(cfg=configs(), flags=flag_sequences(max_size=40))
def test_device_transition_equals_host_transition(cfg: sc.ScalerConfig, flags: list[bool]) -> None:
    host = sc.init(cfg)
    dev = to_device(host)
    failed: type[Exception] | None = None
    for flag in flags:
        dev = sc.update(dev, xp.asarray(flag))
        if failed is None:
            try:
                host = host_update(host, flag)
            except sc.ScaleCollapseError as exc:
                failed = type(exc)
        kept = [n for n in DATA_FIELDS if n != "failure"]
        got = [get(getattr(dev, n)).item() for n in kept]
        want = [getattr(host, n) for n in kept]
        assert got == want
        assert (int(get(dev.failure)) != 0) == (failed is not None)
    if failed is not None:
        with pytest.raises(failed):
            dev.check()
    else:
        assert dev.to_host() == host


@gpu_only
def test_grad_scaler_with_a_device_state_matches_numpy() -> None:
    cfg = sc.ScalerConfig(init_scale=1024.0, growth_interval=2)
    gpu = sc.LossScaler(state=to_device(sc.init(cfg)))
    cpu = sc.LossScaler(cfg)
    rng = np.random.default_rng(0)
    for step in range(6):
        h = [rng.standard_normal(100).astype(np.float16), rng.standard_normal(7).astype("f4")]
        if step == 2:
            h[0][3] = np.inf
        d = [device_copy(x) for x in h]
        gpu.unscale(d)
        cpu.unscale(h)
        assert gpu.should_skip_step() == cpu.should_skip_step() == (step == 2)
        gpu.update()
        cpu.update()
        for x, y in zip(d, h, strict=True):
            assert_same_bits(to_host(x), y)
        assert gpu.state.to_host() == cpu.state


# ------------------------------------------------------------- no host sync
_SYNCING = ("get", "item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__array__")


def _forbid(*_args: Any, **_kwargs: Any) -> None:
    raise AssertionError("a host synchronisation happened inside the step")


@gpu_only
def test_the_step_performs_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = sc.ScalerConfig(init_scale=256.0, growth_interval=3)
    state = to_device(sc.init(cfg))
    base = xp.full(9, 2.0, np.float64)
    grads = {
        "w": [device_copy(np.full(5000, 256.0, np.float16)), xp.full((64, 64), 512.0, "f4")],
        "b": base[::2],  # non-contiguous: unscaled through a contiguous copy
    }
    params = [xp.ones(10, np.float32)]
    scaler = sc.LossScaler(state=state)
    # Warm up: compile the kernels and upload the chunk tables once.
    _ops.unscale(CP, grads, state.scale)
    _ops.find_non_finite(CP, grads)
    cupy.cuda.Stream.null.synchronize()
    for name in _SYNCING:
        monkeypatch.setattr(cupy.ndarray, name, _forbid, raising=False)
    monkeypatch.setattr(cupy, "asnumpy", _forbid)
    guard = getattr(__import__("cupyx"), "allow_synchronize", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # allow_synchronize is "experimental"
        with guard(False) if guard is not None else _Null():
            _, found = sc.unscale(grads, state)
            again = sc.find_non_finite(grads)
            flag = CP.any(found, again)
            new_state = sc.update(state, flag)
            new_params = CP.select(flag, params, [p * 0.5 for p in params])
            scaler.unscale(grads)
            after = scaler.update()
            loss = CP.scale_loss(xp.ones((), np.float32), new_state.scale)
    monkeypatch.undo()
    assert not bool(get(flag))
    # 256 -> 1 (warm-up) -> 2**-8 (functional API) -> 2**-16 (LossScaler): all exact.
    assert to_host(grads["w"][0]).tolist()[:2] == [2.0**-16, 2.0**-16]
    assert to_host(base).tolist() == [2.0**-23, 2.0] * 4 + [2.0**-23]
    assert new_state.to_host().growth_tracker == 1
    assert after.to_host().growth_tracker == 1
    assert to_host(new_params[0]).tolist() == [0.5] * 10
    assert float(get(loss)) == 256.0


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# --------------------------------------------------------------- CUDA graphs
@gpu_only
def test_cuda_graph_capture_and_replay_of_unscale_detect_update() -> None:
    cfg = sc.ScalerConfig(init_scale=2.0**10, growth_interval=3)
    rng = np.random.default_rng(11)
    shapes = [((4099,), np.float32), ((64, 33), np.float16), ((300,), np.float64), ((77,), BF16)]
    n_steps = 12
    nan_steps = {2, 3, 7}
    sources_host = []
    for k in range(n_steps):
        hs = [(rng.standard_normal(s) * 1000).astype(dt) for s, dt in shapes]
        if k in nan_steps:
            hs[k % len(hs)].reshape(-1)[5] = np.nan
        sources_host.append(hs)
    sources = [[device_copy(h) for h in hs] for hs in sources_host]
    grads = [xp.zeros(s, dt) for s, dt in shapes]
    state = to_device(sc.init(cfg))
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the setup ran on the null stream

    def step() -> Any:
        _, found = _ops.unscale(CP, grads, state.scale)
        new = CP.update(state, found)
        for name in DATA_FIELDS:  # fixed buffers: the graph writes the next state in place
            getattr(state, name)[...] = getattr(new, name)
        return found

    with stream:
        step()  # warm-up: compiles, uploads the table
        for name, value in zip(DATA_FIELDS, _host_values(sc.init(cfg)), strict=True):
            getattr(state, name)[...] = value
        pool = cupy.cuda.MemoryPool()  # the graph's temporaries stay reserved for it
        with cupy.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            found = step()
            graph = stream.end_capture()
    assert all(any(t is p for p in _cupy._PINNED) for t in (g.table for g in plan_of(grads).groups))
    host_state = sc.init(cfg)
    for i in range(n_steps):
        with stream:
            for g, src in zip(grads, sources[i], strict=True):
                copy_into(g, src)
            graph.launch(stream)
        stream.synchronize()
        expect = [h.copy() for h in sources_host[i]]
        _, want = _ops.unscale(NP, expect, host_state.scale)
        host_state = host_update(host_state, bool(want))
        assert bool(get(found)) == bool(want) == (i in nan_steps)
        for g, e in zip(grads, expect, strict=True):
            assert_same_bits(to_host(g), e, f"step {i}")
        assert state.to_host() == host_state, f"step {i}"
    assert host_state.steps == n_steps
    assert host_state.skipped_steps == len(nan_steps)


def _host_values(state: sc.ScalerState) -> list[Any]:
    return [getattr(state, n) for n in DATA_FIELDS]


# -------------------------------------------------------------- multi-GPU
@gpu_only
def test_nccl_found_reducer_on_one_rank() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from cupy.cuda import nccl
    if not getattr(nccl, "available", False):
        pytest.skip("NCCL is not installed for CuPy (pip install nvidia-nccl-cu13)")
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    reduce_found = sc_cupy.found_reducer(comm)
    for flag in (False, True):
        out = reduce_found(xp.asarray(flag))
        assert out.shape == ()
        assert out.dtype == np.bool_
        assert bool(get(out)) is flag
    scaler = sc.LossScaler(reduce_found=reduce_found)
    scaler.unscale([xp.full(3, np.inf, np.float32)])
    assert scaler.should_skip_step() is True


# ------------------------------------------------------ PyTorch through DLPack
@gpu_only
def test_pytorch_cuda_tensors_through_dlpack_are_unscaled_in_place() -> None:
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    t = torch.full((1000,), 65536.0, device="cuda")
    h = torch.full((10,), 2048.0, device="cuda", dtype=torch.float16)
    grads = [cupy.from_dlpack(t), cupy.from_dlpack(h)]
    _, found = _ops.unscale(CP, grads, 65536.0)
    assert bool(get(found)) is False
    assert torch.equal(t, torch.ones_like(t))
    assert torch.equal(h, torch.full_like(h, 2048.0 / 65536.0))


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_pytorch_kernel_where_semantics_agree(dtype: Any) -> None:
    """Oracle: PyTorch's fused kernel on the same data (inv_scale < 1: no overflow from it)."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    signed = {2: np.int16, 4: np.int32, 8: np.int64}[dtype.itemsize]
    tdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype.name)
    tdtype = tdtype or {"float32": torch.float32, "float64": torch.float64}[dtype.name]
    rng = np.random.default_rng(8)
    host = values(rng, (5000,), dtype, 0.001)
    theirs = torch.from_numpy(host.view(signed).copy()).cuda().view(tdtype)
    found_t = torch.zeros(1, device="cuda")
    inv = torch.full((1,), float(np.float32(1.0 / 1024.0)), device="cuda")
    torch._amp_foreach_non_finite_check_and_unscale_([theirs], found_t, inv)
    ours = device_copy(host)
    _, found = _ops.unscale(CP, [ours], 1024.0)
    assert bool(get(found)) == bool(found_t.item())
    tsigned = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    back = theirs.view(tsigned).cpu().numpy().view(dtype)
    assert_same_bits(to_host(ours), back)


@gpu_only
def test_streams_are_respected() -> None:
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        g = xp.full(1 << 20, 2.0, np.float32)
        _, found = _ops.unscale(CP, [g], 2.0)
    s.synchronize()
    assert not bool(get(found))
    assert float(get(g[-1])) == 1.0


def test_flags_are_device_arrays_on_the_arrays_device() -> None:
    g = xp.ones(4, np.float32)
    found = _ops.find_non_finite(CP, [g])
    assert found.device.id == g.device.id


@gpu_only
@pytest.mark.parametrize("bad", [-2.0, 0.0, np.inf, np.nan, 1e-40])
def test_a_bad_device_scale_fails_closed_without_a_host_read(bad: float) -> None:
    """A device scale is not read back (that would synchronise); a bad one makes every
    gradient NaN and sets the flag, so the step is skipped and the update records a
    collapse, where a sign flip or a zero would have trained on silently."""
    grads = [device_copy(np.ones(8, np.float32))]
    _, found = _ops.unscale(CP, grads, xp.asarray(bad, np.float32))
    assert bool(get(found))
    assert not np.isfinite(to_host(grads[0])).any()
    loss = CP.scale_loss(xp.ones((), np.float32), xp.asarray(bad, np.float32))
    assert not np.isfinite(float(get(loss)))


# ------------------------------------------------------------ norm and clipping
LAYOUTS = ["0-d", "empty", "small odd", "2-D", "multi-chunk", "transposed", "strided", "misaligned"]


def clip_values(rng: np.random.Generator, shape: Any, dtype: np.dtype[Any]) -> Any:
    """Finite values over most of the dtype's range, subnormals included, with a float32 norm."""
    n = int(np.prod(shape))
    low, top = {"float16": (-26, 8), "bfloat16": (-134, 40)}.get(dtype.name, (-150, 40))
    if dtype.name == "float64":
        low = -1070
    mag = rng.standard_normal(n) * 2.0 ** rng.integers(low, top, n).astype(np.float64)
    return mag.astype(dtype).reshape(shape)


def clip_case(seed: int, dtypes: list[np.dtype[Any]]) -> tuple[list[Any], list[np.ndarray]]:
    """Device arrays in every layout and their host twins, finite values only."""
    rng = np.random.default_rng(seed)
    dev, host = [], []
    for dt in dtypes:
        for name in LAYOUTS:
            shape = {
                "0-d": (),
                "empty": (0,),
                "small odd": (7,),
                "2-D": (33, 65),
                "multi-chunk": (_cupy.CHUNK_BYTES // dt.itemsize * 2 + 13,),
                "transposed": (40, 31),
                "strided": (301,),
                "misaligned": (1001,),
            }[name]
            h = clip_values(rng, shape, dt)
            dev.append(device_layout(name, h))
            host.append(h.copy())
    return dev, host


def exact_norm(arrays: list[Any]) -> np.float32:
    """math.fsum of the float64 squares of the values, its sqrt rounded to float32."""
    squares: list[float] = []
    for a in arrays:
        squares.extend(np.square(np.asarray(a).astype(np.float64)).ravel().tolist())
    try:
        total = math.fsum(squares)
    except OverflowError:
        total = math.inf
    return np.float32(math.sqrt(total))


def ulps(a: Any, b: Any) -> int:
    """How many float32 steps apart two non-negative float32 values are."""
    bits = [int(np.asarray(x, np.float32).view(np.int32)) for x in (a, b)]
    return abs(bits[0] - bits[1])


def host_norm(norm: Any) -> np.float32:
    assert isinstance(norm, cupy.ndarray)
    assert norm.shape == ()
    assert norm.dtype == np.float32
    return np.float32(get(norm))


def raw(dev: Any) -> np.ndarray:
    """The exact bytes of a device array, as unsigned ints (NaN payloads included)."""
    return to_host(dev).view(UINT[dev.dtype.itemsize]).copy()


def fresh(host: list[np.ndarray]) -> tuple[list[Any], list[np.ndarray]]:
    """Device copies (contiguous) and host copies of the same values."""
    return [device_copy(h) for h in host], [h.copy() for h in host]


def expected_clip(host: list[np.ndarray], scale: float, coef: np.float32) -> list[np.ndarray]:
    """The reference arithmetic: unscale's stored value times ``coef``, in each dtype."""
    inv = inv_scale_of(scale)
    out = []
    with np.errstate(all="ignore"):
        for h in host:
            g = h.copy()
            clip_in_place(g, np.asarray(unscaled_copy(h, inv)), coef)
            out.append(g)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 3.0, 65536.0, 2.0**-6])
def test_unscale_norm_is_unscale_plus_the_norm(dtype: Any, scale: float) -> None:
    dev, host = clip_case(21, [dtype])
    twin = [h.copy() for h in host]
    _, found, norm = _ops.unscale_and_norm(CP, dev, scale)
    _, want = _ops.unscale(NP, host, scale)  # host now holds what unscale stores
    assert isinstance(found, cupy.ndarray)
    assert found.shape == ()
    assert found.dtype == np.bool_
    assert bool(get(found)) is bool(want) is False
    for d, h in zip(dev, host, strict=True):
        assert_same_bits(to_host(d), h, f"{d.shape} {d.strides}")
    got = host_norm(norm)
    ref = exact_norm(host)  # the stored (rounded) values, exactly summed
    assert np.isfinite(ref)
    assert ref > 0
    assert ulps(got, ref) <= 1, (got, ref)
    _, _, numpy_norm = _ops.unscale_and_norm(NUMPY, twin, scale)
    assert ulps(got, numpy_norm) <= 1, (got, numpy_norm)


def test_unscale_norm_of_a_mixed_tree() -> None:
    dev, host = clip_case(22, DTYPES)
    tree = {"layers": [dev[:8], {"h": dev[8:16]}], "rest": tuple(dev[16:])}
    _, found, norm = _ops.unscale_and_norm(CP, tree, 512.0)
    _ops.unscale(NP, host, 512.0)
    assert not bool(get(found))
    for d, h in zip(dev, host, strict=True):
        assert_same_bits(to_host(d), h)
    assert ulps(host_norm(norm), exact_norm(host)) <= 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("planted", [np.inf, -np.inf, np.nan])
def test_a_non_finite_value_gives_the_flag_and_a_non_finite_norm(
    dtype: Any, planted: float
) -> None:
    dev, host = clip_case(23, [dtype])
    set_value(dev[4], host[4], 17, planted)  # the multi-chunk leaf
    _, found, norm = _ops.unscale_and_norm(CP, dev, 4.0)
    _, want = _ops.unscale(NP, host, 4.0)
    assert bool(get(found)) is bool(want) is True
    got = host_norm(norm)
    assert np.isnan(got) if np.isnan(planted) else got == np.inf
    for d, h in zip(dev, host, strict=True):
        assert_same_bits(to_host(d), h)


def test_an_empty_tree_has_norm_zero() -> None:
    for grads in ([], [xp.zeros(0, np.float32)], {"a": None}):
        _, found, norm = _ops.unscale_and_norm(CP, grads, 2.0)
        assert not bool(get(found))
        assert host_norm(norm) == 0.0
        _, found, norm = _ops.unscale_and_clip(CP, grads, 2.0, 1.0)
        assert not bool(get(found))
        assert host_norm(norm) == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [1.0, 3.0, 65536.0])
@pytest.mark.parametrize("clips", [True, False], ids=["clips", "coef-1"])
def test_unscale_clip_equals_the_reference_arithmetic(
    dtype: Any, scale: float, clips: bool
) -> None:
    dev, host = clip_case(31, [dtype])
    inv = inv_scale_of(scale)
    with np.errstate(all="ignore"):
        ref_norm = exact_norm([np.asarray(unscaled_copy(h, inv)) for h in host])
    max_norm = float(ref_norm) / 3.0 if clips else 1e30
    _, found, norm = _ops.unscale_and_clip(CP, dev, scale, max_norm)
    assert not bool(get(found))
    got_norm = host_norm(norm)
    assert ulps(got_norm, ref_norm) <= 1, (got_norm, ref_norm)
    coef = clip_coefficient(np, got_norm, max_norm)
    assert (coef < 1.0) == clips
    for d, want in zip(dev, expected_clip(host, scale, coef), strict=True):
        assert_same_bits(to_host(d), want, f"{d.shape} {d.strides}")
    if not clips:  # coef == 1: exactly unscale's bits
        plain, _ = fresh(host)
        _ops.unscale(CP, plain, scale)
        for d, p in zip(dev, plain, strict=True):
            assert_same_bits(to_host(d), to_host(p))


def test_unscale_clip_of_a_mixed_tree_and_its_norm_is_unscale_norms() -> None:
    dev, host = clip_case(32, DTYPES)
    twin, _ = clip_case(32, DTYPES)
    _, _, norm_once = _ops.unscale_and_norm(CP, twin, 8.0)
    tree = {"a": dev[:13], "b": {"c": dev[13:], "d": None}}
    _, found, norm = _ops.unscale_and_clip(CP, tree, 8.0, 0.5)
    assert not bool(get(found))
    got = host_norm(norm)
    assert got.view(np.uint32) == host_norm(norm_once).view(np.uint32)  # the same sums
    coef = clip_coefficient(np, got, 0.5)
    assert coef < 1.0
    for d, want in zip(dev, expected_clip(host, 8.0, coef), strict=True):
        assert_same_bits(to_host(d), want)


def test_unscale_clip_matches_the_numpy_backends() -> None:
    dev, host = clip_case(33, DTYPES)
    _, found, norm = _ops.unscale_and_clip(CP, dev, 1024.0, 2.0)
    _, want_found, want_norm = _ops.unscale_and_clip(NUMPY, host, 1024.0, 2.0)
    assert bool(get(found)) is bool(want_found) is False
    got = host_norm(norm)
    assert ulps(got, want_norm) <= 1
    if got == want_norm:  # the same coefficient: the same bits
        for d, h in zip(dev, host, strict=True):
            assert_same_bits(to_host(d), h)


def test_a_norm_past_float32s_range_clips_to_zero_like_pytorch() -> None:
    g = device_copy(np.array([3e38, -3e38, 1.0, -0.0], np.float32))
    _, found, norm = _ops.unscale_and_clip(CP, [g], 1.0, 1.0)
    assert not bool(get(found))  # every value is finite
    assert host_norm(norm) == np.inf
    assert clip_coefficient(np, np.float32(np.inf), 1.0) == 0.0
    assert raw(g).tolist() == np.array([0.0, -0.0, 0.0, -0.0], np.float32).view(np.uint32).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("planted", [np.inf, np.nan])
def test_a_skipped_step_writes_nothing(dtype: Any, planted: float) -> None:
    dev, host = clip_case(41, [dtype])
    set_value(dev[6], host[6], 100, planted)  # the strided leaf
    before = [raw(d) for d in dev]
    _, found, norm = _ops.unscale_and_clip(CP, dev, 65536.0, 1e-3)
    assert bool(get(found))
    assert not np.isfinite(host_norm(norm))
    for d, b in zip(dev, before, strict=True):
        np.testing.assert_array_equal(raw(d), b)  # every byte as it was, scaled values kept


def test_reduce_decides_the_skip() -> None:
    host = clip_case(42, DTYPES)[1]
    seen: list[Any] = []

    def always_skip(flag: Any) -> Any:
        seen.append(flag)
        return xp.asarray(True)

    dev, _ = fresh(host)
    before = [raw(d) for d in dev]
    _, found, norm = _ops.unscale_and_clip(CP, dev, 4.0, 0.5, reduce=always_skip)
    [flag] = seen
    assert isinstance(flag, cupy.ndarray)
    assert flag.shape == ()
    assert flag.dtype == np.bool_
    assert bool(get(flag)) is False  # this call's own flag
    assert bool(get(found)) is True  # the decision is reduce's
    assert np.isfinite(host_norm(norm))
    for d, b in zip(dev, before, strict=True):
        np.testing.assert_array_equal(raw(d), b)
    dev, _ = fresh(host)
    _ops.unscale_and_clip(CP, dev, 4.0, 0.5, reduce=lambda flag: True)  # a host answer works too
    for d, b in zip(dev, before, strict=True):
        np.testing.assert_array_equal(raw(d), b)
    # A reduce that keeps the step gives exactly the result without one.
    dev, _ = fresh(host)
    plain, _ = fresh(host)
    other = xp.asarray(False)
    _, found, _ = _ops.unscale_and_clip(CP, dev, 4.0, 0.5, reduce=lambda flag: CP.any(flag, other))
    _ops.unscale_and_clip(CP, plain, 4.0, 0.5)
    assert bool(get(found)) is False
    for d, p in zip(dev, plain, strict=True):
        assert_same_bits(to_host(d), to_host(p))
    assert any(not np.array_equal(raw(d), b) for d, b in zip(dev, before, strict=True))


def test_norms_and_clipping_are_deterministic() -> None:
    rng = np.random.default_rng(51)
    host = [
        clip_values(rng, (int(n),), DTYPES[i % 4])
        for i, n in enumerate(rng.integers(1, 400_000, 24))
    ]
    host = [np.abs(h).astype(h.dtype) + h.dtype.type(1) for h in host]  # a big norm: clips
    runs = []
    for _ in range(3):
        dev, _ = fresh(host)
        _, _, n1 = _ops.unscale_and_norm(CP, dev, 2.0)
        dev, _ = fresh(host)
        _, _, n2 = _ops.unscale_and_clip(CP, dev, 2.0, 1.0)
        runs.append((host_norm(n1).view(np.uint32), host_norm(n2).view(np.uint32), dev))
    assert len({(int(a), int(b)) for a, b, _ in runs}) == 1
    assert runs[0][0] == runs[0][1]
    for d0, d1, d2 in zip(runs[0][2], runs[1][2], runs[2][2], strict=True):
        np.testing.assert_array_equal(raw(d0), raw(d1))
        np.testing.assert_array_equal(raw(d0), raw(d2))
    assert ulps(host_norm(n1), exact_norm([unscaled_copy(h, 0.5) for h in host])) <= 1


def test_device_scale_and_the_functional_api_give_the_host_scale_result() -> None:
    state = to_device(sc.init(sc.ScalerConfig(init_scale=3.0)))
    host = clip_case(52, DTYPES)[1]
    a, _ = fresh(host)
    b, _ = fresh(host)
    _, fa, na = _ops.unscale_and_clip(CP, a, state.scale, 0.25)
    _, fb, nb = sc.unscale_and_clip(b, 3.0, 0.25, backend=CP if ON_CPU else None)
    assert bool(get(fa)) is bool(get(fb)) is False
    assert host_norm(na).view(np.uint32) == host_norm(nb).view(np.uint32)
    for x, y in zip(a, b, strict=True):
        assert_same_bits(to_host(x), to_host(y))
    c, _ = fresh(host)
    d, _ = fresh(host)
    _, _, nc = sc.unscale_and_norm(c, state, backend=CP if ON_CPU else None)
    _, _, nd = _ops.unscale_and_norm(CP, d, 3.0)
    assert host_norm(nc).view(np.uint32) == host_norm(nd).view(np.uint32)


def test_refused_norm_and_clip_calls_modify_nothing() -> None:
    good = xp.full(5, 4.0, np.float32)
    for max_norm in (0.0, float("nan"), True, 1e39):
        with pytest.raises(sc.InvalidArgumentError, match="max_norm="):
            _ops.unscale_and_clip(CP, [good], 2.0, max_norm)
    for call in (
        lambda: _ops.unscale_and_norm(CP, [good, xp.ones(3, np.int32)], 2.0),
        lambda: _ops.unscale_and_clip(CP, [good, xp.ones(3, np.int32)], 2.0, 1.0),
        lambda: _ops.unscale_and_clip(CP, [good], 0.0, 1.0),
    ):
        with pytest.raises(sc.InvalidGradientError):
            call()
    with pytest.raises(sc.GradientTypeError, match=r"reduce\(found\)="):
        _ops.unscale_and_clip(CP, [good], 2.0, 1.0, reduce=lambda flag: "no")
    assert to_host(good).tolist() == [4.0] * 5


@gpu_only
def test_norm_and_clip_perform_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    state = to_device(sc.init(sc.ScalerConfig(init_scale=256.0)))
    base = xp.full(9, 512.0, np.float64)
    grads = {
        "w": [device_copy(np.full(5000, 256.0, np.float16)), xp.full((64, 64), 512.0, "f4")],
        "b": base[::2],  # non-contiguous: through a contiguous copy and the copy-back kernel
    }
    other = xp.asarray(False)
    one = to_device(sc.init(sc.ScalerConfig(init_scale=1.0))).scale
    # Warm up (scale 1, no clipping: nothing changes): compile the kernels, upload the tables.
    _ops.unscale_and_norm(CP, grads, one)
    _ops.unscale_and_clip(CP, grads, one, 1e30, reduce=lambda flag: CP.any(flag, other))
    _ops.unscale_and_clip(CP, grads, 1.0, 1e30)
    cupy.cuda.Stream.null.synchronize()
    for name in _SYNCING:
        monkeypatch.setattr(cupy.ndarray, name, _forbid, raising=False)
    monkeypatch.setattr(cupy, "asnumpy", _forbid)
    guard = getattr(__import__("cupyx"), "allow_synchronize", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # allow_synchronize is "experimental"
        with guard(False) if guard is not None else _Null():
            _, f1, n1 = _ops.unscale_and_norm(CP, grads, state.scale)  # 256 -> 1, 512 -> 2
            _, f2, n2 = _ops.unscale_and_clip(
                CP, grads, state.scale, 1e30, reduce=lambda flag: CP.any(flag, other)
            )  # -> 2**-8, 2**-7; no clipping
            _, f3, n3 = _ops.unscale_and_clip(CP, grads, 1.0, 1e-3)  # clipped
            new_state = sc.update(state, CP.any(f1, f2, f3))
    monkeypatch.undo()
    assert not bool(get(CP.any(f1, f2, f3)))
    norm_one = math.sqrt(5000 * 1.0 + 4096 * 4.0 + 5 * 4.0)
    assert ulps(host_norm(n1), np.float32(norm_one)) <= 1
    assert ulps(host_norm(n2), np.float32(norm_one / 256)) <= 1
    assert ulps(host_norm(n3), np.float32(norm_one / 256)) <= 1
    coef = clip_coefficient(np, host_norm(n3), 1e-3)
    assert to_host(grads["w"][1]).tolist()[0][:2] == [float(np.float32(2.0**-7) * coef)] * 2
    assert to_host(base).tolist()[:2] == [float(np.float64(2.0**-7) * np.float64(coef)), 512.0]
    assert new_state.to_host().growth_tracker == 1


@gpu_only
def test_the_clip_coefficient_is_pytorchs() -> None:
    """Oracle: torch.nn.utils.clip_grad_norm_ on CUDA float32 gradients, given its own norm,
    stores the same bits as the reference arithmetic our clip pass follows. (For float16
    or float64 gradients PyTorch forms the norm, and so the coefficient, in their dtype.)"""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    host = clip_values(np.random.default_rng(61), (5000,), np.dtype(np.float32))
    p = torch.nn.Parameter(torch.zeros(5000, device="cuda", dtype=torch.float32))
    p.grad = torch.from_numpy(host.copy()).cuda()
    total = torch.nn.utils.clip_grad_norm_([p], 0.5)
    coef = clip_coefficient(np, np.float32(total.float().item()), 0.5)
    assert coef < 1.0
    [want] = expected_clip([host], 1.0, coef)
    assert_same_bits(p.grad.cpu().numpy(), want)
    ours = device_copy(host)
    _, _, norm = _ops.unscale_and_clip(CP, [ours], 1.0, 0.5)
    assert abs(float(host_norm(norm)) / float(total.item()) - 1.0) < 1e-5
