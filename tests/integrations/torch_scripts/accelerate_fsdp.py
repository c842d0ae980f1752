"""One rank of a two-rank FSDP run through accelerate, with accelerate's scaler and then
with scaler-core's in its place (``scaler_core.accelerate.install``).

Usage: ``accelerate_fsdp.py RANK WORLD INIT_FILE OUT_FILE {1,2}`` (the FSDP version)

The rank joins the gloo group, sets the variables accelerate reads for a CPU run, and
trains one small model twice from the same seed and batches: once with the scaler
accelerate builds (PyTorch's ``ShardedGradScaler`` for FSDP1, ``torch.amp.GradScaler``
for FSDP2), once after ``install``. accelerate runs as on a GPU
(``accelerate_gpu_path.py``: float16 autocast, its FSDP wrapping, its scaler).
At the chosen steps an inf lands in rank 1's shard of the gradients only, before
``clip_grad_norm_`` (which unscales). The rank writes, per run, the scaler's class,
its scales, the skipped steps, the dtypes of an activation, and its parameters and
optimizer state (its shards) to ``OUT_FILE`` (``torch.save``).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import _ranks
import torch
import torch.distributed as dist

STEPS = 10
INF_STEPS = {2, 6}


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (an FSDP2 DTensor's local shard; FSDP1's flat shard as is)."""
    return t.to_local() if hasattr(t, "to_local") else t


def train(version: int, ours: bool, rank: int) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin, GradScalerKwargs
    from accelerate_gpu_path import as_on_a_gpu

    from scaler_core.accelerate import install

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    accelerator = Accelerator(
        mixed_precision="fp16",
        cpu=True,
        fsdp_plugin=plugin,
        kwargs_handlers=[GradScalerKwargs(init_scale=2.0**8, growth_interval=3)],
    )
    as_on_a_gpu(accelerator, plugin)
    if ours:
        install(accelerator)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    dtypes: set[str] = set()
    model[0].register_forward_hook(lambda m, i, out: dtypes.add(str(out.dtype)))
    if version == 1:  # FSDP1 flattens the parameters: the optimizer is made after prepare
        model = accelerator.prepare(model)
        opt = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=0.05))
    else:  # FSDP2 takes the model and its optimizer together
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    gen = torch.Generator().manual_seed(1 + rank)
    scales, skipped = [], []
    for step in range(STEPS):
        loss = model(torch.randn(4, 6, generator=gen)).float().pow(2).mean()
        accelerator.backward(loss)
        if step in INF_STEPS and rank == 1:
            grad = next(p.grad for p in model.parameters() if p.grad is not None)
            local(grad).view(-1)[0] = float("inf")
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
        scales.append(accelerator.scaler.get_scale())
    params = [local(p.detach()).clone() for p in model.parameters()]
    state = [local(t).clone() for s in opt.state_dict()["state"].values() for t in s.values()]
    scaler = type(accelerator.scaler)
    return {
        "scaler": f"{scaler.__module__}.{scaler.__qualname__}",
        "opt_scaler": opt.scaler is accelerator.scaler,
        "model": type(model).__name__,
        "scales": scales,
        "skipped": skipped,
        "dtypes": dtypes,
        "params": params,
        "state": state,
    }


def main() -> None:
    rank, world, init_file, out_file, version = sys.argv[1:6]
    os.environ.update(
        RANK=rank,
        WORLD_SIZE=world,
        LOCAL_RANK=rank,
        LOCAL_WORLD_SIZE=world,
        MASTER_ADDR="127.0.0.1",
        HF_HUB_OFFLINE="1",
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    out = {
        "torch": train(int(version), ours=False, rank=int(rank)),
        "ours": train(int(version), ours=True, rank=int(rank)),
    }
    torch.save(out, out_file)
    _ranks.leave()


if __name__ == "__main__":
    _ranks.run(main)
