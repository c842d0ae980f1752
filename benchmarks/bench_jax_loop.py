"""A whole jitted mixed-precision training step: jmp's loop against scaler-core's port.

Each contender is one ``jax.jit``-ed step of the same float16 MLP, ``(params,
scaler state, batch) -> (params, scaler state)``: scale the loss, take the
gradients, unscale them, detect NaN/inf, advance the scale, and keep the old
parameters on a skipped step. Interleaved (A B C A B C ...), medians of ``--reps``
rounds of ``--steps`` calls back to back, each round waited on at its end (so JAX may
dispatch a call while XLA still runs the one before, as a training loop does):

* ``jmp``: jmp's own ``DynamicLossScale`` (``scale``, ``unscale``, ``all_finite``,
  ``adjust``, ``select_tree``), as its README writes the loop (skipped without jmp);
* ``scaler_core``: the port of that loop in docs/jax.md (``sc.unscale``,
  ``sc.update``, ``select`` on ``sc.step_skipped``), with ``sc.preset("jmp")``;
* ``scaler_core_spikes``: the same with spike skipping on (``unscale_and_norm`` and
  the statistics): what spike skipping costs when it is used.

Beside the steps, in the same rounds, the scaler's own share: a jitted
``sc.update(state, found)`` alone (``us_per_update``), with spike skipping off
(``spikes_off``, the preset) and on (``spikes_on``, given a norm). A call of a
jitted function this small is mostly dispatch, so it shows what each state leaf
costs a step.

Before timing, the contenders' parameters and scales are checked equal after a run
that overflows once (jmp's rule and the preset agree step by step).

Usage::

    python benchmarks/bench_jax_loop.py [--width 64] [--steps 200] [--reps 15]
        [--json out.json]

Without ``--json`` the result goes to the next ``jax-loop-<device>[-width-<w>]-<n>.json``
in ``benchmarks/results/`` (the scheme of ``benchmarks/_results.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root holds `benchmarks`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

import scaler_core as sc
from benchmarks._results import next_result
from scaler_core.jax import to_device

JAX = sc.get_backend("jax")


def _loss(params: dict[str, Any], x: Any) -> Any:
    h = jnp.tanh(x.astype(jnp.float16) @ params["w1"].astype(jnp.float16))
    out = h @ params["w2"].astype(jnp.float16)
    return jnp.mean(out.astype(jnp.float32) ** 2)


def _sgd(params: Any, grads: Any) -> Any:
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)


def jmp_step() -> Callable[..., Any] | None:
    try:
        import jmp  # noqa: PLC0415 - an oracle, optional
    except ImportError:
        return None

    @jax.jit
    def step(params: Any, loss_scale: Any, x: Any) -> tuple[Any, Any]:
        grads = jax.grad(lambda p: loss_scale.scale(_loss(p, x)))(params)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        return jmp.select_tree(finite, _sgd(params, grads), params), loss_scale

    return step


@jax.jit
def sc_step(params: Any, state: sc.ScalerState, x: Any) -> tuple[Any, Any]:
    grads = jax.grad(lambda p: _loss(p, x) * state.scale)(params)
    grads, found = sc.unscale(grads, state)
    state = sc.update(state, found)
    return JAX.select(sc.step_skipped(state, jnp), params, _sgd(params, grads)), state


#: The jitted transition alone, as the steps run it.
sc_update = jax.jit(sc.update)


@jax.jit
def sc_spike_step(params: Any, state: sc.ScalerState, x: Any) -> tuple[Any, Any]:
    grads = jax.grad(lambda p: _loss(p, x) * state.scale)(params)
    grads, found, norm = sc.unscale_and_norm(grads, state)
    state = sc.update(state, found, grad_norm=norm)
    return JAX.select(sc.step_skipped(state, jnp), params, _sgd(params, grads)), state


def _setup(width: int) -> tuple[dict[str, Any], Any]:
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((width, width)) / np.sqrt(width), jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((width, 8)) / np.sqrt(width), jnp.float32),
    }
    return params, jnp.asarray(rng.standard_normal((32, width)), jnp.float32)


def check(width: int) -> None:
    """jmp's loop and the port take the same steps (one overflow included)."""
    step = jmp_step()
    if step is None:
        return
    import jmp  # noqa: PLC0415

    params, x = _setup(width)
    a, b = dict(params), dict(params)
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**15), period=3)
    state = to_device(sc.init(sc.preset("jmp", loss_scale=2.0**15, period=3)))
    for i in range(8):
        xi = x * (jnp.inf if i == 2 else 1.0)
        a, loss_scale = step(a, loss_scale, xi)
        b, state = sc_step(b, state, xi)
        if float(loss_scale.loss_scale) != state.current_scale():
            raise AssertionError(f"step {i}: jmp's scale {loss_scale.loss_scale}, ours {state}")
        for k in a:
            if not np.array_equal(np.asarray(a[k]), np.asarray(b[k])):
                raise AssertionError(f"step {i}: parameters {k} differ")


def run(width: int, steps: int, reps: int) -> dict[str, Any]:
    params, x = _setup(width)
    contenders: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
        "scaler_core": (sc_step, (params, to_device(sc.init(sc.preset("jmp"))), x)),
        "scaler_core_spikes": (
            sc_spike_step,
            (params, to_device(sc.init(sc.preset("jmp", spike_threshold=6.0))), x),
        ),
    }
    step = jmp_step()
    if step is not None:
        import jmp  # noqa: PLC0415

        scaler = jmp.DynamicLossScale(jnp.float32(2.0**15))
        contenders = {"jmp": (step, (params, scaler, x)), **contenders}
    found = jnp.asarray(False)
    updates: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
        "spikes_off": (sc_update, (to_device(sc.init(sc.preset("jmp"))), found)),
        "spikes_on": (
            sc_update,
            (to_device(sc.init(sc.preset("jmp", spike_threshold=6.0))), found, jnp.float32(1.0)),
        ),
    }
    everyone = {**contenders, **{f"update:{n}": c for n, c in updates.items()}}
    for fn, args in everyone.values():  # compile outside the timer
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in everyone}
    for _ in range(reps):
        for name, (fn, args) in everyone.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / steps)
    median = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    us = {name: median[name] for name in contenders}
    base = us.get("jmp", us["scaler_core"])
    return {
        "us_per_step": us,
        "speedup_vs_jmp": {name: base / v for name, v in us.items()} if "jmp" in us else {},
        "us_per_update": {name: median[f"update:{name}"] for name in updates},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=64, help="hidden width of the MLP")
    ap.add_argument("--steps", type=int, default=200, help="calls per round")
    ap.add_argument("--reps", type=int, default=15, help="interleaved rounds")
    ap.add_argument("--json", default=None, help="where to write (default: results/)")
    args = ap.parse_args(argv)
    for name in ("width", "steps", "reps"):
        if getattr(args, name) < 1:
            print(f"--{name}={getattr(args, name)}, but it must be at least 1", file=sys.stderr)
            return 2
    check(args.width)
    result = {
        "benchmark": "jax-loop",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "machine": platform.machine(),
        "width": args.width,
        "steps": args.steps,
        "reps": args.reps,
        **run(args.width, args.steps, args.reps),
    }
    device = "cpu" if jax.default_backend() == "cpu" else "gpu"
    variant = "" if args.width == 64 else f"width-{args.width}"
    out = Path(args.json) if args.json else next_result("jax-loop", device, variant)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    for name, us in result["us_per_step"].items():
        ratio = result["speedup_vs_jmp"].get(name)
        print(f"{name:20s} {us:9.1f} us/step" + (f"  {ratio:.2f}x jmp" if ratio else ""))
    for name, us in result["us_per_update"].items():
        print(f"update alone, {name:10s} {us:6.2f} us/call")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
