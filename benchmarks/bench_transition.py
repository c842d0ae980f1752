"""What one transition costs on each namespace its one rule runs on.

``scaler_core._rule.advance`` states the rule once, branch-free over an array
namespace; ``host_update`` runs it on Python scalars (``scaler_core._rule.HOST``:
``where`` is a conditional expression, float32 rounding is ``struct``), and
``device_update`` on the 0-d arrays of any other namespace. The property tests
hold every namespace equal bit for bit. This measures why the host keeps a
namespace of its own rather than stepping through an array library: the cost on
the step path of every host loop (the facade, ``scaler_core.update``, the drop-in
with a CPU state), interleaved, medians of ``--reps`` rounds of ``--steps`` updates
each:

* ``host_update``: the rule on Python scalars;
* ``device_update_numpy``: the same rule on NumPy 0-d arrays;
* ``device_update_torch``: the same rule through the drop-in's torch namespace on
  CPU tensors (only when torch is installed).

Each with spike skipping off (the default) and on (``--spikes``, a norm of 1.0 on
every step).

Usage::

    python benchmarks/bench_transition.py [--steps 2000] [--reps 15] [--spikes]
        [--json out.json]
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

from benchmarks._results import next_result


def _contenders(spikes: bool) -> dict[str, Callable[[Any, bool], Any]]:
    import numpy as np  # noqa: PLC0415

    import scaler_core as sc  # noqa: PLC0415
    from scaler_core._state import device_update, host_update  # noqa: PLC0415

    norm = 1.0 if spikes else None
    out: dict[str, Callable[[Any, bool], Any]] = {
        "host_update": lambda s, f: host_update(s, f, norm),
        "device_update_numpy": lambda s, f: device_update(np, s, f, norm),
    }
    try:
        import torch  # noqa: PLC0415

        from scaler_core.backends._torch import TorchNamespace  # noqa: PLC0415
    except ImportError:
        return out
    xp = TorchNamespace(torch.device("cpu"))
    out["device_update_torch"] = lambda s, f: device_update(xp, s, torch.tensor(f), norm)
    del sc
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--spikes", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.reps < 1:
        print("bench_transition: --steps and --reps must be >= 1", file=sys.stderr)
        return 2
    import scaler_core as sc  # noqa: PLC0415

    config = sc.ScalerConfig(growth_interval=100, spike_threshold=6.0 if args.spikes else None)
    flags = [i % 97 == 0 for i in range(args.steps)]  # an overflow now and then
    contenders = _contenders(args.spikes)
    # Every contender gives the host form's states (checked before timing).
    want = sc.init(config)
    for flag in flags:
        want = contenders["host_update"](want, flag)
    for name, step in contenders.items():
        state = sc.init(config)
        for flag in flags:
            state = step(state, flag)
        if state.to_host() != want:
            print(f"bench_transition: {name} ended at {state.to_host()}, not {want}")
            return 1
    times: dict[str, list[float]] = {name: [] for name in contenders}
    order = list(contenders)
    for _ in range(args.reps):
        random.shuffle(order)  # interleaved, in a new order each round
        for name in order:
            step, state = contenders[name], sc.init(config)
            start = time.perf_counter()
            for flag in flags:
                state = step(state, flag)
            times[name].append((time.perf_counter() - start) / args.steps)
    medians = {name: statistics.median(t) for name, t in times.items()}
    host = medians["host_update"]
    print(f"{'contender':<22}{'us/step':>10}{'x host':>9}")
    for name, t in medians.items():
        print(f"{name:<22}{t * 1e6:>10.2f}{t / host:>9.1f}")
    out = args.json or next_result("transition", "cpu", "spikes" if args.spikes else "")
    payload = {
        "benchmark": "transition",
        "python": platform.python_version(),
        "machine": platform.machine(),
        "steps": args.steps,
        "reps": args.reps,
        "spikes": args.spikes,
        "us_per_step": {name: t * 1e6 for name, t in medians.items()},
        "ratio_to_host": {name: t / host for name, t in medians.items()},
    }
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
