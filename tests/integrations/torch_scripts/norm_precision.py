"""How far the global gradient norm is from the exact one: PyTorch's clip against scaler-core's.

Usage: ``python tests/integrations/torch_scripts/norm_precision.py [SEEDS]``

A 19M-parameter transformer encoder (6 layers, d_model 512, feed-forward 2048)
takes one backward pass per seed; its float32 gradients, and the same rounded to
bfloat16, are measured three ways:

* exact: the squares in float64 (exact for float32 and bfloat16 values) summed with
  ``math.fsum`` (correctly rounded), then the square root, rounded to float32;
* PyTorch: ``torch.nn.utils.clip_grad_norm_``'s total norm (``_foreach_norm`` per
  tensor in the gradients' dtype, then the norm of those norms, in that dtype);
* scaler-core: ``scaler_core.unscale_and_norm`` (squares summed in float64, rounded
  once to float32).

Prints each distance from the exact norm in float32 ulps (of the exact norm) and
relative, one line per (dtype, seed).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

import scaler_core as sc


def exact_norm(grads: list[torch.Tensor]) -> float:
    parts = [math.fsum(np.square(g.double().numpy().ravel())) for g in grads]
    return math.sqrt(math.fsum(parts))


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.set_num_threads(1)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"{sum(p.numel() for p in params) / 1e6:.1f}M parameters in {len(params)} tensors")
    print("dtype     seed  exact norm       PyTorch (ulps, rel)          scaler-core (ulps, rel)")
    for seed in range(seeds):
        torch.manual_seed(seed)
        model.zero_grad()
        model(torch.randn(4, 64, 512)).square().mean().backward()
        for dtype in (torch.float32, torch.bfloat16):
            grads = [p.grad.detach().to(dtype) for p in params if p.grad is not None]
            exact = exact_norm([g.float() for g in grads])
            ulp = float(np.spacing(np.float32(exact)))
            holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for h, g in zip(holders, grads, strict=True):
                h.grad = g.clone()
            theirs = float(torch.nn.utils.clip_grad_norm_(holders, math.inf))
            _, _, norm = sc.unscale_and_norm([g.clone() for g in grads], 1.0)
            ours = float(norm)
            print(
                f"{str(dtype)[6:]:9} {seed:4}  {exact:.9e}  "
                f"{(theirs - exact) / ulp:+9.1f} {(theirs - exact) / exact:+.1e}     "
                f"{(ours - exact) / ulp:+9.2f} {(ours - exact) / exact:+.1e}"
            )


if __name__ == "__main__":
    main()
