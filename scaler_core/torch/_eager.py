"""Running the drop-in's methods eagerly inside ``torch.compile``, as PyTorch's own run."""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

import torch

__all__ = ["eager_under_compile"]

_T = TypeVar("_T")


def eager_under_compile(cls: type[_T]) -> type[_T]:
    """Run the methods of ``cls`` eagerly inside ``torch.compile``, as PyTorch's own do.

    Dynamo never traces ``torch.amp.GradScaler``: ``torch/`` is one of its skipped
    directories (``torch._dynamo.trace_rules``), so a compiled step breaks the graph at
    each of its calls and runs it as plain Python. A third-party class is traced
    instead, and tracing this one went wrong: a host read (``.item()``) broke the
    graph where PyTorch's does not, and state kept on ``self`` between calls (the
    per-optimizer record ``unscale_and_clip_`` leaves for ``step``) was lost, so a
    compiled step unscaled clipped gradients twice. Making the scaler traceable would
    fight Dynamo over every host read and dict of state for no gain, since PyTorch's
    class is not in the graph either; so every method that user code or PyTorch's
    own (skipped) code calls, that is every public one and every override of
    PyTorch's, is wrapped in ``torch.compiler.disable``: the graph breaks at the call
    as it does for PyTorch's class, and the call, with everything it calls (the
    optimizer's ``step``, an ``on_step`` callback), runs eagerly. Helpers only these
    methods call need no wrapper. ``torch.compiler.disable`` imports
    ``torch._dynamo``, which ``torch.optim`` imports anyway.
    """

    def eager(fn: Any) -> Any:
        return torch.compiler.disable(fn)  # type: ignore[no-untyped-call, unused-ignore]

    for name, value in list(vars(cls).items()):
        if name.startswith("_") and not hasattr(torch.amp.GradScaler, name):
            continue  # a helper of this class: only reached from the wrapped methods
        if isinstance(value, property):
            wrapped: Any = property(eager(value.fget), value.fset, value.fdel, value.__doc__)
        elif isinstance(value, staticmethod):
            wrapped = staticmethod(eager(value.__func__))
        elif inspect.isfunction(value):
            wrapped = eager(value)
        else:
            continue
        setattr(cls, name, wrapped)
    return cls
