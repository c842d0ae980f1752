"""One rank of a two-rank FSDP1 run (``FullyShardedDataParallel``, float16 mixed
precision with low-precision gradients), with scaler-core's ShardedGradScaler or
PyTorch's.

Usage: ``fsdp1.py RANK WORLD INIT_FILE OUT_FILE {ours,torch}[-fused]``

``-fused``: a fused Adam (float32 gradients, as it needs), ``unscale_`` before ``step``
(as for clipping), and the inf in both ranks' shards.

The loss is float16 (``scale`` keeps its dtype, as PyTorch's class does); at the
chosen steps an inf lands in rank 1's shard of the gradients only, so the ranks must
OR their flags over the default group to skip together. The rank writes its
parameters (its shard), its scales, its skip decisions and its gradients' dtypes to
``OUT_FILE`` (``torch.save``).
"""

from __future__ import annotations

import sys

import _ranks
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

STEPS = 16
INF_STEPS = {3, 9, 10}


def main() -> None:
    rank, world, init_file, out_file, mode = sys.argv[1:6]
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    fused = mode.endswith("-fused")
    if mode.startswith("ours"):
        from scaler_core.torch import ShardedGradScaler
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    half = MixedPrecision(
        param_dtype=torch.float16,
        reduce_dtype=torch.float16,
        buffer_dtype=torch.float16,
        keep_low_precision_grads=not fused,  # a fused Adam takes gradients of its params' dtype
    )
    fsdp = FullyShardedDataParallel(model, device_id=torch.device("cpu"), mixed_precision=half)
    opt = (
        torch.optim.Adam(fsdp.parameters(), lr=0.05, fused=True)
        if fused
        else torch.optim.SGD(fsdp.parameters(), lr=0.05)
    )
    scaler = ShardedGradScaler("cpu", 2.0**8, 0.5, 2.0, 4)  # PyTorch's positional order
    gen = torch.Generator().manual_seed(1 + int(rank))
    scales, stepped, dtypes = [], [], set()
    for step in range(STEPS):
        opt.zero_grad()
        loss = fsdp(torch.randn(4, 6, generator=gen)).pow(2).mean()  # float16
        scaled = scaler.scale(loss)
        dtypes.add(str(scaled.dtype))
        scaled.backward()
        if step in INF_STEPS and (rank == "1" or fused):
            grads = [p.grad for p in fsdp.parameters() if p.grad is not None and p.grad.numel()]
            grads[0].view(-1)[0] = float("inf")
        for p in fsdp.parameters():
            if p.grad is not None:
                dtypes.add(str(p.grad.dtype))
        before = [p.detach().clone() for p in fsdp.parameters()]
        if fused:
            scaler.unscale_(opt)
        scaler.step(opt)
        stepped.append(
            any(not torch.equal(b, p) for b, p in zip(before, fsdp.parameters(), strict=True))
        )
        scaler.update()
        scales.append(float(scaler.get_scale()))
    params = [p.detach().clone() for p in fsdp.parameters()]
    torch.save({"params": params, "scales": scales, "stepped": stepped, "dtypes": dtypes}, out_file)
    _ranks.leave()


if __name__ == "__main__":
    _ranks.run(main)
