"""PyTorch helpers of the drop-in's tests: one training step of a scaler, and two
optimizers' states compared tensor by tensor.

Imports torch: import this module after ``pytest.importorskip("torch")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def one_step(
    scaler: Any, grad: float, before_update: Callable[[Any], object] | None = None
) -> None:
    """One iteration of ``scaler`` on a fresh parameter whose gradient is ``grad`` (inf: an
    overflow), calling ``before_update(scaler)`` between ``step`` and ``update`` if given."""
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale(param.sum()).backward()
    param.grad = torch.full((2,), grad)
    scaler.step(opt)
    if before_update is not None:
        before_update(scaler)
    scaler.update()


def assert_same_optimizer_state(ours: dict[Any, Any], theirs: dict[Any, Any]) -> None:
    """Two ``optimizer.state_dict()["state"]`` hold the same state: the same parameters,
    the same entries, equal tensors (a number compared as a 0-d tensor)."""
    assert ours.keys() == theirs.keys()
    for key, state in ours.items():
        assert state.keys() == theirs[key].keys()
        for name, value in state.items():
            want = theirs[key][name]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(want)), (key, name)
