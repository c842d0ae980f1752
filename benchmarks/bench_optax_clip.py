"""Does XLA fuse ``optax.clip_by_global_norm`` with the unscale as well as scaler-core does?

Three jitted functions on the same pytree of float32 gradients (``--leaves`` arrays
of ``--size`` elements), interleaved, medians of ``--reps`` rounds:

* ``unscale_and_clip``: ``scaler_core.unscale_and_clip(grads, scale, 1.0)``;
* ``unscale_then_optax_clip``: ``scaler_core.unscale``, then
  ``optax.clip_by_global_norm(1.0)``, then the skip select (what
  ``optax.chain(optax.clip_by_global_norm(1.0), ...)`` inside
  ``scaler_core.optax.with_loss_scaling`` computes);
* ``unscale``: ``scaler_core.unscale`` alone (one read, one write).

Both clipping rows must agree to float32 rounding (checked before timing).

Usage::

    python benchmarks/bench_optax_clip.py [--leaves 48] [--size 1048576] [--reps 15]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=48)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.leaves < 1 or args.size < 1 or args.reps < 1:
        print("bench_optax_clip: --leaves, --size and --reps must be >= 1", file=sys.stderr)
        return 2
    try:
        import jax  # noqa: PLC0415 - optional: the benchmark says so when missing
        import jax.numpy as jnp  # noqa: PLC0415
        import numpy as np  # noqa: PLC0415
        import optax  # noqa: PLC0415
    except ImportError as exc:
        print(f"skipped: {exc} (pip install 'scaler-core[optax]')")
        return 0
    import scaler_core as sc  # noqa: PLC0415

    rng = np.random.default_rng(0)
    tree = {
        f"w{i}": jnp.asarray(rng.standard_normal(args.size).astype(np.float32) * 1024)
        for i in range(args.leaves)
    }
    scale = jnp.float32(1024.0)
    clip = optax.clip_by_global_norm(1.0)
    clip_state = clip.init(tree)

    def fused(g: Any, s: Any) -> Any:
        out, found, _ = sc.unscale_and_clip(g, s, 1.0)
        return out, found

    def chained(g: Any, s: Any) -> Any:
        unscaled, found = sc.unscale(g, s)
        clipped, _ = clip.update(unscaled, clip_state)
        return jax.tree_util.tree_map(lambda a, b: jnp.where(found, a, b), g, clipped), found

    rows = {
        "unscale_and_clip": jax.jit(fused),
        "unscale_then_optax_clip": jax.jit(chained),
        "unscale": jax.jit(sc.unscale),
    }
    a = rows["unscale_and_clip"](tree, scale)[0]
    b = rows["unscale_then_optax_clip"](tree, scale)[0]
    worst = max(float(jnp.max(jnp.abs(a[k] - b[k]) / jnp.maximum(jnp.abs(b[k]), 1e-30))) for k in a)
    if worst > 1e-6:
        print(f"bench_optax_clip: the two clips differ by {worst:.3g} relative", file=sys.stderr)
        return 1
    for fn in rows.values():
        jax.block_until_ready(fn(tree, scale))
    samples: dict[str, list[float]] = {name: [] for name in rows}
    order = list(rows)
    for _ in range(args.reps):
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            jax.block_until_ready(rows[name](tree, scale))
            samples[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
    base = medians["unscale_then_optax_clip"]
    print("| row | median ms | vs unscale + optax clip |\n|---|---|---|")
    for name, ms in medians.items():
        print(f"| {name} | {ms:.3g} | {base / ms:.2f}x |")
    if args.json is not None:
        report = {
            "command": " ".join(
                ["python", "benchmarks/bench_optax_clip.py", *(argv or sys.argv[1:])]
            ),
            "machine": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                "jax": jax.__version__,
                "optax": optax.__version__,
                "cores": os.cpu_count(),
                "loadavg": list(os.getloadavg()),
            },
            "leaves": args.leaves,
            "size": args.size,
            "reps": args.reps,
            "max_rel_diff": worst,
            "median_ms": medians,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
