"""A tensor's cost: the drop-in against ``torch.amp.GradScaler`` as the tensor count grows.

Models with many small tensors (mixtures of experts: thousands per rank) pay the
scaler's per-tensor Python on every step; on an accelerator it is all that is left.
For ``--counts`` float32 gradients of ``--size`` values each (foreach SGD, CPU),
contenders interleaved in a new random order each round, medians of ``--reps``:

* ``plain``: one ``unscale_`` / ``step`` / ``update`` cycle, PyTorch's class against
  the drop-in (the goal: never slower, at any count);
* ``clip``: PyTorch's ``unscale_`` then ``clip_grad_norm_(params, 1.0, foreach=True)``
  against the drop-in's ``unscale_and_clip_(opt, 1.0)`` (``step`` and ``update`` run
  untimed after each; the goal: at least 2x at 2,000 tensors).

Each row is measured twice, ``kept`` and ``fresh``. Kept: the gradients are the same
tensors every step (``zero_grad(set_to_none=False)``, or accumulation into
``.grad``), refilled in place before each timed call; the drop-in and the torch
backend reuse their plans of them. Fresh: every step brings new gradient tensors
(``zero_grad()``'s default), so nothing can be reused. And ``functional``:
``scaler_core.unscale`` on ``--numpy-count`` NumPy arrays with no backend named,
against ``backend="numpy"`` (the goal: within 20%).

Usage::

    python benchmarks/bench_tensors.py [--small] [--counts 1,16,128,1024,2000,4096]
        [--size 256] [--reps 101] [--json out.json]

``--small`` is a smoke run (few counts and reps), not a measurement. Run it with
nothing else busy; without ``--json`` the result goes to the next
``tensors-cpu-<n>.json`` in ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root holds `benchmarks`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

import scaler_core as sc
from benchmarks._results import next_result
from scaler_core.torch import GradScaler

#: The scale the gradients carry (a power of two: every unscale is exact).
SCALE = 2.0**10
GOALS = {"clip_at_2000": 2.0, "plain_at_every_count": 1.0, "functional_unnamed_over_named": 1.2}


class _Model:
    """``count`` parameters of ``size`` values, their scaled gradients, a foreach SGD."""

    def __init__(self, count: int, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(size, generator=gen)) for _ in range(count)]
        self.pristine = [torch.randn(size, generator=gen) * SCALE for _ in range(count)]
        self.opt = torch.optim.SGD(self.params, lr=1e-9, foreach=True)

    def refill(self, fresh: bool) -> None:
        """The scaled gradients again: in the same tensors, or in new ones (untimed)."""
        for p, g in zip(self.params, self.pristine, strict=True):
            if fresh or p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)


def _scaler(kind: str) -> Any:
    cls = torch.amp.GradScaler if kind == "pytorch" else GradScaler
    scaler = cls("cpu", init_scale=SCALE, growth_interval=10**9)
    scaler.scale(torch.ones(()))  # makes the scale's tensors, as a loop's first scale() does
    return scaler


def _cycle(kind: str, row: str, model: _Model, scaler: Any) -> Callable[[], float]:
    """One timed call of a contender (the refill before it and the rest of the step
    after it untimed); returns its seconds."""
    opt, params = model.opt, model.params

    def plain() -> float:
        start = time.perf_counter()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        return time.perf_counter() - start

    def clip() -> float:
        start = time.perf_counter()
        if kind == "pytorch":
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        else:
            scaler.unscale_and_clip_(opt, 1.0)
        took = time.perf_counter() - start
        scaler.step(opt)
        scaler.update()
        return took

    return plain if row == "plain" else clip


def _torch_rows(counts: list[int], size: int, reps: int, warmup: int) -> list[dict[str, Any]]:
    out = []
    for count in counts:
        for fresh in (False, True):
            models = {kind: _Model(count, size, seed=count) for kind in ("pytorch", "dropin")}
            calls = {
                (row, kind): _cycle(kind, row, models[kind], _scaler(kind))
                for row in ("plain", "clip")
                for kind in ("pytorch", "dropin")
            }
            times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
            order = list(calls)
            for rep in range(warmup + reps):
                random.shuffle(order)
                for key in order:
                    models[key[1]].refill(fresh)
                    took = calls[key]()
                    if rep >= warmup:
                        times[key].append(took)
            for row in ("plain", "clip"):
                theirs = statistics.median(times[(row, "pytorch")])
                ours = statistics.median(times[(row, "dropin")])
                out.append(
                    {
                        "row": row,
                        "gradients": "fresh" if fresh else "kept",
                        "tensors": count,
                        "pytorch_ms": theirs * 1e3,
                        "dropin_ms": ours * 1e3,
                        "speedup": theirs / ours,
                        "dropin_us_per_tensor": ours * 1e6 / count,
                    }
                )
            print(_line(out[-2]), _line(out[-1]), sep="\n", flush=True)
    return out


def _functional(count: int, size: int, reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(count)]
    calls: dict[str, Callable[[], Any]] = {
        "unnamed": lambda: sc.unscale(grads, 1.0),
        "named": lambda: sc.unscale(grads, 1.0, backend="numpy"),
    }
    times: dict[str, list[float]] = {k: [] for k in calls}
    order = list(calls)
    for rep in range(reps + 5):
        random.shuffle(order)
        for key in order:
            start = time.perf_counter()
            calls[key]()
            if rep >= 5:  # the warm-up rounds
                times[key].append(time.perf_counter() - start)
    unnamed, named = (statistics.median(times[k]) for k in ("unnamed", "named"))
    return {
        "arrays": count,
        "unnamed_ms": unnamed * 1e3,
        "named_ms": named * 1e3,
        "unnamed_over_named": unnamed / named,
    }


def _check(count: int, size: int) -> str | None:
    """Before timing: the contenders agree on one step of each row, from the same
    gradients (``plain``: the unscaled gradients bit for bit; ``clip``: the norms and
    the clipped gradients within 1e-4, relative, since PyTorch's CPU norm sums in
    float32). A message where they do not."""
    for row in ("plain", "clip"):
        models = {kind: _Model(count, size, seed=1) for kind in ("pytorch", "dropin")}
        for kind, model in models.items():
            model.refill(fresh=False)
            scaler = _scaler(kind)
            if row == "clip" and kind == "dropin":
                scaler.unscale_and_clip_(model.opt, 1.0)
                continue
            scaler.unscale_(model.opt)
            if row == "clip":
                torch.nn.utils.clip_grad_norm_(model.params, 1.0, foreach=True)
        ours = [p.grad for p in models["dropin"].params]
        theirs = [p.grad for p in models["pytorch"].params]
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            same = torch.equal(a, b) if row == "plain" else torch.allclose(a, b, rtol=1e-4)
            if not same:
                return f"{row}: gradient {i} differs between the drop-in and PyTorch's class"
    return None


def _fail(message: str) -> int:
    print(f"bench_tensors: {message}", file=sys.stderr)
    return 2


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['row']:5} {r['gradients']:5} {r['tensors']:5d} tensors: pytorch "
        f"{r['pytorch_ms']:8.3f} ms  drop-in {r['dropin_ms']:8.3f} ms  "
        f"x{r['speedup']:.2f}  ({r['dropin_us_per_tensor']:.2f} us/tensor)"
    )


def _goals(rows: list[dict[str, Any]], functional: dict[str, Any]) -> dict[str, Any]:
    kept = [r for r in rows if r["gradients"] == "kept"]
    clip = [r["speedup"] for r in kept if r["row"] == "clip" and r["tensors"] == 2000]
    plain = [r["speedup"] for r in kept if r["row"] == "plain"]
    return {
        "clip_at_2000": {"goal": GOALS["clip_at_2000"], "speedup": clip[0] if clip else None},
        "plain_at_every_count": {"goal": GOALS["plain_at_every_count"], "lowest": min(plain)},
        "functional_unnamed_over_named": {
            "goal": GOALS["functional_unnamed_over_named"],
            "ratio": functional["unnamed_over_named"],
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--small", action="store_true", help="a smoke run, not a measurement")
    parser.add_argument("--counts", default="1,16,128,1024,2000,4096")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--reps", type=int, default=101)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--numpy-count", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        counts = [int(c) for c in args.counts.split(",")]
    except ValueError:
        return _fail(f"--counts={args.counts!r}, but it must be integers joined by commas")
    if any(c < 1 for c in counts):
        return _fail(f"--counts={args.counts!r}, but every count must be at least 1")
    for name in ("size", "reps", "numpy_count"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            return _fail(f"{flag}={getattr(args, name)}, but it must be at least 1")
    if args.warmup < 0:
        return _fail(f"--warmup={args.warmup}, but it must be at least 0")
    if args.small:
        counts, args.reps, args.warmup, args.numpy_count = [1, 40], 5, 1, 40
    failed = _check(max(counts), args.size)
    if failed:
        print(f"bench_tensors: {failed}", file=sys.stderr)
        return 1
    rows = _torch_rows(counts, args.size, args.reps, args.warmup)
    functional = _functional(args.numpy_count, args.size, args.reps)
    print(
        f"functional {functional['arrays']} NumPy arrays: unnamed {functional['unnamed_ms']:.3f}"
        f" ms, named {functional['named_ms']:.3f} ms, x{functional['unnamed_over_named']:.2f}"
    )
    result = {
        "command": "python benchmarks/bench_tensors.py " + " ".join(argv or sys.argv[1:]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "torch_threads": torch.get_num_threads(),
            "numpy_path": sc.get_backend("numpy").path,  # type: ignore[attr-defined]
        },
        "size": args.size,
        "reps": args.reps,
        "rows": rows,
        "functional": functional,
        "goals": _goals(rows, functional),
    }
    path = args.json or next_result("tensors", "cpu", "small" if args.small else "")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
