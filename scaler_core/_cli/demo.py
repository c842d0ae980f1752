"""``scaler-core demo``: a real float16 training run that shows why loss scaling exists.

A small multi-layer perceptron is trained three times from the same seed (same
initial weights, same batches): in float32 (the reference), in float16 without
loss scaling, and in float16 with scaler-core. The float16 runs do what mixed
precision does on an accelerator: float32 *master* weights and optimizer state;
each step casts the weights to float16, runs forward and backward with float16
activations and gradients (matrix products accumulate in float32 and round
their output to float16, as tensor cores do), and casts the weight gradients
back to float32 for the update.

Why float16 needs help: its smallest positive value is about 6e-8, so smaller
gradient values become exactly zero. The demo's loss is multiplied by a small
``loss_weight`` (by default 2**-17), as a mean over very many tokens or a small
auxiliary-loss weight makes it in large models, and the SGD learning rate is
divided by the same factor, so the float32 run is mathematically the run with
``loss_weight=1``. In float16 many gradient values of this tiny network then fall
below float16's range, as they do in large networks. The demo measures that
honestly: at every step of a float16 run it also computes the float32 gradients
of the same weights and batch, and counts the values that are nonzero in float32
but zero in float16.

Everything backend-specific is the array namespace ``xp`` (``numpy``,
``jax.numpy`` or ``cupy``) and the scaler's backend: the model is written with
array-API style functions only (no in-place updates), so it runs unchanged on
every backend scaler-core has.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import itertools
import json
import math
import os
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from scaler_core._backend import get_backend
from scaler_core._config import ScalerConfig
from scaler_core._errors import InvalidArgumentError, MissingDependencyError
from scaler_core._lifecycle import LossScaler

from ._files import PLOT_FORMATS, check_output, write
from ._plot import pyplot

__all__ = [
    "MODES",
    "Dataset",
    "DemoResult",
    "DemoSettings",
    "RunResult",
    "add_parser",
    "format_summary",
    "load_dataset",
    "run_demo",
    "train",
    "write_json",
    "write_plot",
]

#: The three runs, in the order they are trained and reported.
MODES: tuple[str, ...] = ("float32", "float16", "float16+scaler")
MODE_LABELS = {
    "float32": "float32 (reference)",
    "float16": "float16, no scaling",
    "float16+scaler": "float16 + scaler-core",
}
#: The array module each demo backend computes with.
ARRAY_MODULES = {"numpy": "numpy", "jax": "jax.numpy", "cupy": "cupy"}
N_CLASSES = 10
N_FEATURES = 64
#: Share of a synthetic class pattern's pixels that are on.
_PIXEL_ON = 0.3
FP16_MIN_NORMAL = 2.0**-14
JSON_SCHEMA = 1


# ---------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class DemoSettings:
    """What the demo trains. Validated when built; every field has a sane default.

    Args:
        steps: Training steps per run.
        batch_size: Examples per step.
        width: Units per hidden layer.
        depth: Hidden layers.
        lr: SGD learning rate (momentum 0.9) on the unweighted loss; the step
            actually taken is ``lr / loss_weight`` times the weighted gradient.
        loss_weight: Factor on the loss; small values make small gradients.
        init_scale: The scaler's first scale.
        growth_interval: Clean steps before the scaler doubles the scale.
        seed: Seed for the data split, the initial weights and the batches.
        backend: ``"numpy"``, ``"jax"`` or ``"cupy"``.
        dataset: ``"auto"`` (digits if scikit-learn is installed, else
            synthetic), ``"digits"`` or ``"synthetic"``.

    Raises:
        InvalidArgumentError: A field is out of range; the message names it.

    >>> DemoSettings(steps=10).steps
    10
    >>> try:
    ...     DemoSettings(batch_size=0)
    ... except ValueError as e:
    ...     print(e)
    batch_size=0, but it must be an int in [1, 100000]
    """

    steps: int = 400
    batch_size: int = 64
    width: int = 64
    depth: int = 3
    lr: float = 0.05
    loss_weight: float = 2.0**-17
    init_scale: float = 2.0**40
    growth_interval: int = 20
    seed: int = 0
    backend: str = "numpy"
    dataset: str = "auto"

    def __post_init__(self) -> None:
        _check_int("steps", self.steps, 1, 10**7)
        _check_int("batch_size", self.batch_size, 1, 100_000)
        _check_int("width", self.width, 1, 8192)
        _check_int("depth", self.depth, 1, 64)
        _check_int("seed", self.seed, 0, 2**63 - 1)
        _check_positive("lr", self.lr)
        _check_positive("loss_weight", self.loss_weight)
        if not _finite_f32(self.lr / self.loss_weight):  # the step size actually applied
            raise InvalidArgumentError(
                f"lr / loss_weight = {self.lr / self.loss_weight:g}, but the learning rate "
                f"actually applied must be a finite float32; lower lr or raise loss_weight"
            )
        if self.backend not in ARRAY_MODULES:
            raise InvalidArgumentError(
                f"backend={self.backend!r}, but the demo runs on one of {sorted(ARRAY_MODULES)}"
            )
        if self.dataset not in ("auto", "digits", "synthetic"):
            raise InvalidArgumentError(
                f"dataset={self.dataset!r}, but it must be 'auto', 'digits' or 'synthetic'"
            )
        # Builds (and so validates) the scaler's policy now, before any training.
        self.scaler_config()

    def scaler_config(self) -> ScalerConfig:
        """The scaler policy of the float16 + scaler-core run."""
        return ScalerConfig(init_scale=self.init_scale, growth_interval=self.growth_interval)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgumentError(f"{name}={value!r}, but it must be an int in [{low}, {high}]")


def _finite_f32(value: float) -> bool:
    """Whether ``value`` stays finite as a float32 (1e39 does not)."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(value)))


def _check_positive(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not value > 0
        or not _finite_f32(value)  # the demo computes in float32
        or not np.float32(value) > 0
    ):
        raise InvalidArgumentError(
            f"{name}={value!r}, but it must be a finite number > 0 (representable in float32)"
        )


# ------------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True)
class Dataset:
    """A classification task: float32 features in [0, 1], int labels in [0, 10)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_dataset(name: str = "auto", seed: int = 0) -> Dataset:
    """Scikit-learn's handwritten digits, or a synthetic task of the same shape.

    The digits (1797 8x8 images, 10 classes) ship inside scikit-learn: nothing
    is downloaded. ``"synthetic"`` (also what ``"auto"`` falls back to without
    scikit-learn) draws one random 8x8 pattern per class (30% of pixels on) and
    makes 1797 randomly dimmed copies of them under strong Gaussian noise (sigma
    0.6, clipped to [0, 1]). Either way 80% train, 20% test,
    split by ``seed``.

    Raises:
        MissingDependencyError: ``name="digits"`` but scikit-learn is not installed.

    >>> d = load_dataset("synthetic")
    >>> d.x_train.shape, d.x_test.shape, int(d.y_train.max())
    ((1438, 64), (359, 64), 9)
    """
    if name in ("auto", "digits"):
        try:
            from sklearn.datasets import load_digits  # noqa: PLC0415 (optional extra)
        except ImportError as exc:
            if name == "digits":
                raise MissingDependencyError(
                    f"dataset='digits' needs scikit-learn ({exc}); install it with "
                    f"pip install 'scaler-core[demo]', or pass --dataset synthetic"
                ) from exc
        else:
            digits = load_digits()
            x = np.asarray(digits.data, np.float32) / np.float32(16.0)
            return _split("scikit-learn digits", x, np.asarray(digits.target, np.int64), seed)
    rng = np.random.default_rng(12345)
    prototypes = (rng.random((N_CLASSES, N_FEATURES)) < _PIXEL_ON).astype(np.float32)
    y = rng.integers(0, N_CLASSES, 1797)
    brightness = rng.uniform(0.4, 1.0, (y.size, 1)).astype(np.float32)
    # Noise this strong makes the classes overlap: the task takes real learning
    # (float32 reaches about 88% test accuracy), not a few lucky updates.
    noise = rng.normal(0.0, 0.6, (y.size, N_FEATURES)).astype(np.float32)
    x = np.clip(prototypes[y] * brightness + noise, 0.0, 1.0).astype(np.float32)
    return _split("synthetic patterns", x, y.astype(np.int64), seed)


def _split(name: str, x: np.ndarray, y: np.ndarray, seed: int) -> Dataset:
    order = np.random.default_rng(seed).permutation(len(x))
    n_train = round(0.8 * len(x))
    train, test = order[:n_train], order[n_train:]
    return Dataset(name, x[train], y[train], x[test], y[test])


# ------------------------------------------------------------------------ model
Params = list[tuple[Any, Any]]


def _init_params(settings: DemoSettings) -> list[tuple[np.ndarray, np.ndarray]]:
    """He-initialised float32 weights and zero biases (host arrays)."""
    rng = np.random.default_rng(settings.seed + 1)
    dims = [N_FEATURES] + [settings.width] * settings.depth + [N_CLASSES]
    return [
        (
            (rng.standard_normal((a, b)) * math.sqrt(2.0 / a)).astype(np.float32),
            np.zeros(b, np.float32),
        )
        for a, b in itertools.pairwise(dims)
    ]


class _Model:
    """Forward and backward of the MLP, written once over an array namespace."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.f32 = xp.float32
        self.f16 = xp.float16

    def matmul(self, a: Any, b: Any, dtype: Any) -> Any:
        # Accumulate in float32 and round the result to the compute dtype: what
        # tensor cores do with float16 inputs (NumPy's own float16 matmul is an
        # unvectorised loop, 25x slower, and accumulates in float16).
        return self.xp.matmul(a.astype(self.f32), b.astype(self.f32)).astype(dtype)

    def forward(self, params: Params, x: Any, dtype: Any) -> tuple[Any, list[Any], list[Any]]:
        """Logits (float32) and the per-layer inputs and pre-activations."""
        xp = self.xp
        h = x.astype(dtype)
        inputs, pre = [], []
        for i, (w, b) in enumerate(params):
            inputs.append(h)
            z = self.matmul(h, w.astype(dtype), dtype) + b.astype(dtype)
            pre.append(z)
            h = xp.maximum(z, xp.zeros((), dtype)) if i < len(params) - 1 else z
        return h.astype(self.f32), inputs, pre

    def loss_and_seed(self, logits: Any, onehot: Any) -> tuple[Any, Any]:
        """Mean cross-entropy and its gradient w.r.t. the logits, in float32.

        The softmax and the loss run in float32, as autocast runs them.
        """
        xp = self.xp
        shifted = logits - xp.max(logits, axis=1, keepdims=True)
        log_z = xp.log(xp.sum(xp.exp(shifted), axis=1, keepdims=True))
        log_p = shifted - log_z
        n = logits.shape[0]
        loss = -xp.sum(log_p * onehot) / n
        return loss, (xp.exp(log_p) - onehot) / n

    def backward(
        self, params: Params, inputs: list[Any], pre: list[Any], seed: Any, dtype: Any
    ) -> list[tuple[Any, Any]]:
        """Weight and bias gradients in float32, from a float32 seed gradient.

        The seed is rounded to ``dtype`` and every gradient stays in ``dtype``
        until the weight gradients are cast to float32 for the master weights.
        """
        xp = self.xp
        d = seed.astype(dtype)
        grads: list[tuple[Any, Any]] = []
        for i in range(len(params) - 1, -1, -1):
            gw = self.matmul(inputs[i].T, d, dtype)
            gb = xp.sum(d.astype(self.f32), axis=0).astype(dtype)
            grads.append((gw.astype(self.f32), gb.astype(self.f32)))
            if i:
                back = self.matmul(d, params[i][0].astype(dtype).T, dtype)
                d = xp.where(pre[i - 1] > 0, back, xp.zeros((), dtype))
        return grads[::-1]


# ----------------------------------------------------------------------- results
@dataclasses.dataclass
class RunResult:
    """What one training run measured.

    Attributes:
        mode: One of :data:`MODES`.
        test_loss: Mean cross-entropy on the test split after training (float32
            evaluation of the master weights; ``nan`` if the run diverged).
        test_accuracy: Share of test examples classified correctly.
        losses: Training-batch loss (unweighted) at every step.
        scales: The loss scale used at every step (1.0 without a scaler).
        skipped: Step indices the scaler skipped for non-finite gradients.
        underflow_share: Over all steps (skipped ones left out), the share of
            weight-gradient values that are nonzero in float32 but zero in this
            run (``None`` for the float32 run).
        subnormal_share: Likewise, the share that survived only as float16
            subnormals (below 2**-14), with fewer than 11 significant bits.
        wall_time_s: Seconds the run took, measurement included.
    """

    mode: str
    test_loss: float
    test_accuracy: float
    losses: list[float]
    scales: list[float]
    skipped: list[int]
    underflow_share: float | None
    subnormal_share: float | None
    wall_time_s: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict (non-finite numbers become ``None``)."""
        return {
            "mode": self.mode,
            "test_loss": _finite_or_none(self.test_loss),
            "test_accuracy": self.test_accuracy,
            "underflow_share": self.underflow_share,
            "subnormal_share": self.subnormal_share,
            "skipped_steps": len(self.skipped),
            "skipped": self.skipped,
            "wall_time_s": self.wall_time_s,
            "final_scale": self.scales[-1] if self.scales else None,
            "losses": [_finite_or_none(v) for v in self.losses],
            "scales": self.scales,
        }


@dataclasses.dataclass
class DemoResult:
    """The three runs of one demo, with what they ran on."""

    settings: DemoSettings
    dataset: str
    runs: dict[str, RunResult]

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe dict: settings, dataset, and every run's numbers."""
        return {
            "schema": JSON_SCHEMA,
            "settings": dataclasses.asdict(self.settings),
            "dataset": self.dataset,
            "runs": {mode: run.to_json() for mode, run in self.runs.items()},
        }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------- training
def array_module(backend: str) -> Any:
    """The array namespace of a demo backend, after checking scaler-core has it.

    Raises:
        BackendUnavailableError: The backend or its library is not installed.
        InvalidArgumentError: The demo has no array module for this backend.
    """
    if backend not in ARRAY_MODULES:
        raise InvalidArgumentError(
            f"backend={backend!r}, but the demo runs on one of {sorted(ARRAY_MODULES)}"
        )
    get_backend(backend)  # raises BackendUnavailableError with an install hint
    return importlib.import_module(ARRAY_MODULES[backend])


def train(
    settings: DemoSettings,
    mode: str,
    data: Dataset,
    *,
    xp: Any = None,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Train the MLP once in ``mode`` and measure it.

    Args:
        settings: What to train.
        mode: ``"float32"``, ``"float16"`` or ``"float16+scaler"``.
        data: The task (see :func:`load_dataset`).
        xp: The array namespace; by default the one of ``settings.backend``.
        progress: Called with the number of steps done after each step.

    Returns:
        The run's numbers.

    Raises:
        InvalidArgumentError: ``mode`` is unknown or the batch is larger than the data.
        ScaleCollapseError: The scaler refused to collapse the scale.
    """
    with _quiet_numerics():
        return _train(settings, mode, data, xp=xp, progress=progress)


def _train(
    settings: DemoSettings,
    mode: str,
    data: Dataset,
    *,
    xp: Any,
    progress: Callable[[int], None] | None,
) -> RunResult:
    if mode not in MODES:
        raise InvalidArgumentError(f"mode={mode!r}, but it must be one of {list(MODES)}")
    if settings.batch_size > len(data.x_train):
        raise InvalidArgumentError(
            f"batch_size={settings.batch_size}, but the training split of {data.name} has "
            f"only {len(data.x_train)} examples; pass a smaller --batch-size"
        )
    if xp is None:
        xp = array_module(settings.backend)
    model = _Model(xp)
    f32 = xp.float32
    dtype = f32 if mode == "float32" else xp.float16
    params: Params = [(xp.asarray(w), xp.asarray(b)) for w, b in _init_params(settings)]
    momentum: Params = [(xp.zeros_like(w), xp.zeros_like(b)) for w, b in params]
    x_train = xp.asarray(data.x_train)
    classes = np.arange(N_CLASSES)
    # The scaler takes its backend from the arrays it is given, like user code does.
    scaler = LossScaler(settings.scaler_config()) if mode == "float16+scaler" else None
    step_size = settings.lr / settings.loss_weight
    batches = np.random.default_rng(settings.seed + 2)

    # Pure functions of arrays, built once per library and dtype: JAX compiles
    # them (eager JAX pays about a millisecond per operation); other libraries
    # run them as they are.
    grads_fn, count_fn, sgd_fn = _functions(xp, dtype)
    reference_fn = _functions(xp, f32)[0]
    lr = xp.asarray(step_size, dtype=f32)
    weight = xp.asarray(settings.loss_weight, dtype=f32)

    losses: list[float] = []
    scales: list[float] = []
    skipped: list[int] = []
    counts = np.zeros(3, np.int64)  # nonzero in float32, zero here, subnormal here
    start = time.perf_counter()
    for step in range(settings.steps):
        idx = batches.integers(0, len(data.x_train), settings.batch_size)
        xb = x_train[xp.asarray(idx)]
        onehot = xp.asarray((data.y_train[idx][:, None] == classes).astype(np.float32))
        scale, factor = 1.0, weight
        if scaler is not None:
            scale = scaler.current_scale()
            # Scaling the loss multiplies the gradient that seeds backward, so the
            # scaled loss weight is all backward needs to know.
            factor = scaler.scale_loss(weight)
        loss, grads = grads_fn(params, xb, onehot, factor)
        if scaler is not None:
            grads = scaler.unscale(grads)
        if dtype != f32 and (scaler is None or not scaler.should_skip_step()):
            # The honest measure: the float32 gradients of the same weights and batch.
            _, reference = reference_fn(params, xb, onehot, weight)
            counts += _to_host(count_fn(reference, grads, xp.asarray(scale, dtype=f32)))
        if scaler is None:
            params, momentum = sgd_fn(params, momentum, grads, lr)
        else:
            stepped = scaler.step(sgd_fn, params, momentum, grads, lr)
            if stepped is None:
                skipped.append(step)
            else:
                params, momentum = stepped
            scaler.update()
        losses.append(float(loss))
        scales.append(float(scale))
        if progress is not None:
            progress(step + 1)
    nonzero, lost, subnormal = (int(c) for c in counts)
    test_loss, test_accuracy = _evaluate(model, params, data)
    return RunResult(
        mode=mode,
        test_loss=test_loss,
        test_accuracy=test_accuracy,
        losses=losses,
        scales=scales,
        skipped=skipped,
        underflow_share=None if dtype == f32 else lost / max(nonzero, 1),
        subnormal_share=None if dtype == f32 else subnormal / max(nonzero, 1),
        wall_time_s=time.perf_counter() - start,
    )


@functools.lru_cache(maxsize=16)
def _functions(xp: Any, dtype: Any) -> tuple[Callable[..., Any], ...]:
    """``(loss_and_grads, count_lost, sgd)`` for one array library and dtype."""
    model = _Model(xp)

    def loss_and_grads(
        params: Params, xb: Any, onehot: Any, factor: Any
    ) -> tuple[Any, list[tuple[Any, Any]]]:
        """The unweighted batch loss and the gradients of ``factor * loss``."""
        logits, inputs, pre = model.forward(params, xb, dtype)
        loss, seed = model.loss_and_seed(logits, onehot)
        return loss, model.backward(params, inputs, pre, seed * factor, dtype)

    def count_lost(reference: Params, grads: Params, scale: Any) -> Any:
        return _count_lost(xp, reference, grads, scale)

    compiled = _compiler(xp)
    return compiled(loss_and_grads), compiled(count_lost), compiled(_sgd)


def _sgd(params: Params, momentum: Params, grads: Params, lr: Any) -> tuple[Params, Params]:
    """SGD with momentum 0.9 on the float32 master weights."""
    new_m = [
        (0.9 * mw + gw, 0.9 * mb + gb) for (mw, mb), (gw, gb) in zip(momentum, grads, strict=True)
    ]
    new_p = [(w - lr * mw, b - lr * mb) for (w, b), (mw, mb) in zip(params, new_m, strict=True)]
    return new_p, new_m


def _count_lost(xp: Any, reference: Params, grads: Params, scale: Any) -> Any:
    """``[nonzero in float32, zero in grads, subnormal in float16]`` over weight gradients."""
    nonzero = lost = subnormal = xp.zeros((), dtype=xp.int32)
    for (rw, _), (gw, _) in zip(reference, grads, strict=True):
        nz = rw != 0
        nonzero = nonzero + xp.sum(nz.astype(xp.int32))
        lost = lost + xp.sum((nz & (gw == 0)).astype(xp.int32))
        # The float16 value was gw * scale (unscaling by a power of two is exact):
        # below 2**-14 it kept fewer than float16's 11 significant bits.
        tiny = xp.abs(gw * scale) < FP16_MIN_NORMAL
        subnormal = subnormal + xp.sum((nz & (gw != 0) & tiny).astype(xp.int32))
    return xp.stack([nonzero, lost, subnormal])


def _compiler(xp: Any) -> Callable[[Any], Any]:
    """``jax.jit`` for JAX; the identity for libraries that run eagerly anyway."""
    if getattr(xp, "__name__", "") == "jax.numpy":
        import jax  # noqa: PLC0415 (only reached when the user picked JAX)

        return jax.jit  # type: ignore[no-any-return, unused-ignore]
    return lambda fn: fn


def _evaluate(model: _Model, params: Params, data: Dataset) -> tuple[float, float]:
    xp = model.xp
    logits, _, _ = model.forward(params, xp.asarray(data.x_test), xp.float32)
    onehot = xp.asarray((data.y_test[:, None] == np.arange(N_CLASSES)).astype(np.float32))
    loss, _ = model.loss_and_seed(logits, onehot)
    predicted = _to_host(xp.argmax(logits, axis=1))
    return float(loss), float(np.mean(predicted == data.y_test))


def _to_host(a: Any) -> np.ndarray:
    get = getattr(a, "get", None)  # CuPy arrays copy to the host with .get()
    return np.asarray(get() if callable(get) else a)


def run_demo(
    settings: DemoSettings,
    *,
    data: Dataset | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> DemoResult:
    """Train the three runs of the demo with the same seed.

    Args:
        settings: What to train.
        data: The task; by default :func:`load_dataset` of ``settings.dataset``.
        progress: Called with ``(mode, steps done)`` after every step.

    Returns:
        The three runs' numbers.

    Raises:
        BackendUnavailableError: ``settings.backend`` is not installed.
        InvalidArgumentError: The dataset cannot be loaded or the settings do not fit it.

    >>> result = run_demo(DemoSettings(steps=3, dataset="synthetic"))
    >>> sorted(result.runs), len(result.runs["float16+scaler"].scales)
    (['float16', 'float16+scaler', 'float32'], 3)
    """
    xp = array_module(settings.backend)
    if data is None:
        data = load_dataset(settings.dataset, settings.seed)
    runs: dict[str, RunResult] = {}
    with _single_thread_blas():
        for mode in MODES:
            report = None if progress is None else _bind(progress, mode)
            runs[mode] = train(settings, mode, data, xp=xp, progress=report)
    return DemoResult(settings, data.name, runs)


def _bind(progress: Callable[[str, int], None], mode: str) -> Callable[[int], None]:
    return lambda done: progress(mode, done)


@contextmanager
def _quiet_numerics() -> Iterator[None]:
    # Overflow to inf in the scaled float16 run is the event the scaler detects
    # and handles; NumPy's RuntimeWarning for it would only be noise.
    with np.errstate(over="ignore", invalid="ignore", under="ignore", divide="ignore"):
        yield


def _single_thread_blas() -> Any:
    # The products here are tiny (32 x 64 x 64): a multithreaded BLAS spends
    # longer waking threads than multiplying, 50-100x longer on a busy machine.
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415 (optional)
    except ImportError:
        return nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


# ---------------------------------------------------------------------- reports
def format_summary(result: DemoResult) -> str:
    """The summary table and what it shows, as printed at the end of the demo."""
    s = result.settings
    dims = "-".join(str(d) for d in [N_FEATURES] + [s.width] * s.depth + [N_CLASSES])
    lines = [
        f"scaler-core demo: MLP {dims} on {result.dataset}, {s.steps} steps of batch "
        f"{s.batch_size}, seed {s.seed}, backend {s.backend}, loss weight {_num(s.loss_weight)}",
        "",
        f"{'run':<23} {'test loss':>9} {'test acc':>8} {'grads zero':>10} {'subnormal':>9} "
        f"{'skipped':>7} {'scale first->last':>17} {'time':>6}",
    ]
    for mode in MODES:
        run = result.runs[mode]
        scaled = mode == "float16+scaler"
        lines.append(
            f"{MODE_LABELS[mode]:<23} {run.test_loss:>9.4f} {100 * run.test_accuracy:>7.1f}% "
            f"{_share(run.underflow_share):>10} {_share(run.subnormal_share):>9} "
            f"{len(run.skipped) if scaled else '-':>7} "
            f"{f'{_num(run.scales[0])} -> {_num(run.scales[-1])}' if scaled else '-':>17} "
            f"{run.wall_time_s:>5.1f}s"
        )
    ref, plain, scaled_run = (result.runs[m] for m in MODES)
    lines += [
        "",
        "grads zero: weight-gradient values that are nonzero in float32 but underflowed to 0 in",
        "float16; subnormal: those left with under 11 bits of precision (same weights and batch,",
        "measured at every step).",
    ]
    if plain.underflow_share is not None and scaled_run.underflow_share is not None:
        lines += textwrap.wrap(
            f"Without scaling, float16 zeroed {_share(plain.underflow_share)} of the gradient "
            f"values and ended at test loss {plain.test_loss:.4f}; with scaler-core it zeroed "
            f"{_share(scaled_run.underflow_share)} and ended "
            f"{scaled_run.test_loss - ref.test_loss:+.4f} in loss and "
            f"{100 * (scaled_run.test_accuracy - ref.test_accuracy):+.1f} points of accuracy "
            f"from float32, skipping {len(scaled_run.skipped)} of {s.steps} steps.",
            width=90,
        )
    return "\n".join(lines)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float) -> str:
    """A power of two as ``2^k``, anything else as ``%g``."""
    exponent = math.log2(value) if value > 0 else 0.5
    return f"2^{int(exponent)}" if exponent.is_integer() else f"{value:g}"


def write_json(result: DemoResult, path: str) -> None:
    """Write every number of the demo to ``path`` as JSON.

    Raises:
        InvalidArgumentError: The file could not be written (one line for the CLI).
    """
    text = json.dumps(result.to_json(), indent=1, allow_nan=False) + "\n"
    write("--json", path, lambda p: Path(p).write_text(text, encoding="utf-8"))


def write_plot(result: DemoResult, path: str) -> None:
    """Draw training loss and the loss scale against steps into ``path``.

    The format follows the file name: ``.png``, ``.pdf`` or ``.svg`` (PNG otherwise).

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    plt = pyplot("--plot")
    fig, (ax_loss, ax_scale) = plt.subplots(
        2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    for mode, colour in zip(MODES, ("black", "tab:red", "tab:blue"), strict=True):
        losses = np.asarray(result.runs[mode].losses, np.float64)
        ax_loss.plot(_smooth(losses), color=colour, label=MODE_LABELS[mode], linewidth=1.4)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss (smoothed)")
    ax_loss.legend()
    ax_loss.set_title(f"scaler-core demo on {result.dataset}")
    scaled = result.runs["float16+scaler"]
    ax_scale.step(range(len(scaled.scales)), scaled.scales, where="post", color="tab:blue")
    if scaled.skipped:
        ax_scale.plot(
            scaled.skipped,
            [scaled.scales[i] for i in scaled.skipped],
            "x",
            color="tab:red",
            label="skipped step (overflow)",
        )
        ax_scale.legend()
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_xlabel("step")
    fig.tight_layout()
    fmt = PLOT_FORMATS.get(os.path.splitext(path)[1].lower(), "png")
    try:
        write("--plot", path, lambda p: fig.savefig(p, format=fmt, dpi=100))
    finally:
        plt.close(fig)


def _smooth(values: np.ndarray, window: int = 20) -> np.ndarray:
    window = max(1, min(window, len(values)))
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


# -------------------------------------------------------------------------- CLI
def parse_number(text: str) -> float:
    """A float from the command line; powers of two may be written ``2^-17`` or ``2**-17``.

    Raises:
        argparse.ArgumentTypeError: ``text`` is neither.

    >>> parse_number("2^-3"), parse_number("0.5"), parse_number("2**4")
    (0.125, 0.5, 16.0)
    """
    for sep in ("^", "**"):
        base, found, exponent = text.partition(sep)
        if found and base.strip() == "2":
            try:
                return math.ldexp(1.0, int(exponent))
            except (ValueError, OverflowError):
                break
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number (write 0.001, 1e-5 or a power of two as 2^-17)"
        ) from None


def add_parser(subparsers: Any) -> None:
    """Register the ``demo`` command on the CLI's subparsers."""
    d = DemoSettings()
    p = subparsers.add_parser(
        "demo",
        help="train a small float16 network three ways and show what loss scaling saves",
        description=(
            "Train a small MLP three times from the same seed: float32, float16 without "
            "loss scaling, float16 with scaler-core. Prints final loss and accuracy, the "
            "share of gradient values float16 lost to underflow, skipped steps, the scale "
            "and the time of each run."
        ),
    )
    p.add_argument("--backend", choices=sorted(ARRAY_MODULES), default=d.backend)
    p.add_argument("--dataset", choices=("auto", "digits", "synthetic"), default=d.dataset)
    p.add_argument("--steps", type=int, default=d.steps, help="steps per run (%(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="(%(default)s)")
    p.add_argument("--width", type=int, default=d.width, help="hidden units (%(default)s)")
    p.add_argument("--depth", type=int, default=d.depth, help="hidden layers (%(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="SGD learning rate (%(default)s)")
    p.add_argument(
        "--loss-weight",
        type=parse_number,
        default=d.loss_weight,
        help="factor on the loss, compensated in the learning rate (2^-17)",
    )
    p.add_argument(
        "--init-scale", type=parse_number, default=d.init_scale, help="the scaler's first scale"
    )
    p.add_argument("--growth-interval", type=int, default=d.growth_interval, help="(%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="(%(default)s)")
    p.add_argument("--plot", metavar="FILE.png", help="draw loss and scale against steps")
    p.add_argument("--json", metavar="FILE", help="write every number as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run_command)


def run_command(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """Run ``scaler-core demo`` with parsed arguments; returns the exit code.

    Raises:
        ScalerError: Bad settings or a missing dependency (the CLI turns it into
            a one-line error and exit code 2).
    """
    out = sys.stdout if stdout is None else stdout
    settings = DemoSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        width=args.width,
        depth=args.depth,
        lr=args.lr,
        loss_weight=args.loss_weight,
        init_scale=args.init_scale,
        growth_interval=args.growth_interval,
        seed=args.seed,
        backend=args.backend,
        dataset=args.dataset,
    )
    # Everything that can fail is checked before a minute of training is spent.
    if args.plot is not None:
        check_output("--plot", args.plot, PLOT_FORMATS)
    if args.json is not None:
        check_output("--json", args.json)
    if args.plot is not None:
        pyplot("--plot")
    array_module(settings.backend)
    data = load_dataset(settings.dataset, settings.seed)
    if settings.batch_size > len(data.x_train):
        raise InvalidArgumentError(
            f"batch_size={settings.batch_size}, but the training split of {data.name} has "
            f"only {len(data.x_train)} examples; pass a smaller --batch-size"
        )
    with _progress(settings.steps, enabled=not args.quiet and sys.stderr.isatty()) as report:
        result = run_demo(settings, data=data, progress=report)
    print(format_summary(result), file=out)
    if args.json is not None:
        write_json(result, args.json)
        print(f"numbers written to {args.json}", file=out)
    if args.plot is not None:
        write_plot(result, args.plot)
        print(f"plot written to {args.plot}", file=out)
    return 0


@contextmanager
def _progress(steps: int, *, enabled: bool) -> Iterator[Callable[[str, int], None] | None]:
    """A progress bar per run on stderr: tqdm if installed, else a plain text line."""
    if not enabled:
        yield None
        return
    try:
        from tqdm import tqdm  # noqa: PLC0415 (optional extra)
    except ImportError:
        tqdm = None
    bars: dict[str, Any] = {}

    def report(mode: str, done: int) -> None:
        if tqdm is not None:
            bar = bars.get(mode)
            if bar is None:
                bar = bars[mode] = tqdm(
                    total=steps, desc=f"{MODE_LABELS[mode]:<23}", unit="step", leave=True
                )
            bar.update(done - bar.n)
        elif done == steps or done % max(1, steps // 50) == 0:
            end = "\n" if done == steps else ""
            sys.stderr.write(f"\r{MODE_LABELS[mode]:<23} {done:>6}/{steps} steps{end}")
            sys.stderr.flush()

    try:
        yield report
    finally:
        for bar in bars.values():
            bar.close()
