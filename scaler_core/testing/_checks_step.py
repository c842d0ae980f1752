"""The checks of a step's decision: the flags (``any``, ``to_bool``), ``select`` between
the skipped and the taken step's trees, and ``update``, the transition, run against the
host rule at every edge.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._config import ScalerConfig
from .._errors import GradientTypeError, InvalidArgumentError, ScaleCollapseError
from .._f32 import FLT_MIN
from .._state import DATA_FIELDS, FLOAT_FIELDS, ScalerState, host_update, init
from ._harness import Check
from ._rules import same_bits

__all__ = ["check_flags", "check_select", "check_update"]

_BAD_FLAGS = (1, 0.0, None, "yes", np.array([True]))


def check_select(c: Check) -> None:
    """The chosen tree's values leaf by leaf; mismatched trees raise InvalidArgumentError."""
    old_h: dict[str, Any] = {
        "w": np.array([1.0, -0.0, 3.0], np.float32),
        "b": [np.array(2.0, c.subject.dtypes[0])],
    }
    new_h: dict[str, Any] = {
        "w": np.array([4.0, 5.0, 6.0], np.float32),
        "b": [np.array(7.0, c.subject.dtypes[0])],
    }

    def tree(h: Mapping[str, Any]) -> dict[str, Any]:
        return {"w": c.array(h["w"]), "b": [c.array(h["b"][0])], "n": None}

    dirty = c.find_non_finite([c.array(np.array([np.inf], np.float32))])
    clean = c.find_non_finite([c.array(np.ones(1, np.float32))])
    for flag, skip in ((dirty, True), (clean, False), (True, True), (False, False)):
        old_tree, new_tree = tree(old_h), tree(new_h)
        c.now(f"select(<a {'true' if skip else 'false'} flag>, on_skip, on_step)")
        out = c.backend.select(flag, old_tree, new_tree)
        want = old_h if skip else new_h
        if out["n"] is not None or not same_bits(c.host(out["w"]), want["w"]):
            raise c.fail(f"select with a {'true' if skip else 'false'} flag chose wrongly")
        if not same_bits(c.host(out["b"][0]), want["b"][0]):
            raise c.fail(f"select changed a {c.subject.dtypes[0]} leaf")
    old = tree(old_h)
    others = [d for d in c.subject.dtypes if d != np.dtype(np.float32)]
    other_dtype = others[-1] if others else np.dtype(np.int32)
    mismatched = {
        "a missing key": {"w": old["w"], "b": old["b"]},
        "a longer list": {**old, "b": [*old["b"], old["b"][0]]},
        "a leaf for None": {**old, "n": old["w"]},
        "another dtype": {**old, "w": c.array(new_h["w"].astype(other_dtype))},
        "another shape": {**old, "w": c.array(np.ones(4, np.float32))},
    }
    for what, other in mismatched.items():
        c.raises(
            InvalidArgumentError,
            functools.partial(c.backend.select, dirty, old, other),
            f"select of trees with {what}",
        )
    c.raises(GradientTypeError, lambda: c.backend.select(1, old, tree(new_h)), "select(1, ...)")


def check_flags(c: Check) -> None:
    """``any`` ORs flags (none: false), ``to_bool`` reads them; others: GradientTypeError."""
    backend = c.backend
    dirty = c.find_non_finite([c.array(np.array([np.nan], np.float32))])
    clean = c.find_non_finite([c.array(np.ones(1, np.float32))])
    c.now("any() of flags")
    cases = {
        "any()": (backend.any(), False),
        "any(clean, dirty)": (backend.any(clean, dirty), True),
        "any(clean, clean)": (backend.any(clean, clean), False),
        "any(True, clean)": (backend.any(True, clean), True),
        "np.bool_(False)": (np.bool_(False), False),
        "True": (True, True),
    }
    for what, (flag, want) in cases.items():
        if c.flag(flag, what) is not want:
            raise c.fail(f"{what} read as {not want}")
    for bad in _BAD_FLAGS:
        c.raises(GradientTypeError, functools.partial(backend.to_bool, bad), f"to_bool({bad!r})")
        c.raises(GradientTypeError, functools.partial(backend.any, clean, bad), f"any(.., {bad!r})")


#: The update check's runs: configs and flag sequences reaching each edge of the rule
#: (growth past float32's largest value, the ceiling, the floor, hysteresis), compared
#: step by step with the host rule; a device state is carried from step to step.
_UPDATE_RUNS: tuple[tuple[dict[str, Any], tuple[bool, ...]], ...] = (
    ({"growth_interval": 1, "hysteresis": 2}, (True, False, True, True, False)),
    ({"init_scale": 2.0**127, "growth_interval": 1}, (False, False, True, False)),
    ({"init_scale": 2.0**126, "growth_interval": 1, "at_max_scale": "clamp"}, (False,) * 3),
    ({"init_scale": 2.0**20, "max_scale": 2.0**21, "growth_interval": 1}, (False, False, True)),
    ({"init_scale": 8.0, "min_scale": 2.0, "growth_interval": 2}, (True,) * 3 + (False,) * 2),
)


def _same_value(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def check_update(c: Check) -> None:
    """Runs of transitions equal to the host rule step by step, at every edge (growth
    past float32's largest value held or clamped, the ceiling, the floor, hysteresis),
    with device or host flags; a refused step raises or is recorded."""
    backend = c.backend
    dirty = c.find_non_finite([c.array(np.array([np.inf], np.float32))])
    clean = c.find_non_finite([c.array(np.ones(1, np.float32))])
    state = init(ScalerConfig(growth_interval=1, hysteresis=2))
    for flag, found in ((dirty, True), (clean, False), (True, True), (False, False)):
        c.now(f"update(state, <a {'device' if flag is not found else 'host'} flag>)")
        got = backend.update(state, flag)
        if not isinstance(got, ScalerState) or got.to_host() != host_update(state, found):
            raise c.fail(f"update with found={found} gave {got!r}")
    for kwargs, founds in _UPDATE_RUNS:
        config = "ScalerConfig(" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"
        host = device = init(ScalerConfig(**kwargs))
        for step, found in enumerate(founds, 1):
            want = host_update(host, found)
            call = f"update(state, found={found}) at step {step} of {config}"
            c.now(call)
            device = backend.update(device, dirty if found else clean)
            if not isinstance(device, ScalerState):
                raise c.fail(f"{call} returned {device!r}, not a ScalerState")
            fields = {
                n: (float if n in FLOAT_FIELDS else int)(getattr(device, n)) for n in DATA_FIELDS
            }
            wrong = [n for n in DATA_FIELDS if not _same_value(fields[n], getattr(want, n))]
            if wrong:
                raise c.fail(
                    f"{call} gave "
                    + ", ".join(f"{n}={fields[n]!r}" for n in wrong)
                    + ", but the host rule gives "
                    + ", ".join(f"{n}={getattr(want, n)!r}" for n in wrong)
                )
            host = want
    c.now("update(state, <a device flag>) of a collapsing state")
    try:
        failed = backend.update(init(ScalerConfig(init_scale=FLT_MIN)), dirty)
    except ScaleCollapseError:
        pass
    else:
        c.raises(
            ScaleCollapseError, failed.check, "check() after a collapse neither raised nor recorded"
        )
    c.raises(
        InvalidArgumentError,
        lambda: backend.update("not a state", clean),  # type: ignore[arg-type]
        "update of a str",
    )
    c.raises(GradientTypeError, lambda: backend.update(state, 1), "update(state, 1)")
