"""MLX: scaler-core's compiled passes against a naive per-array loop and the copy bound.

Contenders on the same gradients (a list of MLX arrays), run interleaved in a
shuffled order every round, medians of ``--reps`` rounds, every ratio from the same
run. Each time is one call until all its outputs are computed (``mx.eval``):

* ``scaler_core``: ``scaler_core.unscale_and_norm(grads, scale)``, the public call
  (tree walk and checks included): unscale, non-finite detection and the global L2
  norm (squares summed in float64) as one compiled MLX computation;
* ``scaler_core_clip``: ``scaler_core.unscale_and_clip(grads, scale, max_norm)``:
  the measuring pass (flag and norm, nothing written), then the clip pass (one
  write, or the given values on a skipped step);
* ``naive``: what one writes by hand, eagerly, per array: ``y = g * inv``,
  ``all(isfinite(y))``, ``sum(y * y)`` (float32), then the flag and the norm combined
  on the device (no host read);
* ``naive_clip``: ``naive``, then ``where(found, g, y * coef)`` per array with
  PyTorch's clip coefficient;
* ``copy``: the bound, one compiled function that reads every gradient once and
  writes it once (``g * one``): what any pass that returns new arrays pays.

Before timing, the rows are checked against each other: the same unscaled values
bit for bit, scaler-core's norm within 1e-6 of the exact one, no flag. The naive
float32 sum of squares is only required within 10%: MLX's CPU sums float32 in
float32, and over millions of values loses digits (1.5% on GPT-2 small's 124M
values); the report gives both errors, and how far the clipped values differ.

Sets: ``gpt2`` (the 148 parameter shapes of GPT-2 small, 124M values; ``--small``
divides the large dimensions by 16) and ``many`` (``--many`` arrays of 1024).

Usage::

    python benchmarks/bench_mlx.py [--small] [--sets gpt2,many] [--many 2000]
        [--dtype float32|float16|bfloat16] [--reps 15] [--json out.json]

Without ``--json`` the report goes to the next ``mlx-<device>[-small]-<n>.json`` in
``benchmarks/results/`` (the scheme of ``benchmarks/_results.py``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if __package__:
    from ._results import next_result
    from ._sets import gpt2_shapes
else:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._results import next_result
    from benchmarks._sets import gpt2_shapes

CONTENDERS = ("scaler_core", "scaler_core_clip", "naive", "naive_clip", "copy")
SETS = ("gpt2", "many")
DTYPES = ("float32", "float16", "bfloat16")
SCALE = 1024.0
MAX_NORM = 1.0


def make_grads(name: str, *, small: bool, many: int, dtype: str) -> list[Any]:
    """Random normal gradients times the scale (no zeros, nothing non-finite)."""
    import mlx.core as mx  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(0)
    shapes = gpt2_shapes(16 if small else 1) if name == "gpt2" else [(1024,)] * many
    grads = []
    for shape in shapes:
        values = rng.standard_normal(shape, dtype=np.float32)
        values[values == 0] = 1.0
        grads.append(mx.array(values * np.float32(SCALE)).astype(getattr(mx, dtype)))
    mx.eval(grads)
    return grads


def contenders() -> dict[str, Callable[[list[Any]], Any]]:
    """Each contender as a function of the gradient list returning what it computed."""
    import mlx.core as mx  # noqa: PLC0415

    import scaler_core as sc  # noqa: PLC0415

    def ours(grads: list[Any]) -> Any:
        return sc.unscale_and_norm(grads, SCALE)

    def ours_clip(grads: list[Any]) -> Any:
        return sc.unscale_and_clip(grads, SCALE, MAX_NORM)

    inv = mx.array(1.0 / SCALE, dtype=mx.float32)

    def unscaled(g: Any) -> Any:
        return (g.astype(mx.float32) * inv).astype(g.dtype)

    def naive(grads: list[Any]) -> Any:
        ys = [unscaled(g) for g in grads]
        finite = mx.all(mx.stack([mx.all(mx.isfinite(y)) for y in ys]))
        squares = mx.stack([mx.sum(mx.square(y.astype(mx.float32))) for y in ys])
        return ys, ~finite, mx.sqrt(mx.sum(squares))

    def naive_clip(grads: list[Any]) -> Any:
        ys, found, norm = naive(grads)
        coef = mx.minimum(mx.array(MAX_NORM, dtype=mx.float32) / (norm + 1e-6), 1.0)
        out = [
            mx.where(found, g, (y.astype(mx.float32) * coef).astype(g.dtype))
            for g, y in zip(grads, ys, strict=True)
        ]
        return out, found, norm

    one = mx.array(1.0, dtype=mx.float32)

    @mx.compile
    def copy_pass(grads: list[Any]) -> Any:
        return [g * one.astype(g.dtype) for g in grads]

    return {
        "scaler_core": ours,
        "scaler_core_clip": ours_clip,
        "naive": naive,
        "naive_clip": naive_clip,
        "copy": copy_pass,
    }


def timed(fn: Callable[[list[Any]], Any], grads: list[Any]) -> float:
    """Seconds of one call until every output is computed."""
    import mlx.core as mx  # noqa: PLC0415

    start = time.perf_counter()
    mx.eval(fn(grads))
    return time.perf_counter() - start


class CheckFailedError(Exception):
    """The contenders disagree: nothing is timed."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailedError(what)


def check(rows: dict[str, Callable[[list[Any]], Any]], grads: list[Any]) -> dict[str, Any]:
    """The rows against each other, before any timing.

    Raises:
        CheckFailedError: A row computed other values, or a norm is off.
    """
    import mlx.core as mx  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    def host(x: Any) -> np.ndarray:
        return np.array(x.astype(mx.float32))

    ours, found, norm = rows["scaler_core"](grads)
    naive, naive_found, naive_norm = rows["naive"](grads)
    clipped, clip_found, clip_norm = rows["scaler_core_clip"](grads)
    naive_clipped, _, _ = rows["naive_clip"](grads)
    _require(not (found.item() or naive_found.item() or clip_found.item()), "a flag was set")
    for a, b in zip(ours, naive, strict=True):
        _require(np.array_equal(host(a), host(b)), "unscaled values differ from the naive loop's")
    exact = math.sqrt(math.fsum(float(np.sum(np.square(host(y).astype(np.float64)))) for y in ours))
    ours_err = abs(norm.item() - exact) / exact
    naive_err = abs(naive_norm.item() - exact) / exact
    _require(ours_err <= 1e-6, f"scaler-core's norm is off by {ours_err:.3g} relative")
    _require(naive_err <= 0.1, f"the naive norm is off by {naive_err:.3g} relative")
    _require(clip_norm.item() == norm.item(), "the clip measured another norm")
    # Relative to the value, or below float16's smallest normal number to that: a value
    # clipped into float16's subnormals in one row may round to zero in the other.
    floor = float(np.finfo(np.float16).tiny) if grads[0].itemsize == 2 else 1e-30
    worst = max(
        float(np.max(np.abs(host(a) - host(b)) / np.maximum(np.abs(host(b)), floor)))
        for a, b in zip(clipped, naive_clipped, strict=True)
    )
    _require(worst <= 0.1, f"clipped values differ by {worst:.3g} relative")
    return {
        "exact_norm": exact,
        "norm_rel_err": ours_err,
        "naive_norm_rel_err": naive_err,
        "clip_max_rel_diff_vs_naive": worst,
    }


def run(sets: list[str], *, small: bool, many: int, dtype: str, reps: int) -> list[dict[str, Any]]:
    """One result per set: per contender its median, samples and ratios."""
    rows = contenders()
    results = []
    for name in sets:
        grads = make_grads(name, small=small, many=many, dtype=dtype)
        elements = sum(g.size for g in grads)
        first_s = {}
        for row, fn in rows.items():
            first_s[row] = timed(fn, grads)  # compiles (a C++ compiler runs on the CPU)
        checked = check(rows, grads)
        samples: dict[str, list[float]] = {row: [] for row in rows}
        order = list(rows)
        for _ in range(reps):
            random.shuffle(order)
            for row in order:
                samples[row].append(timed(rows[row], grads))
        med = {row: statistics.median(s) for row, s in samples.items()}
        nbytes = elements * grads[0].itemsize
        results.append(
            {
                "set": name,
                "dtype": dtype,
                "leaves": len(grads),
                "elements": elements,
                "check": checked,
                "first_call_s": first_s,
                "samples_s": samples,
                "median_ms": {row: m * 1e3 for row, m in med.items()},
                "copy_gb_per_s": 2 * nbytes / med["copy"] / 1e9,
                "ratios": {
                    "naive_over_scaler_core": med["naive"] / med["scaler_core"],
                    "naive_clip_over_scaler_core_clip": med["naive_clip"] / med["scaler_core_clip"],
                    "scaler_core_over_copy": med["scaler_core"] / med["copy"],
                    "scaler_core_clip_over_copy": med["scaler_core_clip"] / med["copy"],
                    "naive_over_copy": med["naive"] / med["copy"],
                },
            }
        )
    return results


def table(results: list[dict[str, Any]]) -> str:
    """The medians and ratios as a Markdown table."""
    lines = [
        "| set | contender | median ms | vs naive | vs copy |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        med = r["median_ms"]
        for row in CONTENDERS:
            naive = med["naive_clip" if row.endswith("clip") else "naive"]
            vs_naive = f"{naive / med[row]:.2f}x" if row.startswith("scaler_core") else "-"
            lines.append(
                f"| {r['set']} ({r['leaves']} x {r['dtype']}) | {row} | {med[row]:.3g} | "
                f"{vs_naive} | {med[row] / med['copy']:.2f} |"
            )
    return "\n".join(lines)


def _fail(message: str) -> int:
    print(f"bench_mlx: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="GPT-2 shapes / 16 (quick runs)")
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--many", type=int, default=2000, help="arrays in the many set")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", default=None, help="where to write the report")
    args = parser.parse_args(argv)
    sets = args.sets.split(",")
    if [s for s in sets if s not in SETS]:
        return _fail(f"--sets={args.sets!r}, but each must be one of {list(SETS)}")
    if args.dtype not in DTYPES:
        return _fail(f"--dtype={args.dtype!r}, but it must be one of {list(DTYPES)}")
    for name in ("many", "reps"):
        if getattr(args, name) < 1:
            return _fail(f"--{name}={getattr(args, name)}, but it must be at least 1")
    try:
        import mlx.core as mx  # noqa: PLC0415 - optional: the benchmark says so when missing
    except ImportError as exc:
        print(f"skipped: {exc} (pip install 'scaler-core[mlx]')")
        return 0
    try:
        results = run(sets, small=args.small, many=args.many, dtype=args.dtype, reps=args.reps)
    except CheckFailedError as exc:
        print(f"bench_mlx: {exc}", file=sys.stderr)
        return 1
    device = mx.default_device().type.name  # "cpu" or "gpu"
    text = table(results)
    print(text)
    report = {
        "command": " ".join(["python", "benchmarks/bench_mlx.py", *(argv or sys.argv[1:])]),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "mlx": importlib.metadata.version("mlx"),
            "device": str(mx.default_device()),
            "cores": os.cpu_count(),
            "loadavg": list(os.getloadavg()),
        },
        "small": args.small,
        "reps": args.reps,
        "results": results,
        "table": text,
    }
    options = {"small": args.small, args.dtype: args.dtype != "float32"}
    variant = "-".join(v for v, on in options.items() if on)
    out = args.json or next_result("mlx", device, variant)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
