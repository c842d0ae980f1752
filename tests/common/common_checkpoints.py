"""Checkpoints as older versions of scaler-core wrote them, for the tests that load them."""

from __future__ import annotations

import copy
from typing import Any


def version_1(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` (what ``scaler_core.to_dict`` writes) as scaler-core wrote it before
    spike skipping (schema version 1): a copy without the spike fields."""
    old = copy.deepcopy(payload)
    old["version"] = 1
    for key in ("spike_threshold", "spike_window"):
        del old["config"][key]
    for key in ("norm_mean", "norm_var", "norm_count", "last_kind"):
        del old["state"][key]
    return old
