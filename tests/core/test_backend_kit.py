"""scaler_core.backend_kit: the core's helpers for a backend author, held to the contract."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core import backend_kit as kit
from scaler_core.testing import check_backend


def test_float_leaves_checks_every_leaf_before_any_and_keeps_each_array_once() -> None:
    xp = sc.get_backend("numpy").namespace()
    w = np.ones(2, np.float32)
    assert kit.float_leaves({"w": w, "tied": [w, None]}, xp) == [w]
    with pytest.raises(sc.GradientTypeError, match=r"grads\['b'\]\[0\] is .*int32.*float16, bfl"):
        kit.float_leaves({"w": w, "b": [np.ones(2, np.int32)]}, xp)
    with pytest.raises(sc.GradientTypeError, match=r"grads\['s'\] is 'x'"):
        kit.float_leaves({"s": "x"}, xp)


def test_device_namespace_refuses_dtypes_it_lacks_naming_them() -> None:
    with pytest.raises(sc.InvalidArgumentError, match=r"lacks \['bool', 'int32'\]"):
        kit.DeviceNamespace(
            np, np.ndarray, full=np.full, floats=(), dtypes={"float32": 1, "float64": 2}
        )


def test_a_device_namespace_from_torchs_own_functions_keeps_the_contract() -> None:
    """The torch backend's passes with a namespace made by the kit from torch's full,
    where and dtypes alone: the namespace duties, select, the flags and the transition."""
    torch = pytest.importorskip("torch")
    xp = kit.DeviceNamespace(
        torch,
        torch.Tensor,
        full=lambda value, dtype: torch.full((), value, dtype=dtype),
        floats=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    )
    inner = sc.get_backend("torch")

    class KitNamespaced(sc.Backend):
        name = "torch"
        plan, unscale, measure = inner.plan, inner.unscale, inner.measure
        clip, scale_loss = inner.clip, inner.scale_loss

        def namespace(self, *values: Any) -> Any:
            return xp

    checks = ["namespace", "select", "flags", "update", "norm_and_clip"]
    assert check_backend(KitNamespaced(), only=checks) == checks
    assert xp.isdtype(torch.bool, "bool")
    assert not xp.isdtype(torch.float32, "bool")
    assert xp.float32(0.1).dtype == torch.float32
    assert xp.where(xp.flag(True), 5, torch.tensor(7, dtype=torch.int32)).item() == 5
