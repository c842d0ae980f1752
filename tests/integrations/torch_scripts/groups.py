"""One rank of a two-rank run of the process-group seams: the default group, a copied
scaler, float16 sparse gradients, a rank that holds no gradient of an optimizer.

Usage: ``groups.py RANK WORLD INIT_FILE OUT_FILE MODE`` with MODE ``HOW-WHOSE``, WHOSE
``ours`` (scaler-core's classes) or ``torch`` (PyTorch's), HOW one of:

* ``none``: ``ShardedGradScaler(..., process_group=None)``, which means the default
  group in PyTorch's class; an inf lands in rank 1's gradients only.
* ``deepcopy`` / ``pickle``: the same scaler, built with the default group, copied
  with ``copy.deepcopy`` or through ``pickle`` before training.
* ``sparse``: a float16 embedding with sparse gradients, one row looked up 3,510
  times, unscaled by ``ShardedGradScaler``: the row's duplicates summed.
* ``idle-fused`` / ``idle-plain`` (``ours`` only): ``GradScaler(process_group=WORLD)``
  and two optimizers, the first (a fused Adam, or SGD) holding no gradient on rank 0;
  an inf lands in rank 1's gradient of it.

Each rank trains its own copy of a small model on its own batches (the ranks are
tied only by the scaler's flags) and writes its scales, skip decisions, parameters
and what the mode records to ``OUT_FILE`` (``torch.save``).
"""

from __future__ import annotations

import copy
import pickle
import sys

import _ranks
import torch
import torch.distributed as dist

STEPS = 8
INF_STEPS = {2, 5}


def sharded(whose: str) -> type:
    if whose == "ours":
        from scaler_core.torch import ShardedGradScaler
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    return ShardedGradScaler


def train(scaler: object, rank: str) -> dict[str, object]:
    """Steps of a small model with an inf in rank 1's gradients at ``INF_STEPS``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1 + int(rank))
    scales, stepped = [], []
    for step in range(STEPS):
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 6, generator=gen)).pow(2).mean()).backward()
        if step in INF_STEPS and rank == "1":
            model[0].weight.grad[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        stepped.append(
            any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        )
        scaler.update()
        scales.append(scaler.get_scale())
    return {"scales": scales, "stepped": stepped, "params": list(model.parameters())}


def sparse(scaler: object) -> dict[str, object]:
    """One step of a float16 embedding whose row 0 is looked up 3,510 times."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(4, 2, sparse=True).half()
    opt = torch.optim.SGD(table.parameters(), lr=2.0**-12)
    ids = torch.tensor([0] * 3510 + [1, 2])
    # Each duplicate is 256 * 2**-7 = 2 scaled: 7020 summed in float32, where float16
    # stops at 4096 (its spacing there is 4).
    scaler.scale(table(ids).float().sum() * 2.0**-7).backward()
    assert table.weight.grad.dtype == torch.float16
    assert not table.weight.grad.is_coalesced()
    scaler.unscale_(opt)
    grad = table.weight.grad.to_dense().clone()
    scaler.step(opt)
    scaler.update()
    return {"grad": grad, "params": [table.weight.detach().clone()], "scales": [scaler.get_scale()]}


def idle(rank: str, fused: bool) -> dict[str, object]:
    """Two optimizers; rank 0 holds no gradient of the first."""
    from scaler_core.torch import GradScaler

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    first = torch.optim.Adam([a], lr=0.1, fused=True) if fused else torch.optim.SGD([a], lr=0.1)
    second = torch.optim.SGD([b], lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0**8, growth_interval=3, process_group=dist.group.WORLD)
    gen = torch.Generator().manual_seed(1 + int(rank))
    scales, stepped = [], []
    for step in range(STEPS):
        first.zero_grad()
        second.zero_grad()
        x = torch.randn(3, generator=gen)
        scaler.scale((a * x).sum() + (b * x).pow(2).sum()).backward()
        if rank == "0":
            a.grad = None  # this rank holds none of the first optimizer's gradients
        elif step in INF_STEPS:
            a.grad[0] = float("inf")
        scaler.step(first)
        scaler.step(second)
        stepped.append((scaler.stepped(first), scaler.stepped(second)))
        scaler.update()
        scales.append(scaler.get_scale())
    return {"scales": scales, "stepped": stepped, "params": [a.detach(), b.detach()]}


def main() -> None:
    rank, world, init_file, out_file, mode = sys.argv[1:6]
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    how, whose = mode.rsplit("-", 1)
    if how.startswith("idle"):
        out = idle(rank, fused=how == "idle-fused")
    else:
        scaler = sharded(whose)("cpu", 2.0**8, 0.5, 2.0, 3, True, None)
        if how == "deepcopy":
            scaler = copy.deepcopy(scaler)
        elif how == "pickle":
            scaler = pickle.loads(pickle.dumps(scaler))
        out = sparse(scaler) if how == "sparse" else train(scaler, rank)
        out["group"] = repr(getattr(scaler, "process_group", "missing"))
    torch.save(out, out_file)
    _ranks.leave()


if __name__ == "__main__":
    _ranks.run(main)
