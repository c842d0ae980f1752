"""GPU benchmark: unscale + detect over many gradients, every contender in one run.

Sets: GPT-2 small's 148 parameter shapes (124M float32) and 2000 arrays of 1024
float32. Contenders, on the same data where the library allows it:

* ``copy``: one device-to-device copy of the same bytes (the bandwidth roofline:
  one read and one write of every byte, as unscaling needs);
* ``cupy``: scaler-core's CuPy backend, host scale; ``cupy-device-scale``: the
  same with the scale in device memory (the no-sync path of a device state);
* ``torch``: ``torch._amp_foreach_non_finite_check_and_unscale_`` on the very
  same memory (tensors made from the CuPy arrays through DLPack);
* ``jax``: scaler-core's JAX backend under ``jax.jit`` (arguments donated, so it
  works in place like the others) and ``jmp-pattern``: ``tree_map`` multiply +
  ``all(isfinite)`` per leaf under ``jit``, when ``scaler_core.backends._jax``
  and a JAX GPU are present.

Timing: after a warm-up, each measurement is a batch of back-to-back calls
bracketed by CUDA events on the stream (host overhead that leaves the GPU idle
counts, as in a training loop); JAX runs on its own streams, so its batches are
timed on the host around ``block_until_ready``. Contenders are interleaved,
round after round, and the median per-call time is reported. The scale
alternates between 2**16 and 2**-16 so values stay in range.

Usage: ``python3 benchmarks/bench_gpu.py --json OUT.json [--quick]``. Without a
GPU it says why, writes a JSON with ``"status": "skipped"`` and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# JAX would otherwise reserve most of the GPU's memory at import.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

SCALES = (2.0**16, 2.0**-16)


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small's parameters: 148 arrays, 124,439,808 values."""
    d, ff, vocab, ctx = 768, 3072, 50257, 1024
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (d, ff), (ff,), (ff, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


SETS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "gpt2-small": gpt2_small_shapes,
    "2000x1024": lambda: [(1024,)] * 2000,
}


def _why_no_gpu() -> str | None:
    try:
        import cupy  # noqa: PLC0415 - optional: the benchmark reports its absence
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"CuPy cannot reach a CUDA GPU ({type(exc).__name__}: {exc})"
    return None if n > 0 else "CuPy sees 0 CUDA devices"


class Timer:
    """Per-call time of a batch of calls, by CUDA events on the current stream."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy
        self.start = cupy.cuda.Event()
        self.end = cupy.cuda.Event()

    def __call__(self, fn: Callable[[int], Any], calls: int) -> float:
        self.start.record()
        for i in range(calls):
            fn(i)
        self.end.record()
        self.end.synchronize()
        return float(self.cupy.cuda.get_elapsed_time(self.start, self.end)) / calls


def host_timer(fn: Callable[[int], Any], calls: int, wait: Callable[[], None]) -> float:
    wait()
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    wait()
    return (time.perf_counter() - t0) * 1e3 / calls


def build_contenders(
    cupy: Any, shapes: list[tuple[int, ...]], notes: list[str], *, with_jax: bool
) -> dict[str, Any]:
    """``name -> (kind, step(i), wait)``, every contender ready and warmed up."""
    import scaler_core as sc  # noqa: PLC0415 - after XLA_PYTHON_CLIENT_PREALLOCATE is set
    from scaler_core._ops import unscale  # noqa: PLC0415 - a backend's unscale, no facade
    from scaler_core.cupy import to_device  # noqa: PLC0415

    rng = np.random.default_rng(0)
    grads = [cupy.asarray(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
    total = sum(g.nbytes for g in grads)
    src = cupy.empty(total, np.uint8)
    dst = cupy.empty(total, np.uint8)
    cp_backend = sc.get_backend("cupy")
    dev_scales = [to_device(sc.init(sc.ScalerConfig(init_scale=s))).scale for s in SCALES]
    out: dict[str, Any] = {}

    def copy(i: int) -> None:
        dst.data.copy_from_device_async(src.data, total)

    out["copy"] = ("event", copy, None)

    def cupy_host(i: int) -> Any:
        return unscale(cp_backend, grads, SCALES[i % 2])[1]

    def cupy_device(i: int) -> Any:
        return unscale(cp_backend, grads, dev_scales[i % 2])[1]

    out["cupy"] = ("event", cupy_host, None)
    out["cupy-device-scale"] = ("event", cupy_device, None)

    try:
        import torch  # noqa: PLC0415 - optional contender

        if not torch.cuda.is_available():
            raise RuntimeError("this PyTorch has no CUDA")
        tensors = [torch.from_dlpack(g) for g in grads]
        found = torch.zeros(1, device="cuda")
        invs = [torch.full((1,), float(np.float32(1.0 / s)), device="cuda") for s in SCALES]

        def torch_step(i: int) -> None:
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, invs[i % 2])

        out["torch"] = ("event", torch_step, None)
        notes.append(f"torch {torch.__version__}")
    except Exception as exc:
        notes.append(f"torch skipped: {type(exc).__name__}: {exc}")

    try:
        if not with_jax:
            raise RuntimeError("--no-jax was given")
        import jax  # noqa: PLC0415 - optional contender
        import jax.numpy as jnp  # noqa: PLC0415

        if not any(d.platform == "gpu" for d in jax.devices()):
            raise RuntimeError(f"JAX sees no GPU: {jax.devices()}")
        jax_backend = sc.get_backend("jax")
        host = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
        state = {"ours": [jax.device_put(h) for h in host]}
        state["jmp"] = [jax.device_put(h) for h in host]
        jscales = [jnp.float32(s) for s in SCALES]

        def _ours(g: Any, s: Any) -> Any:
            return unscale(jax_backend, g, s)

        def _jmp(g: Any, s: Any) -> Any:
            inv = jnp.float32(1.0) / s
            g = jax.tree_util.tree_map(lambda x: x * inv.astype(x.dtype), g)
            finite = jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(g)])
            return g, ~jnp.all(finite)

        ours = jax.jit(_ours, donate_argnums=0)
        jmp = jax.jit(_jmp, donate_argnums=0)

        def jax_step(i: int) -> None:
            state["ours"], flag = ours(state["ours"], jscales[i % 2])
            state["last"] = flag

        def jmp_step(i: int) -> None:
            state["jmp"], flag = jmp(state["jmp"], jscales[i % 2])
            state["last"] = flag

        def jax_wait() -> None:
            jax.block_until_ready(state)

        out["jax"] = ("host", jax_step, jax_wait)
        out["jmp-pattern"] = ("host", jmp_step, jax_wait)
        notes.append(f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    except Exception as exc:
        notes.append(f"jax skipped: {type(exc).__name__}: {exc}")

    for name, (_, step, wait) in list(out.items()):  # warm-up: compile, upload tables
        try:
            for i in range(4):
                step(i)
            if wait is not None:
                wait()
            cupy.cuda.Device().synchronize()
        except Exception as exc:  # noqa: PERF203 - a handful of contenders, once
            if name in ("copy", "cupy"):
                raise
            notes.append(f"{name} dropped: warm-up failed: {type(exc).__name__}: {exc}")
            del out[name]
    flag = unscale(cp_backend, grads, 1.0)[1]
    if bool(flag.get()):
        raise RuntimeError("the benchmark data became non-finite")
    return out


def run_set(cupy: Any, name: str, rounds: int, calls: int, *, with_jax: bool) -> dict[str, Any]:
    shapes = SETS[name]()
    notes: list[str] = []
    contenders = build_contenders(cupy, shapes, notes, with_jax=with_jax)
    timer = Timer(cupy)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no fixed order
        for k in order:
            kind, step, wait = contenders[k]
            if kind == "event":
                times[k].append(timer(step, calls))
            else:
                times[k].append(host_timer(step, calls, wait))
    nbytes = sum(int(np.prod(s)) * 4 for s in shapes)
    results: dict[str, Any] = {}
    copy_ms = statistics.median(times["copy"])
    torch_ms = statistics.median(times["torch"]) if "torch" in times else None
    for k, ts in times.items():
        med = statistics.median(ts)
        results[k] = {
            "median_ms": med,
            "min_ms": min(ts),
            "timing": contenders[k][0],
            "gb_per_s": 2 * nbytes / (med * 1e-3) / 1e9,  # one read + one write of every byte
            "fraction_of_copy_bandwidth": copy_ms / med,
            "speedup_vs_torch": None if torch_ms is None else torch_ms / med,
        }
    return {
        "arrays": len(shapes),
        "values": nbytes // 4,
        "bytes": nbytes,
        "rounds": rounds,
        "calls_per_round": calls,
        "notes": notes,
        "results": results,
    }


def goals(report: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sets = report["sets"]
    big = sets.get("gpt2-small", {}).get("results", {})
    if "cupy" in big:
        frac = big["cupy"]["fraction_of_copy_bandwidth"]
        out["cupy >= 0.85 of copy bandwidth on gpt2-small"] = {"value": frac, "ok": frac >= 0.85}
    for name, data in sets.items():
        res = data.get("results", {})
        if "cupy" in res and "torch" in res:
            s = res["cupy"]["speedup_vs_torch"]
            out[f"cupy at least as fast as torch on {name}"] = {"value": s, "ok": s >= 1.0}
        if "jax" in res and "jmp-pattern" in res:
            s = res["jmp-pattern"]["median_ms"] / res["jax"]["median_ms"]
            out[f"jax no slower than the jmp pattern on {name}"] = {"value": s, "ok": s >= 1.0}
    return out


def table(report: dict[str, Any]) -> str:
    lines = [
        "| set | contender | median ms | GB/s | x copy bandwidth | speed vs torch |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, data in report["sets"].items():
        for k, r in data.get("results", {}).items():
            vs = "" if r["speedup_vs_torch"] is None else f"{r['speedup_vs_torch']:.2f}x"
            lines.append(
                f"| {name} | {k} | {r['median_ms']:.4f} | {r['gb_per_s']:.0f} | "
                f"{r['fraction_of_copy_bandwidth']:.2f} | {vs} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench_gpu.json", help="where to write the results")
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--sets", default=",".join(SETS), help="comma-separated set names")
    parser.add_argument("--no-jax", action="store_true", help="leave the JAX contenders out")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "benchmark": "unscale + detect (scaler-core bench_gpu.py)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "sets": {},
    }
    why = _why_no_gpu()
    if why is not None:
        report.update(status="skipped", reason=why)
        print(f"bench_gpu: skipped: {why}")
        _write(args.json, report)
        return 0
    import cupy  # noqa: PLC0415

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    report["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    report["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    report["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    report["cupy"] = cupy.__version__
    # An even number of calls per batch: the alternating scales bring the values back.
    rounds, calls = (5, 4) if args.quick else (21, 10)
    failed = False
    for name in [s for s in args.sets.split(",") if s]:
        if name not in SETS:
            parser.error(f"--sets: unknown set {name!r}; known: {', '.join(SETS)}")
        try:
            report["sets"][name] = run_set(cupy, name, rounds, calls, with_jax=not args.no_jax)
        except Exception as exc:
            failed = True
            report["sets"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        cupy.get_default_memory_pool().free_all_blocks()
    report["goals"] = goals(report)
    report["status"] = "error" if failed else "ok"
    print(f"GPU: {report['gpu']}  (CuPy {report['cupy']}, {report['date']})")
    for name, data in report["sets"].items():
        for note in data.get("notes", []):
            print(f"  [{name}] {note}")
    print(table(report))
    for goal, v in report["goals"].items():
        print(f"  goal: {goal}: {v['value']:.3f} -> {'MET' if v['ok'] else 'NOT MET'}")
    _write(args.json, report)
    return 1 if failed else 0


def _write(path: str, report: dict[str, Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"bench_gpu: wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
