"""One rank of a two-rank DeepSpeed ZeRO-1 fp16 run, on the CPU over gloo, with
DeepSpeed's own ``DynamicLossScaler`` and with scaler-core's (``install``).

Usage: ``deepspeed_zero.py RANK WORLD INIT_FILE OUT_FILE all``

The shims, the same for every engine of the run: DeepSpeed's CPU accelerator is told
that float16 is supported (``is_fp16_supported``; it asks oneDNN, which says no on
some CPUs), and its shared-memory all-reduce op is marked unavailable (it would
JIT-compile C++; gloo does the all-reduce).

Four runs, each a fresh engine built from the same seed, each step's batch drawn
from a generator seeded by (rank, step):

* ``deepspeed``: DeepSpeed's scaler, ``STEPS`` steps, a checkpoint after ``SAVE_AT``;
* ``ours``: the same with ``install(engine)``, its own checkpoint;
* ``ours_from_deepspeed``: installed, loads DeepSpeed's checkpoint, runs the rest;
* ``deepspeed_from_ours``: plain DeepSpeed, loads scaler-core's checkpoint, runs the rest.

At ``INF_STEPS`` an inf lands in rank 1's gradient of the first layer's weight only
(a tensor hook), so the ranks must OR their flags (ZeRO does) to skip together. Each
run records, after every step, the loss scale, DeepSpeed's counters, whether the
step was skipped, the float16 parameters, the fp32 partitions and Adam's state.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import _ranks
import torch
import torch.distributed as dist

STEPS = 14
SAVE_AT = 7  # the checkpoint is taken after steps 0..6
INF_STEPS = {3, 4, 9}
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 1},
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 8,
        "loss_scale_window": 2,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
}


def _engine(install: bool, config: dict[str, Any] | None = None) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config or CONFIG, dist_init_required=False
    )
    poison = {"on": False}

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not poison["on"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    engine.module[0].weight.register_hook(hook)
    engine.poison = poison
    if install:
        from scaler_core.deepspeed import install as install_

        install_(engine)
    return engine


def _snapshot(engine: Any) -> dict[str, Any]:
    opt = engine.optimizer
    scaler = opt.loss_scaler
    adam = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for s in opt.optimizer.state.values()
    ]
    return {
        "scale": opt.loss_scale,
        "counters": (scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis),
        "skipped": engine.skipped_steps,
        "params": [p.detach().clone() for p in engine.module.parameters()],
        "fp32": [t.detach().clone() for t in opt.single_partition_of_fp32_groups],
        "adam": adam,
        "scaler_class": f"{type(scaler).__module__}.{type(scaler).__qualname__}",
    }


def _train(engine: Any, rank: int, steps: range, save: Path | None = None) -> list[Any]:
    out = []
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(4, 6, generator=gen).half()
        engine.poison["on"] = step in INF_STEPS and rank == 1
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.poison["on"] = False
        out.append(_snapshot(engine))
        if save is not None and step == SAVE_AT - 1:
            engine.save_checkpoint(str(save), tag="mid")
    return out


def _refusals() -> dict[str, Any]:
    """What install() says to engines it must refuse, and that it changed nothing."""
    from scaler_core import InvalidArgumentError
    from scaler_core.deepspeed import install

    fp16 = CONFIG["fp16"]
    cases = {
        "no_zero": {**CONFIG, "zero_optimization": {"stage": 0}},
        "static": {**CONFIG, "fp16": {**fp16, "loss_scale": 128}},
        "bf16": {**CONFIG, "fp16": {"enabled": False}, "bf16": {"enabled": True}},
    }
    out = {}
    for name, config in cases.items():
        engine = _engine(install=False, config=config)
        before = getattr(engine.optimizer, "loss_scaler", None)
        try:
            install(engine)
        except InvalidArgumentError as exc:
            after = getattr(engine.optimizer, "loss_scaler", None)
            out[name] = (type(engine.optimizer).__name__, str(exc), after is before)
        else:
            out[name] = (type(engine.optimizer).__name__, None, False)
    return out


def main() -> None:
    rank_s, world, init_file, out_file, mode = sys.argv[1:6]
    assert mode == "all", mode
    rank = int(rank_s)
    os.environ.update(LOCAL_RANK=rank_s, RANK=rank_s, WORLD_SIZE=world)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=int(world)
    )
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}
    type(get_accelerator()).is_fp16_supported = lambda self: True
    tmp = Path(out_file).parent
    ckpt_ds, ckpt_ours = tmp / "ckpt-deepspeed", tmp / "ckpt-ours"
    runs: dict[str, Any] = {}
    dtypes = set()

    engine = _engine(install=False)
    dtypes |= {str(p.dtype) for p in engine.module.parameters()}
    runs["deepspeed"] = _train(engine, rank, range(STEPS), save=ckpt_ds)
    engine = _engine(install=True)
    dtypes |= {str(p.dtype) for p in engine.module.parameters()}
    runs["ours"] = _train(engine, rank, range(STEPS), save=ckpt_ours)
    dist.barrier()  # both checkpoints are written

    engine = _engine(install=True)
    engine.load_checkpoint(str(ckpt_ds), tag="mid")
    runs["ours_from_deepspeed_loaded"] = _snapshot(engine)
    runs["ours_from_deepspeed"] = _train(engine, rank, range(SAVE_AT, STEPS))

    engine = _engine(install=False)
    engine.load_checkpoint(str(ckpt_ours), tag="mid")
    runs["deepspeed_from_ours_loaded"] = _snapshot(engine)
    runs["deepspeed_from_ours"] = _train(engine, rank, range(SAVE_AT, STEPS))

    runs["refusals"] = _refusals()
    runs["dtypes"] = dtypes
    runs["checkpoints"] = {"deepspeed": str(ckpt_ds), "ours": str(ckpt_ours)}
    torch.save(runs, out_file)
    _ranks.leave()


if __name__ == "__main__":
    _ranks.run(main)
