"""``scaler_core.keras.LossScaleOptimizer`` against Keras 3's own ``LossScaleOptimizer``.

Keras picks its backend once, at import (``KERAS_BACKEND``), so every check runs in a
fresh interpreter per backend (JAX and torch; the ``run_python`` fixture). Two tiny
``Sequential`` models in ``mixed_float16`` (float16 activations, checked) train
side by side with ``model.fit``, one with Keras's class and one with ours, from the
same weights on the same batches; a callback compares the scale, the step counter,
the weights and the inner Adam's variables bit for bit after every batch. Batches
with an inf target make real skips; ``dynamic_growth_steps=3`` makes real growths.
Ours is saved to a ``.keras`` file after the first epoch and loaded (the registered
class, no ``custom_objects``), and the loaded model trains the second epoch, still
equal to Keras's uninterrupted run. Then the collapse: on NaN batches Keras halves its
scale to 0.0 and never trains again, silently; ours keeps the smallest normal scale,
skips, records the failure, and ``check()`` raises ``ScaleCollapseError``.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap
from collections.abc import Callable

import pytest

# Not importorskip: importing keras here would load its default backend, TensorFlow, which
# is not installed; each script imports it in a fresh interpreter with KERAS_BACKEND set.
if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras 3 is an optional oracle (pip install keras)", allow_module_level=True)

pytestmark = pytest.mark.torch
BACKENDS = ("jax", "torch")

_COMMON = textwrap.dedent(
    """
    import json, os, sys, tempfile
    import numpy as np
    import keras
    import scaler_core as sc
    from scaler_core.keras import LossScaleOptimizer

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    to_np = keras.ops.convert_to_numpy

    def same(a, b):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()

    def make(weights=None):
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
        )
        if weights is not None:
            model.set_weights(weights)
        return model

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rows = []

        def on_train_batch_end(self, batch, logs=None):
            sync = getattr(self.model, "jax_state_sync", None)
            if sync is not None:  # JAX holds the state apart from the variables in fit
                sync()
            opt = self.model.optimizer
            self.rows.append({
                "scale": to_np(opt.dynamic_scale),
                "counter": to_np(opt.step_counter),
                "weights": self.model.get_weights(),
                "inner": [to_np(v) for v in opt.inner_optimizer.variables],
            })

    def compare(ours, theirs):
        assert len(ours) == len(theirs), (len(ours), len(theirs))
        for i, (o, t) in enumerate(zip(ours, theirs)):
            for key in ("scale", "counter"):
                assert same(o[key], t[key]), (i, key, o[key], t[key])
            for key in ("weights", "inner"):
                assert len(o[key]) == len(t[key]), (i, key)
                for a, b in zip(o[key], t[key]):
                    assert same(a, b), (i, key, a, b)
    """
)

_FIT = _COMMON + textwrap.dedent(
    """
    BATCH, N = 4, 12
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * N, 3)).astype("float32")
    y = rng.normal(size=(BATCH * N, 1)).astype("float32")
    for b in (2, 7):  # an inf target: a non-finite loss, a real skip, in every epoch
        y[b * BATCH] = np.inf

    w0 = make().get_weights()
    ours, theirs = make(w0), make(w0)
    opt = LossScaleOptimizer(keras.optimizers.Adam(1e-2), dynamic_growth_steps=3)
    ours.compile(optimizer=opt, loss="mse")
    theirs.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), dynamic_growth_steps=3
        ),
        loss="mse",
    )
    assert ours.optimizer is opt, "compile wrapped ours in Keras's LossScaleOptimizer"
    for model in (ours, theirs):
        assert model.dtype_policy.name == "mixed_float16"
        out = model.layers[0](x[:2])
        assert keras.backend.standardize_dtype(out.dtype) == "float16", out.dtype

    rec_o, rec_t = Record(), Record()
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    theirs.fit(x, y, epochs=2, callbacks=[rec_t], **fit)
    ours.fit(x, y, epochs=1, callbacks=[rec_o], **fit)
    path = os.path.join(tempfile.mkdtemp(), "ours.keras")
    ours.save(path)
    loaded = keras.models.load_model(path)  # the registered class: no custom_objects
    assert type(loaded.optimizer) is LossScaleOptimizer, type(loaded.optimizer)
    assert loaded.optimizer.config == opt.config
    names = [v.path for v in opt.variables]
    # The inner optimizer's names follow the layers' (sequential_1_dense_2_...), which the
    # loaded model numbers anew; the values must come back in the same order.
    assert len(loaded.optimizer.variables) == len(names), names
    for a, b in zip(opt.variables, loaded.optimizer.variables):
        assert a.name == b.name or a.path.startswith("adam/"), (a.path, b.path)
        assert same(to_np(a), to_np(b)), (a.path, a, b)
    loaded.fit(x, y, epochs=2, initial_epoch=1, callbacks=[rec_o], **fit)
    compare(rec_o.rows, rec_t.rows)

    scales = [float(r["scale"]) for r in rec_t.rows]
    moves = list(zip([2.0**15] + scales, scales))
    state = loaded.optimizer.scaler_state()
    json.dump({
        "steps": len(rec_t.rows),
        "skips": sum(b < a for a, b in moves),
        "grows": sum(b > a for a, b in moves),
        "skipped_steps": state.skipped_steps,
        "our_steps": state.steps,
        "scale": state.scale,
        "variables": names,
    }, sys.stdout)
    """
)

_COLLAPSE = _COMMON + textwrap.dedent(
    """
    NAN, CLEAN = 200, 4
    x = np.ones((NAN + CLEAN, 3), np.float32)
    x[:NAN] = np.nan  # 200 non-finite steps, then clean ones
    y = np.ones((NAN + CLEAN, 1), np.float32)
    w0 = make().get_weights()
    ours, theirs = make(w0), make(w0)
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    ours.compile(optimizer=opt, loss="mse")
    theirs.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")  # Keras wraps it
    assert type(theirs.optimizer) is keras.optimizers.LossScaleOptimizer
    rec_o, rec_t = Record(), Record()
    fit = dict(batch_size=1, shuffle=False, verbose=0, epochs=1)
    ours.fit(x, y, callbacks=[rec_o], **fit)  # no error inside fit: recorded
    theirs.fit(x, y, callbacks=[rec_t], **fit)

    keras_scales = [float(r["scale"]) for r in rec_t.rows]
    our_scales = [float(r["scale"]) for r in rec_o.rows]
    assert keras_scales[-1] == 0.0, keras_scales[-CLEAN - 2 :]
    # Until Keras's scale leaves the normal range, the two agree bit for bit.
    normal = [i for i, s in enumerate(keras_scales) if s >= 2.0**-126]
    compare(rec_o.rows[: len(normal)], rec_t.rows[: len(normal)])
    # Then ours holds the smallest normal scale, and nothing trains.
    assert set(our_scales[len(normal) :]) == {2.0**-126}, our_scales[len(normal) - 2 :]
    for a, b in zip(ours.get_weights(), w0):
        assert same(a, b)
    assert int(to_np(opt.iterations)) == 0  # the inner optimizer never stepped
    failure = int(to_np([v for v in opt.variables if v.name == "failure"][0]))
    assert failure == int(sc.Failure.COLLAPSE), failure
    raised = []
    for look in (opt.check, opt.current_scale, opt.scaler_state):
        try:
            look()
        except sc.ScaleCollapseError as exc:
            raised.append(str(exc))
    assert len(raised) == 3, raised
    # The clean steps after the failure are skipped too (the state stays frozen).
    assert [float(r["scale"]) for r in rec_o.rows[-CLEAN:]] == [2.0**-126] * CLEAN
    json.dump({"first_zero": keras_scales.index(0.0), "normal": len(normal)}, sys.stdout)
    """
)

_ARGS = textwrap.dedent(
    """
    import json, sys
    import keras
    import scaler_core as sc
    from scaler_core.keras import LossScaleOptimizer

    def refused(kind, **kwargs):
        inner = keras.optimizers.SGD(0.1, loss_scale_factor=4.0)
        try:
            LossScaleOptimizer(inner, **kwargs)
        except kind as exc:
            assert inner.loss_scale_factor == 4.0, "the inner optimizer was changed"
            return str(exc)
        raise AssertionError(f"{kwargs} was accepted")

    out = {
        "subnormal": refused(sc.InvalidConfigError, initial_scale=1e-40),
        "conflict": refused(
            sc.InvalidArgumentError, config=sc.preset("keras"), initial_scale=2.0
        ),
        "type": refused(sc.InvalidArgumentError, config=42),
        "spike": refused(sc.InvalidArgumentError, config=sc.ScalerConfig(spike_threshold=3.0)),
    }
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), config="torch")
    assert opt.config == sc.preset("torch"), opt.config
    assert opt.initial_scale == 2.0**16 and opt.dynamic_growth_steps == 2000
    again = LossScaleOptimizer.from_config(opt.get_config())
    assert again.config == opt.config and type(again) is LossScaleOptimizer
    same = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    assert same.config == sc.preset("keras")
    try:
        same.check()
    except sc.InvalidArgumentError as exc:
        out["unbuilt"] = str(exc)
    json.dump(out, sys.stdout)
    """
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_equals_keras_and_resumes_from_a_keras_file(
    backend: str, run_python: Callable[..., str]
) -> None:
    pytest.importorskip(backend, reason=f"Keras's {backend} backend needs {backend}")
    out = json.loads(run_python(_FIT, env={"KERAS_BACKEND": backend}))
    assert out["steps"] == 24
    assert out["skips"] >= 4, out  # the injected batches, in both epochs
    assert out["grows"] >= 1, out
    assert out["skipped_steps"] == out["skips"], out
    assert out["our_steps"] == 24, out
    # Keras's variables are kept, by name, so a .keras file holds them as Keras's would.
    assert any(n.endswith("/dynamic_scale") for n in out["variables"]), out["variables"]
    assert any(n.endswith("/step_counter") for n in out["variables"]), out["variables"]
    assert any(n.endswith("/failure") for n in out["variables"]), out["variables"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_scale_falls_to_zero_where_ours_fails_closed(
    backend: str, run_python: Callable[..., str]
) -> None:
    pytest.importorskip(backend, reason=f"Keras's {backend} backend needs {backend}")
    out = json.loads(run_python(_COLLAPSE, env={"KERAS_BACKEND": backend}))
    # 2**15 halves to 2**-126 in 141 steps (rows 0..140); Keras then goes on, through
    # the subnormals (torch) or flushed to zero at once (XLA), and reaches 0.0.
    assert out["normal"] == 141, out
    assert out["first_zero"] == (141 if backend == "jax" else 141 + 23), out


def test_arguments_are_checked_before_anything_changes(run_python: Callable[..., str]) -> None:
    pytest.importorskip("jax", reason="Keras's jax backend needs jax")
    out = json.loads(run_python(_ARGS, env={"KERAS_BACKEND": "jax"}))
    assert "initial_scale" in out["subnormal"] or "init_scale" in out["subnormal"], out
    assert "initial_scale=2.0" in out["conflict"], out
    assert "config=42" in out["type"], out
    assert "spike_threshold=3.0" in out["spike"], out
    assert "not built" in out["unbuilt"], out


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_modules_docstring_examples_run(run_python: Callable[..., str], backend: str) -> None:
    """The examples of ``scaler_core.keras`` (tests/docs/test_docs.py leaves this module
    to this test: Keras takes its backend from ``KERAS_BACKEND`` at its first import)."""
    pytest.importorskip(backend)
    out = run_python(
        "import doctest, scaler_core.keras as m\n"
        "r = doctest.testmod(m, optionflags=doctest.ELLIPSIS)\n"
        "print(r.failed, r.attempted)",
        env={"KERAS_BACKEND": backend},
    )
    failed, attempted = (int(n) for n in out.split())
    assert failed == 0
    assert attempted > 0
