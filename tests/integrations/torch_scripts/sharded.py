"""One rank of a two-rank, ZeRO-style run: each rank owns and steps half the parameters.

Usage: ``sharded.py RANK WORLD INIT_FILE OUT_FILE {group,none,group-fold}``

Gradients are averaged over the ranks (so both hold the same ones), then each
rank checks and steps only the shard it owns, as ZeRO and FSDP do. At the chosen
steps an inf lands in rank 1's shard only (an overflow in its part of the
reduction). With ``group`` the scaler ORs the found flag over the ranks; with
``none`` each rank decides alone; ``group-fold`` is ``group`` with a fused AdamW
stepped by ``clip_and_step`` (the clip folded into its step). After training each
shard is broadcast from its owner; the rank writes its full parameters, its skip decisions and its
scaler state to ``OUT_FILE`` (``torch.save``).
"""

from __future__ import annotations

import sys

import _ranks
import torch
import torch.distributed as dist

from scaler_core.torch import GradScaler

STEPS = 30
INF_STEPS = {4, 11, 12, 25}


def main() -> None:
    rank, world, init_file, out_file, mode = sys.argv[1:6]
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    params = list(model.parameters())
    shards = [params[:2], params[2:]]
    mine = shards[int(rank)]
    fold = mode == "group-fold"
    opt = torch.optim.AdamW(mine, lr=1e-2, fused=True if fold else None)
    group = dist.group.WORLD if mode.startswith("group") else None
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=5, process_group=group)
    data = torch.Generator().manual_seed(100 + int(rank))  # each rank its own batch
    decisions = []
    for step in range(STEPS):
        opt.zero_grad()
        for p in params:
            p.grad = None
        x, y = torch.randn(8, 6, generator=data), torch.randn(8, 2, generator=data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        for p in params:  # data parallel: average the gradients
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= int(world)
        if int(rank) == 1 and step in INF_STEPS:
            assert mine[0].grad is not None
            mine[0].grad.view(-1)[0] = float("inf")
        if fold:
            scaler.clip_and_step(opt, 1.0)
        else:
            scaler.step(opt)
        decisions.append(scaler.stepped(opt))
        scaler.update()
    for owner, shard in enumerate(shards):
        for p in shard:
            dist.broadcast(p.data, src=owner)
    torch.save(
        {
            "params": [p.detach().clone() for p in params],
            "decisions": decisions,
            "state": scaler.state_dict(),
        },
        out_file,
    )
    _ranks.leave()


if __name__ == "__main__":
    _ranks.run(main)
