"""Unscale + detect + clip to a global norm, in the fewest memory passes, side by side.

Contenders, interleaved in one process (a new random order each round), medians of
``--reps`` rounds, on GPT-2 small's 148 float32 gradient shapes and on 2000 arrays
of 1024 float32 (``--sets``):

* ``pytorch``: what a PyTorch AMP step runs: ``scaler.unscale_``'s kernel
  ``torch._amp_foreach_non_finite_check_and_unscale_``, then
  ``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)`` (its norm
  pass, then ``_foreach_mul_``): three reads and two writes of every value.
* ``sc_fused``: ``scaler_core.unscale_and_clip``: one read (the flag and the
  norm of the unscaled values), one write of ``(g * inv) * coef``.
* ``sc_unfused``: scaler-core's ``unscale``, then a separate read for the norm
  and a separate in-place multiply by the same coefficient: the same result in
  two reads and two writes. On the CPU both extra passes use numba kernels on all
  threads (the library's float64 norm kernel and the bound's multiply); on CUDA
  they are PyTorch's ``clip_grad_norm_(foreach=True)`` on the same memory.
* ``sc_unscale_norm``: ``scaler_core.unscale_and_norm`` alone (one read, one
  write; no clip), for reference.
* ``dropin_numba`` and ``dropin_no_numba``: the drop-in
  ``scaler_core.torch.GradScaler.unscale_and_clip_(optimizer, max_norm)``, the call
  that replaces PyTorch's pair, on the same tensors (the optimizer's ``.grad``),
  with numba's kernels and without them (what ``pip install scaler-core[torch]``
  brings: PyTorch's own kernels). The second row swaps in a NumPy backend built
  with ``use_numba=False`` for its calls only, so both run interleaved in one
  process. Between calls (untimed) each scaler's ``update()`` ends its step. CPU
  only; ``--no-numba-only`` keeps the rows that need no numba (a process where
  numba is missing runs those alone).
* ``bound_2r1w``: a read-only pass plus an in-place multiply of the same bytes,
  nothing else: the floor of any unscale + detect + clip that has to know the
  norm before it writes. ``bound_1r1w``: the multiply alone. On the CPU both are
  numba loops on all threads over 1 MiB work items; on CUDA,
  ``torch._foreach_norm`` and ``torch._foreach_mul_``.

Every contender works on one shared buffer. Before each timed call the pristine
scaled gradients are copied back in (outside the timer, the same copy for every
contender), so each call unscales and clips real gradients and takes the step (no
inf). ``max_norm`` is 1.0 and the gradients' norm is far above it, so the clip
always writes. Before timing, every row that clips is checked against the exact
clip (the norm summed in float64, then ``(g * inv) * coef`` with PyTorch's float32
coefficient): scaler-core's rows within 1e-5 relative (the norm and every value),
PyTorch's within 1e-2 (its CPU norm sums in float32), and every timed call must
return the norm of its check.

Usage::

    python benchmarks/bench_clip.py [--small] [--device cpu|cuda] [--sets gpt2-small,2000x1024]
        [--reps 31] [--warmup 3] [--json out.json]

``--small`` shrinks the sets (a smoke run, not a measurement). ``--device cuda``
times PyTorch on CUDA tensors and scaler-core on CuPy views of the same memory;
without CuPy the scaler-core rows are skipped with a note, and without CUDA the
run is skipped (exit 0). Run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# As the project's other float32 benchmarks and demos: OpenBLAS held to its AVX2
# kernels (set before NumPy loads it; nothing timed here calls BLAS).
os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import scaler_core as sc  # noqa: E402
from scaler_core._ops import clip_coefficient  # noqa: E402
from scaler_core.backends._common import norm_of_sums  # noqa: E402

if __package__:
    from ._sets import gpt2_small_shapes
else:  # run as a script
    sys.path.insert(0, _ROOT)
    from benchmarks._sets import gpt2_small_shapes

#: A power of two: unscaling is exact, so every contender starts from the same values.
SCALE = 2.0**10
MAX_NORM = 1.0
RTOL = 1e-5
#: PyTorch's float32 norm on the CPU: about 8.5e-4 relative on GPT-2 small (torch 2.13).
TORCH_RTOL = 1e-2
BASE, FUSED, BOUND2, BOUND1 = "pytorch", "sc_fused", "bound_2r1w", "bound_1r1w"
DROPIN, DROPIN_PURE = "dropin_numba", "dropin_no_numba"
GOAL = 1.8  # the target: sc_fused at least this much faster than pytorch on GPT-2

SETS: dict[str, Callable[[bool], list[tuple[int, ...]]]] = {
    "gpt2-small": gpt2_small_shapes,
    "2000x1024": lambda small: [(256,)] * 200 if small else [(1024,)] * 2000,
}

NOTES = {
    BASE: "_amp_foreach_non_finite_check_and_unscale_ + clip_grad_norm_(foreach=True)",
    FUSED: "scaler_core.unscale_and_clip: 2 reads + 1 write",
    "sc_unfused": "sc.unscale + a norm pass + a multiply pass: 2 reads + 2 writes",
    "sc_unscale_norm": "scaler_core.unscale_and_norm, no clip: 1 read + 1 write",
    BOUND2: "a read-only pass + an in-place multiply, nothing else",
    BOUND1: "an in-place multiply, nothing else",
    DROPIN: "scaler_core.torch.GradScaler.unscale_and_clip_, numba's kernels",
    DROPIN_PURE: "scaler_core.torch.GradScaler.unscale_and_clip_ without numba",
}

Call = Callable[[], tuple[Any, Any]]  # returns (found, norm), either may be None


def _cpu_kernels() -> tuple[Any, Any]:
    """numba's pieces for the CPU rows: the library's kernels and the bound's (its table,
    a multiply and a read-only pass over it, on all threads)."""
    from scaler_core.backends import _numpy_kernels as kernels  # noqa: PLC0415 (numba only here)

    if __package__:
        from . import _bound_kernel  # noqa: PLC0415
    else:
        from benchmarks import _bound_kernel  # noqa: PLC0415

    # Started as the library starts them, so the bound's kernels (compiled here, in this
    # thread) leave PyTorch's thread count as it is for the PyTorch rows.
    kernels.start_threads()
    return kernels, _bound_kernel


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Case:
    """One set on one device: pristine scaled gradients, the shared work buffer,
    the parameters PyTorch's clip reads, and every contender's call."""

    def __init__(
        self, name: str, *, small: bool, device: str, seed: int, numba: bool = True
    ) -> None:
        self.name, self.device, self.numba = name, device, numba
        self.pending: list[Any] = []  # drop-in scalers whose step is to be ended
        rng = np.random.default_rng(seed)
        host = []
        for shape in SETS[name](small):
            values = rng.standard_normal(shape, dtype=np.float32)
            values[values == 0] = 1.0
            host.append(values * np.float32(SCALE))  # exact: a power of two
        self.pristine = [torch.from_numpy(h).to(device) for h in host]
        self.work = [p.clone() for p in self.pristine]
        # Parameters share the pristine memory (clipping never writes them); their
        # .grad is the work buffer, the same memory the other contenders use.
        self.params = []
        for p, g in zip(self.pristine, self.work, strict=True):
            param = torch.nn.Parameter(p, requires_grad=True)
            param.grad = g
            self.params.append(param)
        if device == "cpu":
            self._work_np = [t.numpy() for t in self.work]
            self._pristine_np = [t.numpy() for t in self.pristine]
        self.elements = sum(h.size for h in host)
        self.bytes = sum(h.nbytes for h in host)
        self.skipped: dict[str, str] = {}
        self.calls = self._calls()

    def restore(self) -> None:
        """The pristine scaled values back into the work buffer (never timed).

        On the CPU by NumPy on the calling thread: no thread pool of PyTorch's or
        numba's is woken by the copy, so none is still spinning when the timed call
        starts; the copy leaves the same data in cache for every contender.
        """
        while self.pending:
            self.pending.pop().update()  # ends the drop-in's step: unscale_ may run again
        if self.device == "cuda":
            torch._foreach_copy_(self.work, self.pristine)
            torch.cuda.synchronize()
            return
        for w, p in zip(self._work_np, self._pristine_np, strict=True):
            np.copyto(w, p)

    def _calls(self) -> dict[str, Call]:
        found_t = torch.zeros(1, device=self.device)
        inv_t = torch.full((1,), 1.0 / SCALE, device=self.device)
        work, params = self.work, self.params

        def pytorch() -> tuple[Any, Any]:
            found_t.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(work, found_t, inv_t)
            norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
            return found_t, norm

        calls: dict[str, Call] = {BASE: pytorch}
        if self.device == "cuda":
            calls.update(self._cuda_calls())
        elif self.numba:
            calls.update(self._cpu_calls())
        if self.device == "cpu":
            calls.update(self._dropin_calls())
        return calls

    def _dropin_calls(self) -> dict[str, Call]:
        """The drop-in's ``unscale_and_clip_``, with numba's kernels and without."""
        from scaler_core.backends import _numpy  # noqa: PLC0415 (the switch below)
        from scaler_core.torch import GradScaler  # noqa: PLC0415

        numpy_backends = {DROPIN_PURE: _numpy.NumpyBackend(use_numba=False)}
        if self.numba:
            numpy_backends[DROPIN] = _numpy.NumpyBackend(use_numba=True)
        calls: dict[str, Call] = {}
        for name, backend in numpy_backends.items():
            scaler = GradScaler("cpu", init_scale=SCALE, growth_interval=1 << 30)
            scaler.scale(torch.ones(()))  # the scale tensor, made as in a step
            optimizer = torch.optim.SGD(self.params, lr=0.0)

            def call(
                scaler: Any = scaler, optimizer: Any = optimizer, backend: Any = backend
            ) -> tuple[Any, Any]:
                _numpy.BACKEND = backend  # the torch backend's CPU route reads it per call
                norm = scaler.unscale_and_clip_(optimizer, MAX_NORM)
                self.pending.append(scaler)
                state = scaler._per_optimizer_states[id(optimizer)]
                found = any(bool(f.item()) for f in state["found_inf_per_device"].values())
                return found, norm

            calls[name] = call
        return calls

    def _cpu_calls(self) -> dict[str, Call]:
        kernels, bound = _cpu_kernels()
        views = [t.numpy() for t in self.work]  # zero-copy: the same memory
        table = bound.Table(views)
        parts = np.empty(table.addrs.size)
        one, inv = np.float32(1.0), np.float32(1.0 / SCALE)

        def unfused() -> tuple[Any, Any]:
            _, found = sc.unscale(views, SCALE, backend="numpy")
            if found:  # a skipped step: nothing to clip
                return found, np.float32(np.nan)
            det = kernels.norm_items_parallel(
                table.addrs, table.sizes, one, table.like, False, parts
            )
            norm = norm_of_sums(parts) if det == 0 else np.float32(np.nan)
            table.scale(clip_coefficient(np, norm, MAX_NORM))
            return found, norm

        def bound_2r1w() -> tuple[Any, Any]:
            table.read()
            table.scale(inv)
            return None, None

        def bound_1r1w() -> tuple[Any, Any]:
            table.scale(inv)
            return None, None

        return {
            FUSED: lambda: sc.unscale_and_clip(views, SCALE, MAX_NORM, backend="numpy")[1:],
            "sc_unfused": unfused,
            "sc_unscale_norm": lambda: sc.unscale_and_norm(views, SCALE, backend="numpy")[1:],
            BOUND2: bound_2r1w,
            BOUND1: bound_1r1w,
        }

    def _cuda_calls(self) -> dict[str, Call]:
        work, params = self.work, self.params
        inv = 1.0 / SCALE

        def bound_2r1w() -> tuple[Any, Any]:
            torch._foreach_norm(work)
            torch._foreach_mul_(work, inv)
            return None, None

        def bound_1r1w() -> tuple[Any, Any]:
            torch._foreach_mul_(work, inv)
            return None, None

        calls: dict[str, Call] = {}
        try:
            import cupy  # noqa: PLC0415 (optional)
        except ImportError as exc:
            for name in (FUSED, "sc_unfused", "sc_unscale_norm"):
                self.skipped[name] = f"CuPy is not importable ({exc})"
        else:
            views = [cupy.from_dlpack(t) for t in work]  # zero-copy: the same memory

            def unfused() -> tuple[Any, Any]:
                # Both libraries run on the legacy default stream, so these are ordered.
                _, found = sc.unscale(views, SCALE, backend="cupy")
                norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
                return found, norm

            calls[FUSED] = lambda: sc.unscale_and_clip(views, SCALE, MAX_NORM, backend="cupy")[1:]
            calls["sc_unfused"] = unfused
            calls["sc_unscale_norm"] = lambda: sc.unscale_and_norm(views, SCALE, backend="cupy")[1:]
        calls[BOUND2] = bound_2r1w
        calls[BOUND1] = bound_1r1w
        return calls

    def run_once(self, name: str) -> tuple[float, bool | None, float | None]:
        """Restore, then time one call: ``(seconds, found, norm)``."""
        self.restore()
        call = self.calls[name]
        t0 = time.perf_counter_ns()
        found, norm = call()
        _sync(self.device)
        elapsed = (time.perf_counter_ns() - t0) * 1e-9
        return (
            elapsed,
            None if found is None else bool(found),
            None if norm is None else float(norm),
        )

    def check(self) -> dict[str, Any]:
        """Every row that clips against the exact result, once, before timing.

        The reference is the norm of the unscaled gradients accumulated in float64
        (exact to float32 rounding) and ``(g * inv) * coef`` with PyTorch's float32
        coefficient for that norm. scaler-core's rows must match it to ``RTOL``;
        PyTorch's pair is held to ``TORCH_RTOL``, because its CPU norm sums in
        float32 (off by about 1e-3 relative on GPT-2 small); whether scaler-core and
        PyTorch also agree to ``RTOL`` is recorded.
        """
        with torch.no_grad():
            total = math.fsum(float(torch.sum(p.double() ** 2)) for p in self.pristine)
            exact = math.sqrt(total) / SCALE  # exact: SCALE is a power of two
            coef = clip_coefficient(np, np.float32(exact), MAX_NORM)
            coef_t = torch.tensor(float(coef), dtype=torch.float32, device=self.device)
            expected = [(p * (1.0 / SCALE)) * coef_t for p in self.pristine]
        out: dict[str, Any] = {"exact_norm": exact, "coefficient": float(coef), "rows": {}}
        for name in self.calls:
            if name in (BOUND2, BOUND1):
                continue
            _, found, norm = self.run_once(name)
            assert norm is not None
            rel = abs(norm - exact) / exact
            tol = TORCH_RTOL if name == BASE else RTOL
            row: dict[str, Any] = {"found": found, "norm": norm, "norm_rel_err": rel}
            row["tolerance"] = tol
            if name == "sc_unscale_norm":  # unscaled, not clipped: exact, as 1/SCALE is
                close = all(
                    torch.equal(w, p * (1.0 / SCALE))
                    for w, p in zip(self.work, self.pristine, strict=True)
                )
                row["grads"] = "equal to pristine / scale"
            else:
                row["max_rel_err"] = max(
                    float(((w - e).abs() / e.abs()).max())
                    for w, e in zip(self.work, expected, strict=True)
                )
                close = row["max_rel_err"] <= tol
                row["grads"] = "(g * inv) * coef(exact norm), max relative error"
            if found or rel > tol or not close:
                raise AssertionError(f"{self.name}: {name} does not match the exact clip: {row}")
            out["rows"][name] = row
        torch_norm = out["rows"][BASE]["norm"]
        for name, row in out["rows"].items():
            if name != BASE:
                row["norm_rel_diff_vs_pytorch"] = abs(row["norm"] - torch_norm) / torch_norm
        out["pytorch_agrees_to_rtol"] = out["rows"][BASE]["norm_rel_err"] <= RTOL
        out["passed"] = True
        return out


def run_set(
    name: str,
    *,
    small: bool,
    device: str,
    reps: int,
    warmup: int,
    seed: int,
    numba: bool = True,
) -> dict[str, Any]:
    """All contenders on one set, interleaved: medians, ratios and raw samples."""
    case = Case(name, small=small, device=device, seed=seed, numba=numba)
    check = case.check()
    names = list(case.calls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    shuffle = random.Random(seed)
    for _ in range(warmup):
        for n in names:
            case.run_once(n)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            shuffle.shuffle(names)
            for n in names:
                elapsed, found, norm = case.run_once(n)
                samples[n].append(elapsed)
                want = check["rows"].get(n, {}).get("norm")
                if found or (norm is not None and abs(norm - want) > RTOL * want):
                    raise AssertionError(f"{name}: {n} returned found={found}, norm={norm}")
    finally:
        if gc_was:
            gc.enable()
    medians = {n: statistics.median(s) for n, s in samples.items()}
    rows: dict[str, Any] = {}
    for n in case.calls:  # in the order of the table, not of the last round
        m = medians[n]
        rows[n] = {
            "median_ms": m * 1e3,
            "min_ms": min(samples[n]) * 1e3,
            "reps": len(samples[n]),
            "speedup_vs_pytorch": medians[BASE] / m,
            "over_bound_2r1w": m / medians[BOUND2] if BOUND2 in medians else None,
            "over_bound_1r1w": m / medians[BOUND1] if BOUND1 in medians else None,
            "grad_gb_per_s": case.bytes / m / 1e9,
            "note": NOTES[n],
        }
    result: dict[str, Any] = {
        "set": name,
        "device": device,
        "arrays": len(case.work),
        "elements": case.elements,
        "bytes": case.bytes,
        "scale": SCALE,
        "max_norm": MAX_NORM,
        "reps": reps,
        "warmup": warmup,
        "check": check,
        "rows": rows,
        "skipped": case.skipped,
        "samples_s": samples,
    }
    if FUSED in rows:
        speedup = rows[FUSED]["speedup_vs_pytorch"]
        result["goal"] = {"target": GOAL, "value": speedup, "met": speedup >= GOAL}
    result["dropin_not_slower"] = {
        n: rows[n]["speedup_vs_pytorch"] >= 1.0 for n in (DROPIN, DROPIN_PURE) if n in rows
    }
    return result


def machine(device: str) -> dict[str, Any]:
    """What the numbers were measured on."""
    if __package__:
        from ._harness import machine as host  # noqa: PLC0415
    else:
        from benchmarks._harness import machine as host  # noqa: PLC0415
    info = host()
    info["torch_threads"] = torch.get_num_threads()
    info["OPENBLAS_CORETYPE"] = os.environ.get("OPENBLAS_CORETYPE")
    try:
        import numba  # noqa: PLC0415

        # the configured count: numba.get_num_threads() would start numba's threads here
        info["numba_threads"] = numba.config.NUMBA_NUM_THREADS
    except ImportError:
        pass
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["torch_cuda"] = torch.version.cuda
        try:
            import cupy  # noqa: PLC0415

            info["cupy"] = cupy.__version__
        except ImportError:
            info["cupy"] = None
    return info


def table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: one line per set and contender."""
    lines = [
        "| set | contender | median ms | GB/s | vs PyTorch's pair"
        " | / 2R+1W bound | / 1R+1W bound |",
        "|---|---|---|---|---|---|---|",
    ]

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for r in results:
        for n, row in r["rows"].items():
            lines.append(
                f"| {r['set']} | {n} | {row['median_ms']:.3g} | {row['grad_gb_per_s']:.3g}"
                f" | {row['speedup_vs_pytorch']:.2f}x | {ratio(row['over_bound_2r1w'])}"
                f" | {ratio(row['over_bound_1r1w'])} |"
            )
        for n, why in r["skipped"].items():
            lines.append(f"| {r['set']} | {n} | skipped: {why} | | | | |")
    return "\n".join(lines)


def _write(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)
    print(f"saved {path}")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run, print the table and save the JSON."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny sets: a smoke run, not a measure")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--sets", default=",".join(SETS), help=f"comma list of {list(SETS)}")
    ap.add_argument("--reps", type=int, default=31, help="timed rounds (default 31)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument(
        "--no-numba-only",
        action="store_true",
        help="only the rows that need no numba (PyTorch's pair and the drop-in without it)",
    )
    args = ap.parse_args(argv)
    names = [s for s in args.sets.split(",") if s]
    unknown = [s for s in names if s not in SETS]
    if unknown or not names:
        ap.error(f"--sets={args.sets!r}: choose from {list(SETS)}, comma-separated")
    if args.reps < 1 or args.warmup < 0:
        ap.error("--reps must be at least 1, --warmup at least 0")
    command = "python benchmarks/bench_clip.py " + " ".join(sys.argv[1:] if argv is None else argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if args.device == "cuda" and not torch.cuda.is_available():
        reason = "--device cuda: no CUDA GPU is visible to PyTorch"
        print(f"skipped: {reason}")
        if args.json:
            _write(args.json, {"command": command, "status": "skipped", "reason": reason})
        return 0
    numba = not args.no_numba_only and importlib.util.find_spec("numba") is not None
    info = machine(args.device)
    info["numba_rows"] = numba
    print(
        f"# {info['cpu']}, {info['cores']} cores; torch {info.get('torch')} with"
        f" {info['torch_threads']} threads; numpy path: {info['numpy_path']}"
        + (f"; GPU {info['gpu']}" if args.device == "cuda" else "")
    )
    results = []
    for name in names:
        results.append(
            run_set(
                name,
                small=args.small,
                device=args.device,
                reps=args.reps,
                warmup=args.warmup,
                seed=args.seed,
                numba=numba,
            )
        )
        print(f"  done {name}", file=sys.stderr)
    text = table(results)
    print(text)
    for r in results:
        if "goal" in r and r["set"] == "gpt2-small":
            g = r["goal"]
            verdict = "met" if g["met"] else "NOT met"
            print(
                f"goal: {FUSED} {g['value']:.2f}x PyTorch's pair on {r['set']}"
                f" (target {GOAL}x): {verdict}"
            )
    for r in results:
        for n, ok in r["dropin_not_slower"].items():
            speedup = r["rows"][n]["speedup_vs_pytorch"]
            verdict = "not slower" if ok else "SLOWER"
            print(f"{r['set']}: {n} {speedup:.2f}x PyTorch's pair: {verdict}")
    for r in results:
        c = r["check"]
        print(
            f"check {r['set']}: scaler-core's norms and clipped values within {RTOL} of the"
            f" exact clip; PyTorch's norm off by {c['rows'][BASE]['norm_rel_err']:.2g} relative"
        )
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_at_end"] = f.read().split()[:3]
    except OSError:
        pass
    if args.json:
        payload = {
            "command": command,
            "status": "ok",
            "machine": info,
            "when": stamp,
            "results": results,
            "table": text,
        }
        _write(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
