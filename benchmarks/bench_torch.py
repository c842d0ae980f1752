"""The PyTorch drop-in against ``torch.amp.GradScaler``, side by side in one process.

Two measurements, contenders interleaved (A B A B ...), medians of ``--reps``:

* ``cycle``: host time of one whole ``scale(loss)`` / ``unscale_`` / ``step`` /
  ``update`` cycle on a CPU model of 200 parameter tensors (100 ``Linear(64, 64)``,
  foreach SGD). The gradients are restored before each timed cycle (outside the
  timer), so every cycle unscales the same values.
* ``unscale``: ``unscale_(optimizer)`` alone on GPT-2 small's 148 gradient tensors
  (124M float32 values), beside the machine's bound for that pass: PyTorch's
  ``_foreach_mul_`` by the same inverse (one read and one write of every value,
  no check at all), which no unscale that writes its result can beat.
* ``route``: the torch backend's choice of route, PyTorch's kernel against
  NumPy's fused path (on CUDA: the CuPy kernel) through zero-copy views, fresh
  each step (what a drop-in sees: ``zero_grad()`` re-allocates gradients) or
  kept (a plan-cache hit).

Usage::

    python benchmarks/bench_torch.py [--small] [--device cpu|cuda] [--reps 31]
        [--cycle-reps 501] [--only cycle,unscale,route] [--json out.json]

``--small`` shrinks GPT-2's shapes (a quick check that the script runs, not a
measurement). Run it with nothing else busy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import torch  # noqa: E402

from scaler_core.torch import GradScaler  # noqa: E402

if __package__:
    from ._sets import gpt2_small_shapes
else:  # run as a script
    sys.path.insert(0, _ROOT)
    from benchmarks._sets import gpt2_small_shapes

CONTENDERS = {"pytorch": torch.amp.GradScaler, "scaler_core": GradScaler}


class _Case:
    """One contender's scaler, optimizer and gradients, ready to time."""

    def __init__(self, cls: Any, params: list[torch.Tensor], device: str) -> None:
        self.params = params
        self.saved = [p.grad.detach().clone() for p in params]  # type: ignore[union-attr]
        self.opt = torch.optim.SGD(params, lr=1e-4, foreach=True)
        self.scaler = cls(device, init_scale=2.0**16, growth_interval=10**6)
        self.loss = torch.ones((), device=device)

    def restore(self) -> None:
        torch._foreach_copy_([p.grad for p in self.params], self.saved)  # type: ignore[misc]

    def cycle(self) -> None:
        self.scaler.scale(self.loss)
        self.scaler.unscale_(self.opt)
        self.scaler.step(self.opt)
        self.scaler.update()

    def unscale(self) -> None:
        self.scaler.scale(self.loss)
        self.scaler.unscale_(self.opt)

    def reset(self) -> None:
        """After ``unscale``: end the iteration without stepping."""
        self.scaler._per_optimizer_states.clear()


def _params(shapes: list[tuple[int, ...]], device: str, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        out.append(p)
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(
    cases: dict[str, Any], body: str, device: str, reps: int, warmup: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(warmup + reps):
        for name, case in cases.items():  # interleaved: noise hits both alike
            case.restore()
            _sync(device)
            fn: Callable[[], None] = getattr(case, body)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            elapsed = time.perf_counter() - t0
            if body == "unscale":
                case.reset()
            if rep >= warmup:
                times[name].append(elapsed)
    return times


def bench_cycle(device: str, reps: int, warmup: int) -> dict[str, Any]:
    shapes = [(64, 64), (64,)] * 100
    cases = {
        name: _Case(cls, _params(shapes, device, 0), device) for name, cls in CONTENDERS.items()
    }
    times = _time(cases, "cycle", device, reps, warmup)
    return _summary("cycle", f"{len(shapes)} parameter tensors, foreach SGD", times)


def bench_unscale(device: str, reps: int, warmup: int, small: bool) -> dict[str, Any]:
    shapes = gpt2_small_shapes(small)
    cases: dict[str, Any] = {
        name: _Case(cls, _params(shapes, device, 1), device) for name, cls in CONTENDERS.items()
    }

    class _Bound(_Case):
        def unscale(self) -> None:
            torch._foreach_mul_([p.grad for p in self.params], 2.0**-16)  # type: ignore[misc]

        def reset(self) -> None:
            pass

    cases["bound_foreach_mul"] = _Bound(torch.amp.GradScaler, _params(shapes, device, 1), device)
    times = _time(cases, "unscale", device, reps, warmup)
    values = sum(torch.Size(s).numel() for s in shapes)
    out = _summary(
        "unscale", f"GPT-2 small gradients: {len(shapes)} tensors, {values} float32", times
    )
    gib = 2 * values * 4 / 2**30  # one read and one write of every value
    for row in out["rows"].values():
        row["GiB_per_s"] = round(gib / row["median_s"], 2)
    return out


def bench_route(device: str, reps: int, warmup: int, small: bool) -> dict[str, Any]:
    """The torch backend's route. On the CPU: PyTorch's kernel, or NumPy's fused path
    through zero-copy views (``t.numpy()``), made fresh each step as a drop-in must
    (``zero_grad()`` re-allocates gradients) or reused (a plan-cache hit). On CUDA:
    PyTorch's kernel, or the CuPy kernel through DLPack views (fresh and kept)."""
    import scaler_core as sc  # noqa: PLC0415
    from scaler_core import _ops  # noqa: PLC0415

    torch_backend = sc.get_backend("torch")
    if device == "cuda":
        import cupy  # noqa: PLC0415

        other, view, other_name = sc.get_backend("cupy"), cupy.from_dlpack, "cupy"
    else:
        other, view, other_name = sc.get_backend("numpy"), torch.Tensor.numpy, "numpy"
    rows: dict[str, Any] = {}
    for label, shapes in (
        ("200", [(64, 64), (64,)] * 100),
        ("gpt2", gpt2_small_shapes(small)),
    ):
        gen = torch.Generator().manual_seed(2)
        src = [torch.randn(shape, generator=gen).to(device) for shape in shapes]
        kept = [view(t) for t in src]
        calls: dict[str, Callable[[], Any]] = {
            "torch_kernel": lambda src=src: _ops.unscale(torch_backend, src, 1.0)[1],
            f"{other_name}_fresh_views": lambda src=src: _ops.unscale(
                other, [view(t) for t in src], 1.0
            )[1],
            f"{other_name}_kept_views": lambda kept=kept: _ops.unscale(other, kept, 1.0)[1],
        }
        times: dict[str, list[float]] = {f"{label}:{k}": [] for k in calls}
        for rep in range(warmup + reps):
            for name, call in calls.items():
                t0 = time.perf_counter()
                bool(call())  # reads the flag: waits for the device
                if rep >= warmup:
                    times[f"{label}:{name}"].append(time.perf_counter() - t0)
        part = _summary("route", "", times, base=f"{label}:torch_kernel")
        rows.update(part["rows"])
    path = getattr(other, "path", other_name)
    what = f"torch backend on {device}: 200 small tensors and GPT-2 small ({other_name}: {path})"
    return {"bench": "route", "what": what, "rows": rows}


def _summary(
    name: str, what: str, times: dict[str, list[float]], base: str = "pytorch"
) -> dict[str, Any]:
    rows = {
        k: {"median_s": statistics.median(v), "min_s": min(v), "reps": len(v)}
        for k, v in times.items()
    }
    base_s = rows[base]["median_s"]
    for row in rows.values():
        row["vs_pytorch"] = round(row["median_s"] / base_s, 3)
    return {"bench": name, "what": what, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="shrink GPT-2's shapes (a quick run)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=31, help="timed reps of unscale")
    ap.add_argument(
        "--cycle-reps", type=int, default=501, help="timed reps of the cycle (sub-ms: many)"
    )
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--only", default="cycle,unscale,route", help="comma-separated: cycle,unscale,route"
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    if not only <= {"cycle", "unscale", "route"}:
        ap.error(f"--only={args.only!r}: it takes cycle, unscale and route, comma-separated")
    if min(args.reps, args.cycle_reps) < 1 or args.warmup < 0:
        ap.error("--reps and --cycle-reps must be at least 1, --warmup at least 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible to PyTorch")
    results = []
    if "cycle" in only:
        results.append(bench_cycle(args.device, args.cycle_reps, args.warmup))
    if "unscale" in only:
        results.append(bench_unscale(args.device, args.reps, args.warmup, args.small))
    if "route" in only:
        results.append(bench_route(args.device, args.reps, args.warmup, args.small))
    for res in results:
        print(f"{res['bench']}: {res['what']} ({args.device})")
        for name, row in res["rows"].items():
            extra = f"  {row['GiB_per_s']:7.2f} GiB/s" if "GiB_per_s" in row else ""
            print(
                f"  {name:<24} median {row['median_s'] * 1e3:9.3f} ms"
                f"  x{row['vs_pytorch']:<6}{extra}"
            )
    if args.json:
        meta = {
            "device": args.device,
            "small": args.small,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": platform.processor(),
            "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        }
        with open(args.json, "w") as f:
            json.dump({"machine": meta, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
