"""Two checkouts side by side: the hot calls of the built-in backends, before and after.

A change to the core's checks (how a flag, a norm or a library is recognised) or to its
transition runs on every step of every backend. This measures what it costs: two worker
processes, one importing scaler-core from a checkout of ``--before`` (a git revision,
extracted with ``git archive``), one from ``--after`` (a directory, the working tree by
default), each with the same calls built the same way. The driver asks the two for one round at a
time, alternating which goes first; a round times ``--calls`` calls of each case. It
prints, per call, each side's median and fastest round and the median of the paired
differences (after minus before, the two workers' rounds side by side), which is what
makes a difference of a few percent visible on a shared machine.

Cases (``--cases``, all by default):

* ``update_host_flag``: ``sc.update(state, numpy.bool_)``, the host flag path;
* ``update_python_flag``: ``sc.update(state, False)``, the host transition;
* ``update_python_flag_found``: ``sc.update(state, True)``, the host transition backing off;
* ``host_update_spikes``: ``sc.update(state, False, 1.0)`` with spike skipping on (a full
  window), the host transition with its spike arithmetic;
* ``find_non_finite_unnamed`` / ``_named``: ``sc.find_non_finite`` on 200 NumPy arrays
  of 256 float32, the backend found from the arrays / named;
* ``torch_device_update``: ``get_backend("torch").update(state, flag)`` with a 0-d bool
  tensor (the device transition on CPU tensors: the flag check and the library check);
* ``torch_unscale``: ``sc.unscale`` on 200 torch tensors of 256 float32 (scale 1.0);
* ``numpy_unscale_2000_unnamed`` / ``_named``: ``sc.unscale`` on 2000 NumPy arrays of 256
  float32, the backend found from the arrays / named;
* ``dropin_cycle_1`` / ``_200``: the drop-in's ``unscale_``, ``step``, ``update`` on 1 /
  200 parameters of 256 float32 (foreach SGD, learning rate 0, the same gradients);
* ``dropin_clip_2000``: the drop-in's ``unscale_and_clip_(opt, 1.0)``, ``step``,
  ``update`` on 2000 parameters of 256 float32;
* ``jax_update``: ``sc.update(state, flag)`` with a JAX flag, eagerly;
* ``jax_jit_update`` / ``_spikes``: a ``jax.jit`` of ``sc.update(state, flag)`` (and of
  ``sc.update(state, flag, norm)`` with spike skipping on), the state, the flag and the
  norm on the device, timed to ``jax.block_until_ready`` of the new state.

Usage::

    python benchmarks/paired.py --before HEAD [--after .] [--rounds 61] [--calls 300]
        [--cases a,b] [--md out.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = (
    "update_host_flag",
    "update_python_flag",
    "update_python_flag_found",
    "host_update_spikes",
    "find_non_finite_unnamed",
    "find_non_finite_named",
    "torch_device_update",
    "torch_unscale",
    "numpy_unscale_2000_unnamed",
    "numpy_unscale_2000_named",
    "dropin_cycle_1",
    "dropin_cycle_200",
    "dropin_clip_2000",
    "jax_update",
    "jax_jit_update",
    "jax_jit_update_spikes",
)


# ------------------------------------------------------------------ the worker
def _build(case: str) -> Callable[[], Any] | None:  # noqa: PLR0911, PLR0912 - a branch per case
    """One call of ``case``, ready to time; ``None`` where its library is missing."""
    import numpy as np  # noqa: PLC0415

    import scaler_core as sc  # noqa: PLC0415

    state = sc.init(sc.ScalerConfig(growth_interval=10**6))
    if case == "update_host_flag":
        flag = np.bool_(False)
        return lambda: sc.update(state, flag)
    if case == "update_python_flag":
        return lambda: sc.update(state, False)
    if case == "update_python_flag_found":
        return lambda: sc.update(state, True)
    if case == "host_update_spikes":
        spiking = _spiking()
        return lambda: sc.update(spiking, False, 1.0)
    if case.startswith("find_non_finite"):
        grads = [np.ones(256, np.float32) for _ in range(200)]
        if case == "find_non_finite_named":
            return lambda: sc.find_non_finite(grads, backend="numpy")
        return lambda: sc.find_non_finite(grads)
    if case.startswith("numpy_unscale_2000"):
        arrays = [np.ones(256, np.float32) for _ in range(2000)]
        if case.endswith("_named"):
            return lambda: sc.unscale(arrays, 1.0, backend="numpy")
        return lambda: sc.unscale(arrays, 1.0)
    if case.startswith("jax"):
        return _build_jax(case, state)
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    if case == "torch_device_update":
        backend, tflag = sc.get_backend("torch"), torch.tensor(False)
        return lambda: backend.update(state, tflag)
    if case == "torch_unscale":
        tgrads = [torch.ones(256) for _ in range(200)]
        return lambda: sc.unscale(tgrads, 1.0)
    if case.startswith("dropin"):
        return _build_dropin(case)
    raise SystemExit(f"paired: unknown case {case!r}")


def _build_dropin(case: str) -> Callable[[], Any]:
    """A drop-in step on ``case``'s parameters: the same gradients every call (scale 1,
    a learning rate of 0), as a loop that zeroes them in place sees them."""
    import torch  # noqa: PLC0415

    from scaler_core.torch import GradScaler  # noqa: PLC0415

    count = int(case.rsplit("_", 1)[1])
    params = [torch.nn.Parameter(torch.ones(256)) for _ in range(count)]
    for p in params:
        p.grad = torch.full((256,), 0.5)
    opt = torch.optim.SGD(params, lr=0.0, foreach=True)
    scaler = GradScaler("cpu", init_scale=1.0, growth_interval=10**6)
    scaler.scale(torch.ones(()))

    def cycle() -> None:
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    def clip() -> None:
        scaler.unscale_and_clip_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    return clip if case.startswith("dropin_clip") else cycle


def _spiking() -> Any:
    """A host state with spike skipping on and a full window, so every step tests for a spike."""
    import scaler_core as sc  # noqa: PLC0415

    state = sc.init(sc.ScalerConfig(growth_interval=10**6, spike_threshold=6.0))
    for i in range(state.config.spike_window):
        state = sc.update(state, False, 1.0 + (i % 7) / 100)
    return state


def _build_jax(case: str, state: Any) -> Callable[[], Any] | None:
    """A ``jax_*`` case (``None`` without JAX)."""
    try:
        import jax  # noqa: PLC0415
        import jax.numpy as jnp  # noqa: PLC0415
    except ImportError:
        return None
    import scaler_core as sc  # noqa: PLC0415
    from scaler_core.jax import to_device  # noqa: PLC0415

    jflag = jnp.asarray(False)
    if case == "jax_update":
        return lambda: sc.update(state, jflag)
    jitted = jax.jit(sc.update)
    if case == "jax_jit_update":
        on_device = to_device(state)
        return lambda: jax.block_until_ready(jitted(on_device, jflag))
    if case == "jax_jit_update_spikes":
        spiking, norm = to_device(_spiking()), jnp.asarray(1.0, jnp.float32)
        return lambda: jax.block_until_ready(jitted(spiking, jflag, norm))
    raise SystemExit(f"paired: unknown case {case!r}")


def worker() -> None:
    """Read ``[cases, calls]`` rounds from stdin; answer each with per-call seconds."""
    built: dict[str, Callable[[], Any] | None] = {}
    for line in sys.stdin:
        cases, calls = json.loads(line)
        out: dict[str, float | None] = {}
        for case in cases:
            if case not in built:
                built[case] = _build(case)
                if built[case] is not None:
                    for _ in range(calls):  # warm: caches, plans, first dispatch
                        built[case]()  # type: ignore[misc]
            call = built[case]
            if call is None:
                out[case] = None
                continue
            start = time.perf_counter()
            for _ in range(calls):
                call()
            out[case] = (time.perf_counter() - start) / calls
        print(json.dumps(out), flush=True)


# ------------------------------------------------------------------ the driver
def _checkout(rev: str, into: Path) -> Path:
    """``rev`` of this repository, extracted into ``into`` (scaler_core/ and backends/)."""
    archive = into / "tree.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "-o", str(archive), rev, "scaler_core", "backends"],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def _start(tree: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.Popen(
        [sys.executable, "-c", "import benchmarks.paired as p; p.worker()"],
        cwd=tree,
        env={**env, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _ask(proc: subprocess.Popen[str], cases: list[str], calls: int) -> dict[str, float | None]:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(json.dumps([cases, calls]) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise SystemExit("paired: a worker died (run its case alone to see why)")
    return json.loads(line)  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a git revision of this repository")
    parser.add_argument("--after", type=Path, default=ROOT, help="a checkout (default: here)")
    parser.add_argument("--rounds", type=int, default=61)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--md", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or args.rounds < 1 or args.calls < 1:
        print(
            f"paired: --cases {unknown} unknown (known: {', '.join(CASES)})"
            if unknown
            else "paired: --rounds and --calls must be >= 1",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        before = _checkout(args.before, Path(tmp))
        procs = {"before": _start(before), "after": _start(args.after.resolve())}
        times: dict[str, dict[str, list[float]]] = {s: {c: [] for c in cases} for s in procs}
        try:
            for i in range(args.rounds):
                order = list(procs) if i % 2 == 0 else list(procs)[::-1]
                shuffled = random.sample(cases, len(cases))
                for side in order:
                    for case, t in _ask(procs[side], shuffled, args.calls).items():
                        if t is not None:
                            times[side][case].append(t)
                print(f"\rround {i + 1}/{args.rounds}", end="", file=sys.stderr, flush=True)
        finally:
            for proc in procs.values():
                proc.kill()
        print(file=sys.stderr)
    lines = [
        "| case | before: median (fastest) | after: median (fastest) | paired difference |",
        "|---|---:|---:|---:|",
    ]
    for case in cases:
        b, a = times["before"][case], times["after"][case]
        if not a or not b:
            lines.append(f"| `{case}` | n/a | n/a | its library is missing |")
            continue
        diff = statistics.median(y - x for x, y in zip(b, a, strict=True))
        lines.append(
            f"| `{case}` | {statistics.median(b) * 1e6:.2f} us ({min(b) * 1e6:.2f}) | "
            f"{statistics.median(a) * 1e6:.2f} us ({min(a) * 1e6:.2f}) | "
            f"{diff * 1e6:+.2f} us ({diff / statistics.median(b):+.1%}) |"
        )
    table = "\n".join(lines)
    print(f"before: {args.before}; after: {args.after}; {args.rounds} rounds of {args.calls}")
    print(table)
    if args.md is not None:
        args.md.write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
