"""PyTorch integration: ``GradScaler``, a drop-in for ``torch.amp.GradScaler``.

Change one import and nothing else: ``from scaler_core.torch import GradScaler``.
It *is* a ``torch.amp.GradScaler`` (a subclass: frameworks that type-check it
accept it), takes the same arguments, has the same methods and attributes, and
trains bit-identically to it with PyTorch's defaults. On top:

* any :class:`~scaler_core.ScalerConfig` or preset, ``GradScaler(config=sc.preset("megatron"))``:
  floors, ceilings, hysteresis, skip limits;
* fail-closed: a backoff that would leave the scale 0 or subnormal raises
  :class:`~scaler_core.ScaleCollapseError` (on an accelerator, it is recorded and
  raised by the next ``get_scale()``, ``state`` or ``state_dict()``, and every step
  is skipped until a checkpoint is loaded), where PyTorch's scale goes silently
  subnormal;
* the overflow an unscale itself makes (a scale below 1) is found, which PyTorch's
  kernel does not check;
* ``scaler.state``: the immutable state with its skip accounting; ``stepped(optimizer)``:
  whether the last ``step`` ran the optimizer (for LR schedulers and EMA);
* ``state_dict()`` carries the whole versioned scaler-core state under one extra
  key that PyTorch ignores; a dict PyTorch saved loads too;
* ``process_group=``: the found flag is OR-ed over ``torch.distributed`` ranks, so
  every rank skips together where ranks check different gradients (ZeRO-style
  shards each rank checks alone; FSDP2's DTensor gradients need no group);
* ``ShardedGradScaler``: the same for FSDP1, with PyTorch's ``ShardedGradScaler``'s
  arguments.

Under ``torch.compile`` its methods run eagerly, as PyTorch's do. Importing this
module imports torch and ``torch._dynamo`` (``import scaler_core`` never does).

How the package is laid out: ``_scaler`` is the class (PyTorch's call order and
hooks), ``_held`` the state it keeps over its two routes, ``_plan`` an optimizer's
gradients planned once per step set, ``_groups`` process groups, ``_args`` the
argument checks, ``_sharded`` the FSDP1 class.
"""

# A scaler pickled before the package was split names its default group here.
from ._groups import DEFAULT_GROUP as _DEFAULT_GROUP  # noqa: F401
from ._scaler import STATE_KEY, GradScaler
from ._sharded import ShardedGradScaler

# Pickles name a class by module: the classes' public home is this package.
GradScaler.__module__ = ShardedGradScaler.__module__ = __name__

__all__ = ["STATE_KEY", "GradScaler", "ShardedGradScaler"]
