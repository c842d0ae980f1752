"""Drives the real scaler of another library, for tests/oracles/test_presets_anchors.py.

Run as a script in its own interpreter: ``python anchor_worker.py ANCHOR [ANCHOR ...]``.
It imports the named anchors' libraries, answers one line ``{"ready": {...versions}}``
and then, for each request line ``{"anchor": NAME, "cases": [[params, flags], ...]}``
on stdin, one line on stdout: per case ``{"scales": [...], "skips": [...],
"raised": null | "Type: message"}``. ``params`` are the anchor's own constructor
arguments; ``scales`` holds the scale after every step as a Python float (exactly the
float32 or float64 the library keeps), ``skips`` whether the library's own API
skipped that step's optimizer update (``null`` where it has no such API), and
``raised`` what the library raised (at construction, or at the step after the last
one recorded). Anything a library prints goes to stderr, never into the answers.

The shims, each the lightest that works on a CPU:
- DeepSpeed: ``deepspeed.init_distributed("gloo")`` on 127.0.0.1 with a world of one
  (``DynamicLossScaler`` asks for the rank when it logs), with DeepSpeed's shared-memory
  all-reduce marked unavailable: it would probe compilers and JIT-compile that C++ op
  for minutes, and a world of one never all-reduces.
- Megatron-LM: ``DynamicGradScaler`` makes its tensors with ``device='cuda'``; a
  ``TorchFunctionMode`` turns that device into the CPU while the scaler is built.
- Paddle: ``paddle.amp.GradScaler`` disables itself unless the tracer's place is a
  GPU; the tracer is asked through a stand-in that says so while it is built. The
  step, unscale and update then run Paddle's CPU kernels.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

# Replies go to the real stdout; everything else printed (Paddle prints every backoff,
# DeepSpeed logs) goes to stderr.
_OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr

Trajectory = dict[str, Any]
Driver = Callable[[dict[str, Any], list[bool]], Trajectory]


def _trajectory() -> Trajectory:
    return {"scales": [], "skips": [], "raised": None}


def _raised(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------------- torch
def _torch() -> tuple[str, Driver]:
    import torch

    def run(params: dict[str, Any], flags: list[bool]) -> Trajectory:
        out = _trajectory()
        scaler = torch.amp.GradScaler("cpu", **params)
        p = torch.nn.Parameter(torch.ones(1))
        # Weight decay moves the parameter on every applied step, even where the unscaled
        # gradient rounds to 0 (a scale near the largest float32).
        opt = torch.optim.SGD([p], lr=1.0, weight_decay=0.5)
        for flag in flags:
            with torch.no_grad():
                p.fill_(1.0)
            scaler.scale(torch.zeros(()))  # as a loop does: scale the loss (lazy init)
            # A scaled gradient that unscales to about 1, or an overflow.
            p.grad = torch.full((1,), math.inf if flag else scaler.get_scale())
            before = p.detach().clone()
            scaler.step(opt)
            scaler.update()
            out["skips"].append(bool(torch.equal(before, p.detach())))
            out["scales"].append(float(scaler.get_scale()))
        return out

    return torch.__version__, run


# --------------------------------------------------------------------- DeepSpeed
def _deepspeed() -> tuple[str, Driver]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed
    import deepspeed.ops

    ops = vars(deepspeed.ops)
    if "__compatible_ops__" in ops:  # 0.17: probed at import
        ops["__compatible_ops__"]["deepspeed_shm_comm"] = False
    else:  # 0.19: probed on first access; never let it probe
        deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    deepspeed.init_distributed("gloo", verbose=False)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    def run(params: dict[str, Any], flags: list[bool]) -> Trajectory:
        # DynamicLossScaler's own overflow check (has_overflow_serial) raises TypeError in
        # 0.17.0 and 0.19.8 (_has_inf_or_nan lacks self); the optimizers skip on the flag.
        out = _trajectory()
        try:
            scaler = DynamicLossScaler(**params)
        except Exception as exc:
            out["raised"] = _raised(exc)
            return out
        for flag in flags:
            try:
                scaler.update_scale(flag)
            except Exception as exc:
                out["raised"] = _raised(exc)
                return out
            out["scales"].append(float(scaler.cur_scale))
            out["skips"].append(None)
        return out

    return deepspeed.__version__, run


# ---------------------------------------------------------------------- Megatron
def _megatron() -> tuple[str, Driver]:
    import importlib.metadata
    import importlib.util

    from torch.overrides import TorchFunctionMode

    # The installed megatron-core's own grad_scaler.py, loaded by its path: the module
    # imports only torch, and importing it as megatron.core.optimizer.grad_scaler would
    # first run megatron.core's package imports (about 10 s, and warnings) for nothing.
    files = importlib.metadata.files("megatron-core") or []
    (path,) = [f for f in files if str(f) == "megatron/core/optimizer/grad_scaler.py"]
    spec = importlib.util.spec_from_file_location("megatron_grad_scaler", path.locate())
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    DynamicGradScaler = module.DynamicGradScaler

    class CudaOnCpu(TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = dict(kwargs or {})
            if str(kwargs.get("device")) == "cuda":
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    def run(params: dict[str, Any], flags: list[bool]) -> Trajectory:
        out = _trajectory()
        try:
            with CudaOnCpu():
                scaler = DynamicGradScaler(**params)
        except AssertionError as exc:  # its argument checks are asserts
            out["raised"] = _raised(exc)
            return out
        for flag in flags:
            scaler.update(flag)  # the optimizer skips its step on found_inf
            out["scales"].append(float(scaler.scale.item()))
            out["skips"].append(None)
        return out

    return importlib.metadata.version("megatron-core"), run


# ------------------------------------------------------------------------ Paddle
def _paddle_import() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import paddle
    paddle.set_device("cpu")
    return paddle


def _paddle() -> tuple[str, Driver]:
    from unittest import mock

    import numpy as np

    paddle = _paddle_import()
    from paddle.amp import grad_scaler

    class Place:
        def is_gpu_place(self) -> bool:
            return True

    class Tracer:
        _expected_place = Place()

    def run(params: dict[str, Any], flags: list[bool]) -> Trajectory:
        out = _trajectory()
        try:
            with mock.patch.object(grad_scaler, "_dygraph_tracer", Tracer):
                scaler = paddle.amp.GradScaler(**params)
        except AssertionError as exc:
            out["raised"] = _raised(exc)
            return out
        assert scaler.is_enable()
        p = paddle.create_parameter([1], "float32")
        # Weight decay moves the parameter on every applied step, even where the unscaled
        # gradient rounds to 0 (Paddle flushes 1/scale to 0 near the largest float32).
        opt = paddle.optimizer.SGD(learning_rate=1.0, parameters=[p], weight_decay=0.5)
        for flag in flags:
            p.set_value(np.ones(1, np.float32))
            scale = np.float32(scaler._scale.numpy()[0])
            p.grad = paddle.to_tensor(np.array([np.inf if flag else scale], np.float32))
            before = p.numpy().copy()
            with np.errstate(all="ignore"):
                scaler.step(opt)
                scaler.update()
            out["skips"].append(bool(np.array_equal(before, p.numpy())))
            out["scales"].append(float(scaler._scale.numpy()[0]))
            opt.clear_grad()
        return out

    return paddle.__version__, run


def _paddle_static() -> tuple[str, Driver]:
    import numpy as np

    paddle = _paddle_import()
    from paddle import _C_ops

    def run(params: dict[str, Any], flags: list[bool]) -> Trajectory:
        out = _trajectory()
        init = np.float32(params["init_loss_scaling"])
        scale = paddle.to_tensor(np.array([init], np.float32))
        start = params.get("_start", {})  # the counters the operator's own test starts from
        good = paddle.to_tensor(np.array([start.get("good", 0)], np.int32))
        bad = paddle.to_tensor(np.array([start.get("bad", 0)], np.int32))
        for flag in flags:
            grads = [paddle.to_tensor(np.ones(1, np.float32))]
            found = paddle.to_tensor(np.array([flag]))
            _C_ops.update_loss_scaling_(
                grads,
                found,
                scale,
                good,
                bad,
                params["incr_every_n_steps"],
                params["decr_every_n_nan_or_inf"],
                params["incr_ratio"],
                params["decr_ratio"],
                False,
            )
            # The operator zeroes the gradients of a step it found non-finite.
            out["skips"].append(bool(grads[0].numpy()[0] == 0.0))
            out["scales"].append(float(scale.numpy()[0]))
        return out

    return paddle.__version__, run


# ------------------------------------------------------------- jmp, flax, Keras
_CHUNK = 256  # steps per compiled scan, so each static config compiles once


def _scan_chunks(compiled: Any, carry: Any, flags: list[bool]) -> tuple[list[Any], list[Any]]:
    """Run ``compiled(carry, flags) -> (carry, (scales, skips))`` over ``flags`` in
    fixed-size chunks (the last one padded; its padding is dropped)."""
    import numpy as np

    scales: list[Any] = []
    skips: list[Any] = []
    for at in range(0, len(flags), _CHUNK):
        part = flags[at : at + _CHUNK]
        padded = np.asarray(part + [False] * (_CHUNK - len(part)), dtype=bool)
        carry, (s, k) = compiled(carry, padded)
        scales += [float(x) for x in np.asarray(s)[: len(part)]]
        skips += [bool(x) for x in np.asarray(k)[: len(part)]]
    return scales, skips


def _jmp() -> tuple[str, Driver]:
    import importlib.metadata

    import jax
    import jax.numpy as jnp
    import jmp

    compiled: dict[Any, Any] = {}

    def run(params: dict[str, Any], flags: list[bool]) -> Trajectory:
        period, factor = params["period"], params["factor"]
        key = (period, factor)
        if key not in compiled:

            def step(carry: Any, found: Any) -> Any:
                # jmp's pytree flattening drops min_loss_scale (it comes back as 1.0),
                # so the carry holds the arrays and the floor.
                scale, counter, low = carry
                grads = {"g": jnp.where(found, jnp.inf, 1.0)}
                finite = jmp.all_finite(grads)
                ls = jmp.DynamicLossScale(
                    loss_scale=scale,
                    counter=counter,
                    period=period,
                    factor=factor,
                    min_loss_scale=low,
                ).adjust(finite)
                return (ls.loss_scale, ls.counter, low), (ls.loss_scale, ~finite)

            compiled[key] = jax.jit(lambda c, fs: jax.lax.scan(step, c, fs))
        start = (
            jnp.float32(params["loss_scale"]),
            jnp.int32(0),
            jnp.float32(params["min_loss_scale"]),
        )
        scales, skips = _scan_chunks(compiled[key], start, flags)
        return {"scales": scales, "skips": skips, "raised": None}

    return importlib.metadata.version("jmp"), run


def _flax() -> tuple[str, Driver]:
    import flax
    import jax
    import jax.numpy as jnp
    from flax.training.dynamic_scale import DynamicScale

    compiled: dict[Any, Any] = {}

    def loss(p: Any, g: Any) -> Any:
        return jnp.sum(p * g)

    def run(params: dict[str, Any], flags: list[bool]) -> Trajectory:
        static = {k: v for k, v in params.items() if k != "scale"}
        key = tuple(sorted(static.items()))
        if key not in compiled:

            def step(ds: Any, found: Any) -> Any:
                g = jnp.where(found, jnp.inf, 1.0)
                ds, is_fin, _, _ = ds.value_and_grad(loss)(jnp.ones(()), g)
                return ds, (ds.scale, ~is_fin)

            compiled[key] = jax.jit(lambda c, fs: jax.lax.scan(step, c, fs))
        start = DynamicScale(fin_steps=jnp.int32(0), scale=jnp.float32(params["scale"]), **static)
        scales, skips = _scan_chunks(compiled[key], start, flags)
        return {"scales": scales, "skips": skips, "raised": None}

    return flax.__version__, run


def _keras() -> tuple[str, Driver]:
    os.environ["KERAS_BACKEND"] = "numpy"
    import keras
    import numpy as np

    def run(params: dict[str, Any], flags: list[bool]) -> Trajectory:
        out = _trajectory()
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), **params)
        v = keras.Variable(np.zeros(1, np.float32))
        opt.build([v])
        with np.errstate(all="ignore"):
            for flag in flags:
                before = int(np.asarray(opt.inner_optimizer.iterations.value))
                grad = np.full(1, np.inf if flag else 1.0, np.float32)
                opt.apply([grad], [v])
                after = int(np.asarray(opt.inner_optimizer.iterations.value))
                out["skips"].append(after == before)
                out["scales"].append(float(np.asarray(opt.dynamic_scale.value)))
        return out

    return keras.__version__, run


ANCHORS: dict[str, Callable[[], tuple[str, Driver]]] = {
    "torch": _torch,
    "deepspeed": _deepspeed,
    "megatron": _megatron,
    "paddle": _paddle,
    "paddle_static": _paddle_static,
    "jmp": _jmp,
    "flax": _flax,
    "keras": _keras,
}


def main(names: list[str]) -> None:
    drivers: dict[str, Driver] = {}
    versions: dict[str, str] = {}
    for name in names:
        versions[name], drivers[name] = ANCHORS[name]()
    _OUT.write(json.dumps({"ready": versions}) + "\n")
    _OUT.flush()
    for line in sys.stdin:
        request = json.loads(line)
        run = drivers[request["anchor"]]
        answer = [run(params, flags) for params, flags in request["cases"]]
        _OUT.write(json.dumps(answer) + "\n")
        _OUT.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
