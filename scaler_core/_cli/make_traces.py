"""Regenerate the example traces in ``scaler_core/traces`` (reproducible, NumPy only).

``python -m scaler_core._cli.make_traces [OUT_DIR]``

``mlp_fp16_demo.json`` comes from the project's own demo (``scaler-core demo``
with its defaults on the digits data): the ``found`` flags of its float16 +
scaler-core run, 400 steps under its config (``init_scale=2**40``,
``growth_interval=20``). The demo reached the main branch after the other two
were made; they come from this small synthetic float16 training process, fully
determined by its seed:

* a two-layer tanh MLP (16 -> 32 -> 1) fits a noisy regression target; the
  inputs are Student-t distributed (3 degrees of freedom), so the occasional
  batch with an extreme input gives a gradient spike, as real data does;
* each step casts the float32 master weights and the batch to float16, runs
  the forward pass in float16 (products accumulated in float32, as tensor cores
  do), and computes the float32 gradient of the mean squared error; a gradient
  value above 65504 / scale overflows float16 under that scale;
* SGD with momentum 0.9, learning-rate warm-up over the first 200 steps.

``mlp_fp16_spikes.csv`` records ``max_abs_grad`` (the largest unscaled gradient
value) for 3000 steps. ``mlp_fp16_nan_burst.json`` records the ``found`` flags
jmp's policy (``preset("jmp")``, a floor of 1) saw on the same process with a different
seed, where a corrupted data shard (an infinite input) makes steps 700-849 NaN:
150 consecutive non-finite steps, long enough to drive a scale without a floor
below the float32 range.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from scaler_core._api import update
from scaler_core._presets import preset
from scaler_core._state import init

__all__ = ["grad_maxima", "main", "write_demo_trace", "write_traces"]

FP16_MAX = 65504.0


def grad_maxima(
    steps: int, seed: int, *, corrupt: tuple[int, int] | None = None, batch: int = 32
) -> np.ndarray:
    """Per-step largest absolute gradient value of the synthetic float16 run.

    Args:
        steps: Training steps.
        seed: Seeds the data, the weights and the batches.
        corrupt: ``(first, last)`` steps (inclusive) whose batch holds an
            infinite input, so their gradients are NaN.
        batch: Examples per step.

    Returns:
        A float64 array of ``steps`` values (NaN on corrupted steps).
    """
    rng = np.random.default_rng(seed)
    d_in, d_hid = 16, 32
    w_true = rng.normal(size=(d_in, 1)) / 4
    w1 = (rng.normal(size=(d_in, d_hid)) / np.sqrt(d_in)).astype(np.float32)
    w2 = (rng.normal(size=(d_hid, 1)) / np.sqrt(d_hid)).astype(np.float32)
    m1, m2 = np.zeros_like(w1), np.zeros_like(w2)
    out = np.empty(steps)
    for t in range(steps):
        x = rng.standard_t(3, size=(batch, d_in))
        y = np.tanh(x @ w_true) + 0.1 * rng.normal(size=(batch, 1))
        if corrupt is not None and corrupt[0] <= t <= corrupt[1]:
            x[0, 0] = np.inf
        x16 = x.astype(np.float16)
        with np.errstate(all="ignore"):
            # float16 forward: float16 operands, float32 accumulation, float16 outputs.
            h = np.tanh(x16.astype(np.float32) @ w1.astype(np.float16).astype(np.float32))
            h16 = h.astype(np.float16).astype(np.float32)
            pred = (h16 @ w2.astype(np.float16).astype(np.float32)).astype(np.float16)
            err = pred.astype(np.float32) - y.astype(np.float32)
            g_pred = (2.0 / batch) * err
            g_w2 = h16.T @ g_pred
            g_h = (g_pred @ w2.T) * (1.0 - h16 * h16)
            g_w1 = x16.astype(np.float32).T @ g_h
            out[t] = max(float(np.abs(g_w1).max()), float(np.abs(g_w2).max()))
        if not np.isfinite(out[t]):
            out[t] = np.nan
            continue  # the step is skipped: no update
        lr = 0.05 * min(1.0, (t + 1) / 200)
        m1 = 0.9 * m1 + g_w1.astype(np.float32)
        m2 = 0.9 * m2 + g_w2.astype(np.float32)
        w1 = (w1 - lr * m1).astype(np.float32)
        w2 = (w2 - lr * m2).astype(np.float32)
    return out


def write_traces(out_dir: Path) -> None:
    """Write both example traces into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spikes = grad_maxima(3000, seed=0)
    lines = ["step,max_abs_grad"] + [f"{t},{g:.6g}" for t, g in enumerate(spikes)]
    (out_dir / "mlp_fp16_spikes.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")

    grads = grad_maxima(1500, seed=1, corrupt=(700, 849))
    state = init(preset("jmp"))
    found = []
    for g in grads:
        flag = bool(not np.isfinite(g) or g * state.scale > FP16_MAX)
        found.append(flag)
        state = update(state, flag)
    doc = {
        "source": (
            "scaler_core._cli.make_traces: synthetic float16 MLP run (seed 1), found flags as "
            "seen under preset('jmp'); a corrupted shard makes steps 700-849 NaN"
        ),
        "recorded_with": preset("jmp").to_dict(),
        "found": found,
    }
    (out_dir / "mlp_fp16_nan_burst.json").write_text(json.dumps(doc) + "\n", encoding="utf-8")
    write_demo_trace(out_dir)


def write_demo_trace(out_dir: Path) -> None:
    """Write ``mlp_fp16_demo.json`` from the demo's float16 + scaler-core run.

    Needs scikit-learn (the demo's digits data).
    """
    from .demo import DemoSettings, load_dataset, train  # noqa: PLC0415 - demo is heavy

    settings = DemoSettings(dataset="digits")
    run = train(settings, "float16+scaler", load_dataset(settings.dataset, settings.seed))
    skipped = set(run.skipped)
    doc = {
        "source": (
            "scaler-core demo, DemoSettings(dataset='digits') defaults: found flags of the "
            f"float16+scaler run under {settings.scaler_config()!r}"
        ),
        "recorded_with": settings.scaler_config().to_dict(),
        "found": [step in skipped for step in range(settings.steps)],
    }
    (out_dir / "mlp_fp16_demo.json").write_text(json.dumps(doc) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Write the traces into ``argv[0]`` (default: the package's ``traces`` folder)."""
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0]) if args else Path(__file__).parents[1] / "traces"
    write_traces(out)
    print(f"wrote the example traces into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
