"""accelerate 1.16 on the CPU as it runs on a GPU: its float16 scaler, and FSDP.

On the CPU accelerate trains ``mixed_precision="fp16"`` in float32, with neither
autocast nor a scaler (``Accelerator.__init__`` builds its scaler only when
``self.device.type != "cpu"``), and drops an ``fsdp_plugin`` for DDP
(``AcceleratorState.__init__`` turns FSDP on in its ``MULTI_GPU, ...`` branch only,
never for ``MULTI_CPU``). :func:`as_on_a_gpu` makes, on a CPU ``Accelerator``, the
assignments those two branches make on a GPU, with accelerate's own scaler builders
and the device "cpu" where they would take "cuda"; ``prepare``, ``backward``,
``clip_grad_norm_`` and the optimizer's ``step`` are then accelerate's code as it runs.
The test loads this file by path; ``accelerate_fsdp.py`` imports it.
"""

from __future__ import annotations

from typing import Any

import torch


def as_on_a_gpu(accelerator: Any, fsdp_plugin: Any = None) -> None:
    """Turn on ``accelerator``'s float16 scaler and autocast (and FSDP) as on a GPU."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, get_grad_scaler
    from accelerate.utils.fsdp_utils import get_fsdp2_grad_scaler

    state = accelerator.state
    if fsdp_plugin is not None:  # state.py, AcceleratorState.__init__, the MULTI_GPU branch
        state.distributed_type = DistributedType.FSDP
        fsdp_plugin.set_mixed_precision(state._mixed_precision)
        state.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = state.distributed_type
        if fsdp_plugin.fsdp_version == 1:
            # A GPU is "cuda:N"; accelerate's CPU is "cpu:0", which FSDP1 refuses as its
            # device_id ("Inconsistent compute device and `device_id` on rank 0: cpu vs
            # cpu:0"): it computes on "cpu".
            state.device = PartialState._shared_state["device"] = torch.device("cpu")
    # accelerator.py, Accelerator.__init__, the fp16 branch
    handler = accelerator.scaler_handler
    kwargs = handler.to_kwargs() if handler is not None else {}
    accelerator.native_amp = True
    if accelerator.is_fsdp2:
        accelerator.scaler = get_fsdp2_grad_scaler(device="cpu", **kwargs)
    elif accelerator.distributed_type == DistributedType.FSDP:  # ShardedGradScaler("cuda", ...)
        accelerator.scaler = get_grad_scaler(accelerator.distributed_type, device="cpu", **kwargs)
    else:
        accelerator.scaler = get_grad_scaler(accelerator.distributed_type, **kwargs)
