"""Hypothesis strategies and invariant checks for property-testing scale policies.

Needs the ``test`` extra (hypothesis). Use these in your own test files to
property-test configurations or your own policies::

    from hypothesis import given
    from scaler_core.testing import configs, flag_sequences, check_invariants

    @given(configs(), flag_sequences())
    def test_my_policy(config, flags): ...
"""

from __future__ import annotations

import math
from typing import Any

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - exercised only without hypothesis
    raise ImportError(
        "scaler_core.testing needs hypothesis: pip install 'scaler-core[test]'"
    ) from exc

from ._config import ScalerConfig
from ._f32 import FLT_MAX, FLT_MIN, f32
from ._state import ScalerState

__all__ = ["check_invariants", "configs", "flag_sequences", "scales"]

#: Factors every backend multiplies exactly (float32 values).
_GROWTH = [1.5, 2.0, 3.0, 4.0, 1.0009765625, 65536.0]
_BACKOFF = [0.5, 0.25, 0.75, 0.125, 0.9990234375, 2.0**-20]


def scales(min_value: float = FLT_MIN, max_value: float = FLT_MAX) -> st.SearchStrategy[float]:
    """Positive, normal float32 scales in ``[min_value, max_value]``."""
    return st.floats(
        min_value=min_value, max_value=max_value, width=32, allow_subnormal=False
    ).filter(lambda x: x >= FLT_MIN)


@st.composite
def configs(
    draw: st.DrawFn,
    *,
    torch_compatible: bool = False,
    max_growth_interval: int = 20,
) -> ScalerConfig:
    """Valid :class:`ScalerConfig` values, knobs included.

    Args:
        torch_compatible: Only configs within PyTorch's semantics (no floor,
            ceiling, hysteresis, skip limit; dynamic).
        max_growth_interval: Keep intervals small so growth happens in tests.
    """
    init_scale = draw(st.one_of(st.sampled_from([1.0, 2.0**16, 2.0**-120, 2.0**120]), scales()))
    kwargs: dict[str, Any] = {
        "init_scale": init_scale,
        "growth_factor": draw(st.sampled_from(_GROWTH)),
        "backoff_factor": draw(st.sampled_from(_BACKOFF)),
        "growth_interval": draw(st.integers(1, max_growth_interval)),
    }
    if torch_compatible:
        return ScalerConfig(**kwargs)
    if draw(st.booleans()):
        kwargs["min_scale"] = draw(scales(max_value=init_scale))
        kwargs["at_min_scale"] = draw(st.sampled_from(["hold", "raise"]))
    if draw(st.booleans()):
        kwargs["max_scale"] = draw(scales(min_value=init_scale))
    kwargs["hysteresis"] = draw(st.integers(1, 4))
    kwargs["at_max_scale"] = draw(st.sampled_from(["block", "clamp"]))
    kwargs["hysteresis_refill"] = draw(
        st.sampled_from(["on_growth", "on_clean_step", "on_clean_step_or_backoff"])
    )
    if draw(st.booleans()):
        kwargs["max_consecutive_skips"] = draw(st.integers(0, 30))
    kwargs["dynamic"] = draw(st.booleans()) or draw(st.booleans())
    return ScalerConfig(**kwargs)


def flag_sequences(
    min_size: int = 0, max_size: int = 200, *, p_non_finite: float | None = None
) -> st.SearchStrategy[list[bool]]:
    """Lists of per-step found-non-finite flags.

    Mixes uniform sequences with bursty ones (long clean runs, then overflow
    spikes), which is how real training behaves.
    """
    if p_non_finite is not None:
        weighted = st.floats(0, 1).map(lambda u: u < p_non_finite)
        return st.lists(weighted, min_size=min_size, max_size=max_size)
    bursts = st.lists(
        st.tuples(st.booleans(), st.integers(1, 40)), max_size=max(1, max_size // 10)
    ).map(lambda runs: [flag for flag, n in runs for _ in range(n)])
    return st.one_of(
        st.lists(st.booleans(), min_size=min_size, max_size=max_size),
        bursts.filter(lambda xs: min_size <= len(xs) <= max_size),
    )


def check_invariants(state: ScalerState) -> None:
    """Raise ``AssertionError`` naming the broken invariant of a host state.

    Checks: the scale is a positive, finite, normal float32 within the bounds;
    the trackers are in range; the counters add up.
    """
    cfg = state.config
    s = state.scale

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise AssertionError(f"invariant broken: {what} (state={state!r})")

    need(int(state.failure) == 0, "failure == 0 on a host state")
    need(math.isfinite(s) and FLT_MIN <= s <= FLT_MAX, "scale is a finite, normal float32")
    need(f32(s) == s, "scale is exactly a float32 value")
    need(cfg.min_scale is None or s >= cfg.min_scale, "scale >= min_scale")
    need(cfg.max_scale is None or s <= cfg.max_scale, "scale <= max_scale")
    need(cfg.dynamic or s == cfg.init_scale, "a static scale never changes")
    need(0 <= state.growth_tracker < cfg.growth_interval, "0 <= growth_tracker < growth_interval")
    need(1 <= state.hysteresis_tracker <= cfg.hysteresis, "1 <= hysteresis_tracker <= hysteresis")
    need(
        0 <= state.consecutive_skips <= state.skipped_steps <= state.steps,
        "0 <= consecutive_skips <= skipped_steps <= steps",
    )
    limit = cfg.max_consecutive_skips
    need(limit is None or state.consecutive_skips <= limit, "consecutive_skips <= limit")
