"""Time every contender on every set in one process: interleaved, after a warm-up."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

try:
    import scaler_core as sc
    from scaler_core.backends import _numpy as _numpy_backend
except ImportError as exc:  # pragma: no cover - a setup error, explained
    raise SystemExit(
        f"benchmarks need scaler-core installed ({exc}); from the repository root run "
        f'pip install -e ".[fast]" --config-settings editable_mode=strict'
    ) from exc

from benchmarks._contenders import CONTENDERS, NO_FLAG
from benchmarks._results import next_result
from benchmarks._sets import SETS, build


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "scaler_core": getattr(sc, "__version__", "?"),
        "scaler_core_file": sc.__file__,
        "numpy_path": sc.get_backend("numpy").path,  # type: ignore[attr-defined]
    }
    try:
        with open("/proc/loadavg") as f:
            info["loadavg_at_start"] = f.read().split()[:3]
    except OSError:
        pass
    for name in ("numba", "torch"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                continue
        info[name] = module.__version__
    if "torch" in info:
        import torch  # noqa: PLC0415

        info["torch_threads"] = torch.get_num_threads()
    return info


def run_set(
    name: str,
    *,
    small: bool,
    dirty: bool,
    reps: int,
    warmup: int,
    seed: int,
    cache: str = "cold",
) -> dict[str, Any]:
    """All contenders on one set: returns medians and the raw samples (seconds).

    ``cache="cold"`` times each call as the round's order comes, so the data
    are wherever the previous contender (or the machine) left them.
    ``cache="hot"`` precedes every timed call by an untimed call of the same
    contender on the same data: each is timed on data its own pass just
    touched, cache-resident when the set fits in the caches.
    """
    if cache not in ("cold", "hot"):
        raise ValueError(f"cache={cache!r}, but it must be 'cold' or 'hot'")
    gset = SETS[name]
    grads = build(gset, small=small, dirty=dirty, seed=seed)
    nbytes = sum(g.nbytes for g in grads)
    works = {}
    for cname, contender in CONTENDERS.items():
        work = contender.make(grads, gset.task)
        if work is not None:
            works[cname] = work

    def check(cname: str, got: bool) -> None:
        """A contender's flag must match the data it ran on."""
        if cname not in NO_FLAG and got != dirty:
            raise AssertionError(f"{cname} on {name}: flag {got}, expected {dirty}")

    for cname, work in works.items():
        for _ in range(warmup):
            check(cname, work())
    samples: dict[str, list[float]] = {c: [] for c in works}
    order = list(works)
    shuffle = random.Random(seed)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(reps):
            shuffle.shuffle(order)  # interleaved, in a new order each round
            for cname in order:
                if cache == "hot":
                    check(cname, works[cname]())
                t0 = time.perf_counter_ns()
                got = works[cname]()
                samples[cname].append((time.perf_counter_ns() - t0) * 1e-9)
                check(cname, got)
    finally:
        if gc_was:
            gc.enable()
    medians = {c: statistics.median(s) for c, s in samples.items()}
    return {
        "set": name,
        "task": gset.task,
        "dtype": np.dtype(gset.dtype).name,
        "arrays": len(grads),
        "elements": sum(g.size for g in grads),
        "bytes": nbytes,
        "dirty": dirty,
        "cache": cache,
        "reps": reps,
        "median_s": medians,
        "gb_per_s": {c: nbytes / m / 1e9 for c, m in medians.items()},
        "speedup_of_scaler_core": {
            c: m / medians["scaler-core"] for c, m in medians.items() if c != "scaler-core"
        },
        "samples_s": samples,
    }


def table(results: list[dict[str, Any]]) -> str:
    """A Markdown table: median ms and GB/s per contender, scaler-core's speedups."""
    names = [c for c in CONTENDERS if any(c in r["median_s"] for r in results)]
    head = "| set | task | data | " + " | ".join(names) + " | scaler-core speedup |"
    lines = [head, "|" + "---|" * (len(names) + 4)]
    for r in results:
        cells = []
        for c in names:
            m = r["median_s"].get(c)
            cells.append("-" if m is None else f"{m * 1e3:.3g} ms ({r['gb_per_s'][c]:.3g} GB/s)")
        ups = ", ".join(f"{v:.2f}x {c}" for c, v in r["speedup_of_scaler_core"].items())
        data = f"{r['arrays']} x {r['dtype']}, {r['bytes'] / 1e6:.4g} MB" + (
            ", one inf" if r["dirty"] else ""
        )
        lines.append(f"| {r['set']} | {r['task']} | {data} | " + " | ".join(cells) + f" | {ups} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run, print the table and save the JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--small", action="store_true", help="tiny sets: a smoke run for CI")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma list of {list(SETS)}")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default 30; 5 small)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per contender first")
    parser.add_argument("--clean-only", action="store_true", help="skip the one-inf variants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cache",
        choices=("cold", "hot"),
        default="cold",
        help="hot: an untimed call of the same contender right before each timed one",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default: the next unscale-cpu[-small][-hot]-<n>.json in results/)",
    )
    args = parser.parse_args(argv)
    names = [s for s in args.sets.split(",") if s]
    unknown = [s for s in names if s not in SETS]
    if unknown:
        parser.error(f"--sets has unknown {unknown}; choose from {list(SETS)}")
    reps = args.reps if args.reps is not None else (5 if args.small else 30)
    if reps < 1:
        parser.error(f"--reps={reps}, but it must be >= 1")
    info = machine()
    t0 = time.perf_counter()
    sc.unscale([np.ones(4, np.float32)], 2.0, backend="numpy")  # compile or load from disk
    info["first_call_s"] = time.perf_counter() - t0
    print(f"# {info['cpu']}, {info['cores']} cores; numpy path: {info['numpy_path']}")
    results = []
    for name in names:
        for dirty in (False,) if args.clean_only else (False, True):
            results.append(
                run_set(
                    name,
                    small=args.small,
                    dirty=dirty,
                    reps=reps,
                    warmup=args.warmup,
                    seed=args.seed,
                    cache=args.cache,
                )
            )
            print(f"  done {name}{' (one inf)' if dirty else ''}", file=sys.stderr)
    text = table(results)
    print(text)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    options = {"small": args.small, "hot": args.cache == "hot"}
    variant = "-".join(v for v, on in options.items() if on)
    out = args.out or next_result("unscale", "cpu", variant)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": "python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": info,
        "when": stamp,
        "results": results,
        "table": text,
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(out)
    print(f"saved {out}")
    _ = _numpy_backend  # the module whose path is reported above
    return 0
