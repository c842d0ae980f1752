"""One rank of a two-rank FSDP1 run in which rank 0 holds no gradient of one optimizer.

Usage: ``fsdp1_idle.py RANK WORLD INIT_FILE OUT_FILE {ours,torch}``

With ``use_orig_params=True`` each rank holds the parameters that fall in its half of
the flat parameter; the last bias (2 of the 74 elements) is all in rank 1's half, so
on rank 0 the optimizer of that bias alone has no gradient. PyTorch's
ShardedGradScaler gives such a rank a found flag on the scale's device, so it steps
and joins the flags' all-reduce; an inf in rank 1's bias gradient at the chosen steps
must skip that optimizer on both ranks. The rank writes its scales, whether it held
a gradient of that optimizer, and its parameters to ``OUT_FILE`` (``torch.save``).
"""

from __future__ import annotations

import sys

import _ranks
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel

STEPS = 8
INF_STEPS = {2, 5}


def main() -> None:
    rank, world, init_file, out_file, mode = sys.argv[1:6]
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    if mode == "ours":
        from scaler_core.torch import ShardedGradScaler
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    fsdp = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    *body, bias = list(fsdp.parameters())
    opts = [torch.optim.SGD(body, lr=0.05), torch.optim.SGD([bias], lr=0.05)]
    scaler = ShardedGradScaler("cpu", 2.0**8, 0.5, 2.0, 2)
    gen = torch.Generator().manual_seed(1 + int(rank))
    scales, held = [], []
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        scaler.scale(fsdp(torch.randn(4, 6, generator=gen)).pow(2).mean()).backward()
        held.append(bias.grad is not None and bias.grad.numel() > 0)
        if step in INF_STEPS and rank == "1":
            bias.grad.view(-1)[0] = float("inf")
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
    params = [p.detach().clone() for p in fsdp.parameters()]
    torch.save({"params": params, "scales": scales, "held": held}, out_file)
    _ranks.leave()


if __name__ == "__main__":
    _ranks.run(main)
