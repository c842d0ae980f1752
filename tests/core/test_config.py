"""ScalerConfig fails closed at construction: every field validated, named in the error."""

from __future__ import annotations

import dataclasses
from typing import Any

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
    ("growth_factor", 1.1),  # not a float32 value
    ("backoff_factor", 0.0),
    ("backoff_factor", 1.0),
    ("backoff_factor", -0.5),
    ("backoff_factor", 0.1),  # not a float32 value
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


def test_factor_message_gives_the_float32_fix() -> None:
    with pytest.raises(sc.InvalidConfigError, match=r"use 0\.100000001"):
        sc.ScalerConfig(backoff_factor=0.1)


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
