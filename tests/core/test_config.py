"""ScalerConfig fails closed at construction: every field validated, named in the error."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from hypothesis import given

import scaler_core as sc
from scaler_core.testing import configs

INVALID = [
    ("init_scale", 0.0),
    ("init_scale", -1.0),
    ("init_scale", float("nan")),
    ("init_scale", float("inf")),
    ("init_scale", 1e-39),  # float32 subnormal
    ("init_scale", 3.5e38),  # above float32 max
    ("init_scale", "65536"),
    ("init_scale", True),
    ("init_scale", None),
    ("init_scale", 10**400),
    ("growth_factor", 1.0),
    ("growth_factor", 0.5),
    ("growth_factor", float("inf")),
    ("growth_factor", float("nan")),
    ("backoff_factor", 0.0),
    ("backoff_factor", 1.0),
    ("backoff_factor", -0.5),
    ("growth_interval", 0),
    ("growth_interval", -3),
    ("growth_interval", 2.0),
    ("growth_interval", True),
    ("growth_interval", 2**31),
    ("min_scale", 0.0),
    ("min_scale", 2.0**17),  # above init_scale
    ("max_scale", 2.0**15),  # below init_scale
    ("max_scale", float("inf")),
    ("at_min_scale", "raise"),  # needs min_scale
    ("at_min_scale", "clamp"),
    ("hysteresis", 0),
    ("hysteresis", 1.5),
    ("hysteresis_refill", "sometimes"),
    ("max_consecutive_skips", -1),
    ("max_consecutive_skips", False),
    ("dynamic", 1),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=lambda v: repr(v)[:24])
def test_invalid_field_names_field_and_value(field: str, value: Any) -> None:
    with pytest.raises(sc.InvalidConfigError) as info:
        sc.ScalerConfig(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}=")
    assert "but it must be" in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(sc.InvalidConfigError):
        dataclasses.replace(sc.ScalerConfig(), **{field: value})


@pytest.mark.parametrize(("growth", "backoff"), [(1.1, 0.9), (3.0, 0.1), (2.0, 1 / 3)])
def test_a_factor_float32_cannot_hold_is_applied_as_pytorch_applies_it(
    growth: float, backoff: float
) -> None:
    """PyTorch multiplies the float32 scale by a float64 factor and rounds once: the host
    rule and the device rule (float64 products here) give exactly that."""
    cfg = sc.ScalerConfig(
        init_scale=3.0, growth_factor=growth, backoff_factor=backoff, growth_interval=1
    )
    assert (cfg.growth_factor, cfg.backoff_factor) == (growth, backoff)  # kept, not rounded
    host, dev = sc.init(cfg), sc.init(cfg)
    expect = np.float32(3.0)
    for found in (False, True, True, False):
        factor = backoff if found else growth
        expect = np.float32(np.float64(expect) * factor)
        host = sc.update(host, found)
        dev = sc.device_update(np, dev, np.bool_(found))
        assert host.scale == float(expect)
        assert dev.to_host() == host


def test_config_is_frozen() -> None:
    cfg = sc.ScalerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.init_scale = 1.0  # type: ignore[misc]


def test_a_scale_is_exactly_a_float32_or_refused() -> None:
    """As for the factors: no silent rounding; the error gives the float32 to use."""
    with pytest.raises(sc.InvalidConfigError, match=r"init_scale=0\.1, .*use 0\.10000000149011612"):
        sc.ScalerConfig(init_scale=0.1)
    assert sc.ScalerConfig(init_scale=0.10000000149011612).init_scale == 0.10000000149011612


@given(configs())
def test_repr_is_valid_python_and_round_trips(cfg: sc.ScalerConfig) -> None:
    assert eval(repr(cfg), {"ScalerConfig": sc.ScalerConfig}) == cfg
    assert sc.ScalerConfig(**cfg.to_dict()) == cfg
    state = sc.init(cfg)
    namespace = {"ScalerConfig": sc.ScalerConfig, "ScalerState": sc.ScalerState}
    assert eval(repr(state), namespace) == state


def test_python_O_keeps_validation(tmp_path: Any) -> None:
    import subprocess
    import sys

    code = (
        "import scaler_core as sc\n"
        "try:\n sc.ScalerConfig(growth_interval=0)\n"
        "except ValueError:\n print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert out.stdout.strip() == "ok", out.stderr
