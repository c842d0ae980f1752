"""Jitted unscale + detect: scaler-core's JAX backend against the jmp pattern.

Contenders, each one ``jax.jit``-ed function of ``(grads, scale)``, run
interleaved (A B A B ...) so that machine noise hits both alike; medians:

* ``scaler_core``: ``scaler_core.unscale(grads, scale)``.
* ``jmp_pattern``: ``tree_map(g * inv)`` then ``jmp.all_finite`` (the code jmp's
  README recommends; re-implemented here when jmp is not installed).
* ``multiply_only`` (the floor): ``tree_map(g * inv)`` with no detection at
  all. Every per-leaf implementation pays at least this, because each output
  leaf is its own buffer; the jmp pattern's cost above it is its detection.
* ``tiny_outputs`` (orientation only): ``tree_map(g[:1] * inv)``, one element
  of each leaf; what the output leaves cost whatever they compute.
* ``flat_buffer`` (orientation only): the same values held in one flat array,
  one fused multiply and one float-sum detection; what a per-leaf tree cannot
  beat, since every leaf is its own buffer and kernel.

Trees: ``gpt2`` (GPT-2-small shapes: 148 float32 leaves, 124M values; ``--small``
divides every leaf by 16) and ``many`` (``--many`` leaves of 1024 float32, 2000 by
default).

Usage::

    python benchmarks/bench_jax.py [--small] [--device cpu|gpu|auto] [--reps 21]
        [--trees gpt2,many] [--sync flag|tree] [--json out.json]

Without ``--json`` the rows go to the next ``jax-<device>[-small][-sync-tree]-<n>.json``
in ``benchmarks/results/`` (the scheme of ``benchmarks/_results.py``).

Times are wall-clock per call until the computation is done: by default the
timer waits on the call's scalar output only (``--sync flag``), since all
outputs of one XLA execution complete together (checked after every call,
outside the timer: every leaf is then ready), while ``jax.block_until_ready``
on the whole tree (``--sync tree``) adds a per-leaf host cost of its own to
every contender. Compile time is reported separately (XLA's compile time grows
quickly with the leaf count).
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

import jax
import jax.numpy as jnp
import numpy as np

import scaler_core as sc

if __package__:
    from ._results import next_result
    from ._sets import gpt2_shapes
else:  # run as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks._results import next_result
    from benchmarks._sets import gpt2_shapes


def make_tree(kind: str, small: bool, device: Any, many: int = 2000) -> list[Any]:
    rng = np.random.default_rng(0)
    shapes = gpt2_shapes(16 if small else 1) if kind == "gpt2" else [(1024,)] * many
    return [jax.device_put(rng.standard_normal(s, dtype=np.float32) * 1024, device) for s in shapes]


def jmp_pattern(grads: Any, scale: Any) -> tuple[Any, Any]:
    inv = 1.0 / scale
    out = jax.tree_util.tree_map(lambda g: g * inv, grads)
    try:
        import jmp  # noqa: PLC0415

        finite = jmp.all_finite(out)
    except ImportError:
        finite = jnp.stack([jnp.isfinite(x).all() for x in jax.tree_util.tree_leaves(out)]).all()
    return out, ~finite


def ours(grads: Any, scale: Any) -> tuple[Any, Any]:
    return sc.unscale(grads, scale, backend="jax")


def multiply_only(grads: Any, scale: Any) -> tuple[Any, Any]:
    inv = 1.0 / scale
    return jax.tree_util.tree_map(lambda g: g * inv, grads), inv


def tiny_outputs(grads: Any, scale: Any) -> tuple[Any, Any]:
    inv = 1.0 / scale
    return jax.tree_util.tree_map(lambda g: g.reshape(-1)[:1] * inv, grads), inv


def flat_buffer(flat: Any, scale: Any) -> tuple[Any, Any]:
    y = flat * (jnp.float32(1.0) / scale)
    return y, jnp.isnan(jnp.sum(y - y))


def timed(fn: Callable[..., Any], arg: Any, scale: Any, sync: str) -> float:
    """Seconds of one call until its computation is done (see the module doc)."""
    t0 = time.perf_counter()
    out, scalar = fn(arg, scale)
    if sync == "tree":
        jax.block_until_ready((out, scalar))
    else:
        scalar.block_until_ready()
    took = time.perf_counter() - t0
    if not all(leaf.is_ready() for leaf in jax.tree_util.tree_leaves(out)):
        raise AssertionError("a leaf was not ready when the scalar output was: use --sync tree")
    return took


def run(
    trees: list[str],
    small: bool,
    device: Any,
    reps: int,
    *,
    many: int = 2000,
    sync: str = "flag",
) -> list[dict[str, Any]]:
    rows = []
    scale = jax.device_put(jnp.float32(1024.0), device)
    for kind in trees:
        tree = make_tree(kind, small, device, many)
        flat = jax.device_put(jnp.concatenate([x.ravel() for x in tree]), device)
        n = sum(x.size for x in tree)
        inputs: dict[str, tuple[Callable[..., Any], Any]] = {
            "scaler_core": (jax.jit(ours), tree),
            "jmp_pattern": (jax.jit(jmp_pattern), tree),
            "multiply_only": (jax.jit(multiply_only), tree),
            "tiny_outputs": (jax.jit(tiny_outputs), tree),
            "flat_buffer": (jax.jit(flat_buffer), flat),
        }
        compile_s, times = {}, {k: [] for k in inputs}
        for name, (fn, arg) in inputs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(arg, scale))
            compile_s[name] = time.perf_counter() - t0
            print(f"{kind}: {name} compiled in {compile_s[name]:.1f}s", flush=True)
        for _ in range(reps):
            for name, (fn, arg) in inputs.items():
                times[name].append(timed(fn, arg, scale, sync))
        base = statistics.median(times["jmp_pattern"])
        for name, ts in times.items():
            med = statistics.median(ts)
            rows.append(
                {
                    "tree": kind,
                    "leaves": len(tree),
                    "elements": n,
                    "contender": name,
                    "median_ms": med * 1e3,
                    "gb_per_s": 2 * 4 * n / med / 1e9,  # one read + one write of float32
                    "speedup_vs_jmp": base / med,
                    "us_per_leaf": med / len(tree) * 1e6,
                    "compile_s": compile_s[name],
                    "sync": sync,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="GPT-2 leaves / 16 (quick runs)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--trees", default="gpt2,many")
    ap.add_argument("--many", type=int, default=2000, help="leaf count of the many tree")
    ap.add_argument(
        "--sync", default="flag", choices=["flag", "tree"], help="what the timer waits on"
    )
    ap.add_argument("--json", default=None, help="where to write the rows (default: results/)")
    args = ap.parse_args()
    device = jax.devices()[0] if args.device == "auto" else jax.devices(args.device)[0]
    rows = run(args.trees.split(","), args.small, device, args.reps, many=args.many, sync=args.sync)
    print(f"\ndevice: {device} ({device.platform}), jax {jax.__version__}, {platform.machine()}")
    head = f"{'tree':6} {'contender':12} {'median ms':>10} {'GB/s':>7} {'x jmp':>6} {'us/leaf':>8}"
    print(head + f" {'compile s':>9}")
    for r in rows:
        print(
            f"{r['tree']:6} {r['contender']:12} {r['median_ms']:10.3f} {r['gb_per_s']:7.2f} "
            f"{r['speedup_vs_jmp']:6.2f} {r['us_per_leaf']:8.2f} {r['compile_s']:9.1f}"
        )
    meta = {"device": str(device), "platform": device.platform, "jax": jax.__version__}
    options = {"small": args.small, "sync-tree": args.sync == "tree"}
    variant = "-".join(v for v, on in options.items() if on)
    out = args.json or next_result("jax", device.platform, variant)
    with open(out, "w") as f:
        json.dump({"meta": meta, "small": args.small, "rows": rows}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
