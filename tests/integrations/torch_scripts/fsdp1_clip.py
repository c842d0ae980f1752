"""One rank of a two-rank FSDP1 run that clips by the norm over the group, with
scaler-core's ShardedGradScaler or with PyTorch's and FSDP's own clip.

Usage: ``fsdp1_clip.py RANK WORLD INIT_FILE OUT_FILE MODE``

``ours``: ``scaler.unscale_and_clip_(opt, MAX_NORM)`` then ``scaler.step(opt)``;
``torch``: PyTorch's ShardedGradScaler, ``scaler.unscale_(opt)``, FSDP's
``clip_grad_norm_(MAX_NORM)`` and ``scaler.step(opt)`` (float16 low-precision
gradients, SGD, both). ``ours-fold``: a fused Adam (float32 gradients) stepped by
``scaler.clip_and_step(opt, MAX_NORM)``, with FSDP's norm of the same gradients taken
first (its ``clip_grad_norm_`` with a limit no norm reaches multiplies them by 1).
``ours-replicated``: a parameter every rank holds whole beside the FSDP module: the
clip is refused on both ranks before anything changes.

The ranks see different batches, so their shards' norms differ; at the chosen steps
an inf lands in rank 1's shard. The rank writes its norms, scales, skip decisions,
parameters (its shard) and FSDP's norms to ``OUT_FILE`` (``torch.save``).
"""

from __future__ import annotations

import sys

import _ranks
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

STEPS = 12
INF_STEPS = {4, 9}
MAX_NORM = 0.25


def refusal(scaler: object, opt: object, params: list[torch.Tensor]) -> dict[str, object]:
    """The clip's refusal with a replicated parameter, and whether it changed nothing."""
    params[-1].grad = torch.full((3,), 2.0)
    before = [p.grad.clone() for p in params]
    out: dict[str, object] = {}
    try:
        scaler.unscale_and_clip_(opt, MAX_NORM)
    except ValueError as exc:
        out["refused"] = str(exc)
    out["untouched"] = all(torch.equal(b, p.grad) for b, p in zip(before, params, strict=True))
    return out


def main() -> None:
    rank, world, init_file, out_file, mode = sys.argv[1:6]
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=int(rank), world_size=int(world)
    )
    fold = mode == "ours-fold"
    if mode.startswith("ours"):
        from scaler_core.torch import ShardedGradScaler
    else:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    half = MixedPrecision(
        param_dtype=torch.float16,
        reduce_dtype=torch.float16,
        buffer_dtype=torch.float16,
        keep_low_precision_grads=not fold,
    )
    fsdp = FullyShardedDataParallel(model, device_id=torch.device("cpu"), mixed_precision=half)
    params = list(fsdp.parameters())
    if mode == "ours-replicated":
        params.append(torch.nn.Parameter(torch.ones(3)))
    opt = (
        torch.optim.Adam(params, lr=0.05, fused=True) if fold else torch.optim.SGD(params, lr=0.05)
    )
    scaler = ShardedGradScaler("cpu", 2.0**8, 0.5, 2.0, 3)
    gen = torch.Generator().manual_seed(1 + int(rank))
    out: dict[str, list] = {"norms": [], "fsdp": [], "scales": [], "stepped": []}
    for step in range(STEPS):
        opt.zero_grad()
        loss = fsdp(torch.randn(8, 6, generator=gen) * 4).pow(2).mean()
        scaler.scale(loss).backward()
        if mode == "ours-replicated":
            out.update(refusal(scaler, opt, params))
            break
        if step in INF_STEPS and rank == "1":
            grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
            grads[0].view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in params]
        if mode == "ours":
            norm = scaler.unscale_and_clip_(opt, MAX_NORM)
            scaler.step(opt)
        elif fold:
            # FSDP's norm of the scaled gradients, divided by the scale (a power of two):
            # the limit is never reached, so its clip multiplies them by 1.
            theirs = fsdp.clip_grad_norm_(1e30)
            out["fsdp"].append(float(theirs) / scaler.get_scale())
            norm = scaler.clip_and_step(opt, MAX_NORM)
        else:
            scaler.unscale_(opt)
            norm = fsdp.clip_grad_norm_(MAX_NORM)
            scaler.step(opt)
        out["norms"].append(float(norm))
        out["stepped"].append(
            any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))
        )
        scaler.update()
        out["scales"].append(scaler.get_scale())
    out["params"] = [p.detach().clone() for p in params]
    torch.save(out, out_file)
    _ranks.leave()


if __name__ == "__main__":
    _ranks.run(main)
