"""One rank of a two-rank FSDP2 run (``fully_shard``: every gradient a DTensor shard).

Usage: ``fsdp2.py RANK WORLD INIT_FILE OUT_FILE -`` (the last argument is unused)

Two copies of one model, sharded alike, train side by side on the same batches:
one with ``scaler_core.torch.GradScaler`` and ``unscale_and_clip_`` (and
``report_leaves=True``), the other with ``torch.amp.GradScaler``, ``unscale_`` and
PyTorch's clip. Neither has a ``process_group``. At the chosen steps an inf lands
in rank 1's shard of one gradient only. PyTorch's clip is given scaler-core's norm
(``clip_grads_with_norm_``), so the two runs must stay bit-identical; PyTorch's own
norm (``get_total_norm``) is recorded beside it. The rank writes, per step, both
norms, both found flags, the exact norm (float64 ``math.fsum`` of the full
gradients), the skip decisions and the leaf reports, at the end both models'
full parameters, and what the functional API says of a sharded and of a partial
DTensor, to ``OUT_FILE`` (``torch.save``).

Two more copies train with a fused Adam: one with ``unscale_and_clip_`` then ``step``,
the other with the folded ``clip_and_step``; their norms, decisions and full
parameters are written too.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import _ranks
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

import scaler_core as sc
from scaler_core import StepReport
from scaler_core.torch import GradScaler

STEPS = 12
INF_STEPS = {3, 8}
MAX_NORM = 0.5


def model(mesh: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def flags(scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer) -> list[float]:
    return [float(f.item()) for f in scaler._found_inf_per_device(opt).values()]


def fused_copy(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, GradScaler]:
    """The model, a fused Adam over it and a scaler of its own."""
    net = model(mesh)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    return net, opt, GradScaler("cpu", init_scale=2.0**12)


def fused_step(fold: bool, opt: torch.optim.Optimizer, scaler: GradScaler) -> tuple[float, bool]:
    """One step of a fused optimizer, folded (``clip_and_step``) or not: the norm, whether
    it stepped."""
    if fold:
        norm = scaler.clip_and_step(opt, MAX_NORM)
    else:
        norm = scaler.unscale_and_clip_(opt, MAX_NORM)
        scaler.step(opt)
    out = (float(norm), scaler.stepped(opt))
    scaler.update()
    opt.zero_grad()
    return out


def functional_api(mesh: Any, rank: int, out: dict[str, Any]) -> None:
    """The functional API on a DTensor: rank 1's NaN is seen on both ranks; a DTensor
    placed as a partial sum is refused by name, before anything is touched."""
    shard = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    if rank == 1:
        shard.to_local()[0] = math.nan
    out["found"] = bool(sc.find_non_finite([shard]))
    out["report"] = [str(r) for r in sc.non_finite_leaves({"w": shard})]
    partial = DTensor.from_local(torch.full((2,), 4.0), mesh, [Partial()])
    try:
        sc.unscale({"w": partial}, 2.0)
    except sc.GradientValueError as exc:
        out["refused"] = (str(exc), partial.to_local().tolist())


def main() -> None:
    rank, world, init_file, out_file = sys.argv[1:5]
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    mesh = init_device_mesh("cpu", (int(world),))
    ours_net, theirs_net = model(mesh), model(mesh)
    fused = {name: fused_copy(mesh) for name in ("recipe", "fold")}
    ours_opt = torch.optim.Adam(ours_net.parameters(), lr=1e-2)
    theirs_opt = torch.optim.Adam(theirs_net.parameters(), lr=1e-2)
    reports: list[StepReport] = []
    ours = GradScaler("cpu", init_scale=2.0**12, on_step=reports.append, report_leaves=True)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    data = torch.Generator().manual_seed(100 + int(rank))  # each rank its own batch
    out: dict[str, Any] = {
        k: [] for k in ("ours", "theirs", "exact", "flags", "stepped", "recipe", "fold")
    }
    for step in range(STEPS):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        pairs = [(ours, ours_net), (theirs, theirs_net)] + [(s, n) for n, _, s in fused.values()]
        for scaler, net in pairs:
            loss = torch.nn.functional.mse_loss(net(x), y)
            scaler.scale(loss).backward()
            if int(rank) == 1 and step in INF_STEPS:  # rank 1's shard only
                grad = net[2].weight.grad
                assert isinstance(grad, DTensor)
                grad.to_local().view(-1)[0] = math.inf
        norm = ours.unscale_and_clip_(ours_opt, MAX_NORM)
        theirs.unscale_(theirs_opt)  # PyTorch's DTensor layer reduces its found flag
        grads = [p.grad for p in theirs_net.parameters() if p.grad is not None]
        exact = math.sqrt(
            math.fsum(v * v for g in grads for v in full(g).double().flatten().tolist())
        )
        their_norm = full(torch.nn.utils.get_total_norm(grads))
        their_flags = flags(theirs, theirs_opt)
        if not any(their_flags):  # PyTorch's clip, with scaler-core's norm: the same bits
            torch.nn.utils.clip_grads_with_norm_(theirs_net.parameters(), MAX_NORM, norm)
        out["ours"].append(float(norm))
        out["theirs"].append(float(their_norm))
        out["exact"].append(exact)
        out["flags"].append((flags(ours, ours_opt), their_flags))
        for scaler, opt in ((ours, ours_opt), (theirs, theirs_opt)):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        out["stepped"].append(ours.stepped(ours_opt))
        for name, (_, opt, scaler) in fused.items():
            out[name].append(fused_step(name == "fold", opt, scaler))
    out["leaves"] = [[str(leaf) for leaf in r.leaves] for r in reports]
    out["params"] = [
        (full(a).detach().clone(), full(b).detach().clone())
        for a, b in zip(ours_net.parameters(), theirs_net.parameters(), strict=True)
    ]
    out["scales"] = (ours.get_scale(), theirs.get_scale())
    out["fused_params"] = [
        (full(a).detach().clone(), full(b).detach().clone())
        for a, b in zip(fused["fold"][0].parameters(), fused["recipe"][0].parameters(), strict=True)
    ]
    functional_api(mesh, int(rank), out)
    torch.save(out, out_file)
    _ranks.leave()


if __name__ == "__main__":
    _ranks.run(main)
