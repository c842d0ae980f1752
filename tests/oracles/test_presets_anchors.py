"""Every preset against the real library it reproduces, step by step.

The library's own class runs in a worker interpreter (``anchor_worker.py``, started by
``conftest.py``) and ``preset(...)`` runs here, on the same seeded overflow sequences:
bursty random ones, small windows, every hysteresis, scales at both ends of float32,
the library's defaults over thousands of steps, and the examples of the library's own
unit tests. After every step the scale must be equal bit for bit (the library's float32
or float64 value, as a Python float), and the skip decision equal to the library's own
where its API makes one (PyTorch's and Paddle's optimizer step, the operator's zeroed
gradients, flax's ``is_fin``, jmp's ``all_finite``, Keras's inner step).

The one place a preset may part from its library is where that library leaves the
normal float32 range, and there only in the ways its ``PRESETS[...].differences``
states (see ``_ALLOWED``): a growth past the largest float32 that we block, a backoff
to 0 or a subnormal that we refuse, DeepSpeed's exception at its floor that we raise
as ``ScaleCollapseError``. The comparison ends at that step (the library's state is
then one scaler-core cannot hold). The hypothesis variants draw the configs too.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import scaler_core as sc
from scaler_core._f32 import FLT_MAX, FLT_MIN, f32
from scaler_core.testing import flag_sequences, scales

Params = dict[str, Any]
Case = tuple[Params, list[bool]]

# ------------------------------------------------------------------ the anchors
#: Anchor key -> the preset (and extra preset arguments) reproducing it.
PRESET = {
    "torch": ("torch", {}),
    "deepspeed": ("deepspeed", {}),
    "deepspeed@0.17.0": ("deepspeed", {"version": "0.17.0"}),
    "megatron": ("megatron", {}),
    "paddle": ("paddle", {}),
    "paddle_static": ("paddle_static", {}),
    "jmp": ("jmp", {}),
    "flax": ("flax", {}),
    "keras": ("keras", {}),
}

#: The ways a preset may part from its library, as its PRESETS[...].differences states:
#: "growth" (the library grows past the largest float32, we block), "collapse" (it backs
#: off to 0 or a subnormal, we refuse), "floor" (DeepSpeed raises at its floor, so do we).
_ALLOWED = {
    "torch": {"collapse"},
    "deepspeed": {"growth", "floor"},
    "deepspeed@0.17.0": {"growth", "floor"},
    "megatron": {"growth"},
    "paddle": {"growth", "collapse"},
    "paddle_static": set(),
    "jmp": set(),
    "flax": {"collapse"},
    "keras": {"growth", "collapse"},
}
#: The words of each kind in a preset's stated differences.
_STATED = {
    "growth": "past the largest float32",
    "collapse": "raises ScaleCollapseError",
    "floor": "ScaleCollapseError at the same step",
}

#: What each anchor key runs, for the summary.
AGAINST = {
    "torch": "torch.amp.GradScaler",
    "deepspeed": "DeepSpeed DynamicLossScaler",
    "deepspeed@0.17.0": "DeepSpeed DynamicLossScaler",
    "megatron": "megatron-core DynamicGradScaler",
    "paddle": "paddle.amp.GradScaler (dygraph)",
    "paddle_static": "Paddle update_loss_scaling op",
    "jmp": "jmp.DynamicLossScale",
    "flax": "flax DynamicScale",
    "keras": "Keras LossScaleOptimizer",
}

#: Each library's defaults, by its own argument names.
DEFAULTS: dict[str, Params] = {
    "torch": {
        "init_scale": 2.0**16,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 2000,
    },
    # DeepSpeed's fp16 config: initial_scale_power 16, loss_scale_window 1000,
    # hysteresis 2, consecutive_hysteresis false, min_loss_scale 1.
    "deepspeed": {
        "init_scale": 2.0**16,
        "scale_window": 1000,
        "min_scale": 1,
        "delayed_shift": 2,
        "consecutive_hysteresis": False,
        "raise_error_at_min_scale": True,
    },
    # Megatron's OptimizerConfig and get_megatron_optimizer (factors 2 and 0.5).
    "megatron": {
        "initial_scale": 2.0**32,
        "min_scale": 1.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 1000,
        "hysteresis": 2,
    },
    "paddle": {
        "init_loss_scaling": 2.0**16,
        "incr_ratio": 2.0,
        "decr_ratio": 0.5,
        "incr_every_n_steps": 2000,
        "decr_every_n_nan_or_inf": 1,
    },
    "jmp": {"loss_scale": 2.0**15, "period": 2000, "factor": 2, "min_loss_scale": 1.0},
    "flax": {
        "scale": 65536.0,
        "growth_interval": 2000,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "minimum_scale": float(f32(1.1754943508222875e-38)),
    },
    "keras": {"initial_scale": 2.0**15, "dynamic_growth_steps": 2000},
}
DEFAULTS["deepspeed@0.17.0"] = {**DEFAULTS["deepspeed"], "scale_factor": 2.0}
DEFAULTS["paddle_static"] = dict(DEFAULTS["paddle"])

#: Scales near both ends of float32, and ordinary ones; all exactly float32.
_LOW = [2.0**-126, 2.0**-124, 3.0 * 2.0**-120, 2.0**-100]
_HIGH = [2.0**127, 3.0 * 2.0**125, 2.0**126, FLT_MAX, 2.0**120]
_MID = [1.0, 2.0**15, 2.0**16, 2.0**32, f32(1000.1), f32(3.3e-7)]
_GROWTH = [2.0, 3.0, 1.5, 1.0001]
_BACKOFF = [0.5, 0.9, 0.25, 0.7, 1 / 3]


_FLAX_STATIC = [
    (1, 2.0, 0.5, None),
    (2, 3.0, 0.9, FLT_MIN),
    (3, 1.5, 0.25, None),
    (4, 1.0001, 1 / 3, FLT_MIN),
    (5, 2.0, 0.7, None),
    (6, 2.0, 0.5, FLT_MIN),
]


def _init(rng: random.Random, low: float = 0.0) -> float:
    pool = [x for x in rng.choice([_LOW, _HIGH, _MID, _MID]) if x >= low]
    return rng.choice(pool or [max(low, 1.0)])


def _floor(rng: random.Random, init: float) -> float:
    return rng.choice([x for x in [1.0, 0.25, 2.0**-20, 2.0**-126, 3.0, init] if x <= init])


def random_params(key: str, rng: random.Random) -> Params:  # noqa: PLR0911 - one per library
    """A config the library takes (and the preset too), drawn towards the edges."""
    window = rng.randint(1, 6)
    if key == "torch":
        return {
            "init_scale": _init(rng),
            "growth_factor": rng.choice(_GROWTH),
            "backoff_factor": rng.choice(_BACKOFF),
            "growth_interval": window,
        }
    if key.startswith("deepspeed"):
        init = rng.choice([2.0 ** rng.randint(-126, 127), 3.0 * 2.0 ** rng.randint(-100, 100)])
        params = {
            "init_scale": init,
            "scale_window": window,
            "min_scale": _floor(rng, init),
            "delayed_shift": rng.randint(1, 4),
            "consecutive_hysteresis": rng.random() < 0.5,
            "raise_error_at_min_scale": rng.random() < 0.5,
        }
        if key == "deepspeed@0.17.0":
            params["scale_factor"] = rng.choice([2.0, 2.0, 4.0])
        return params
    if key == "megatron":
        init = _init(rng)
        return {
            "initial_scale": init,
            "min_scale": _floor(rng, init),
            "growth_factor": rng.choice(_GROWTH),
            "backoff_factor": rng.choice(_BACKOFF),
            "growth_interval": window,
            "hysteresis": rng.randint(1, 4),
        }
    if key in ("paddle", "paddle_static"):
        return {
            "init_loss_scaling": _init(rng, low=1.0 if key == "paddle_static" else 0.0),
            "incr_ratio": rng.choice(_GROWTH),
            "decr_ratio": rng.choice(_BACKOFF),
            "incr_every_n_steps": window,
            "decr_every_n_nan_or_inf": rng.randint(1, 4),
        }
    if key == "jmp":
        init = _init(rng)
        return {
            "loss_scale": init,
            "period": window,
            "factor": rng.choice([2, 2, 4]),
            "min_loss_scale": _floor(rng, init),
        }
    if key == "flax":
        # flax's factors, interval and floor are static (each set compiles once): a few
        # sets that cover them, each from any scale.
        interval, growth, backoff, floor = rng.choice(_FLAX_STATIC)
        init = _init(rng, low=floor or 0.0)
        return {
            "scale": init,
            "growth_interval": interval,
            "growth_factor": growth,
            "backoff_factor": backoff,
            "minimum_scale": floor,
        }
    assert key == "keras"
    return {"initial_scale": _init(rng), "dynamic_growth_steps": window}


def bursty(rng: random.Random, n: int, clean: float, over: float) -> list[bool]:
    """Runs of clean steps and of overflows, of geometric lengths with these means."""
    flags: list[bool] = []
    while len(flags) < n:
        mean, value = (over, True) if flags and not flags[-1] else (clean, False)
        flags += [value] * max(1, round(rng.expovariate(1 / mean)))
    return flags[:n]


def _long_run(rng: random.Random, n: int) -> list[bool]:
    """A few thousand steps at a library's default window: long clean runs (some past
    2000 steps, so the defaults grow) broken by short overflow bursts."""
    flags: list[bool] = []
    while len(flags) < n:
        flags += [False] * rng.choice([40, 300, 1001, 1200, 2001, 2500])
        flags += [True] * rng.randint(1, 4)
    return flags[:n]


#: Examples of the libraries' own unit tests, as (params, flags, expected scales or None).
def _examples(key: str) -> list[tuple[Params, list[bool], list[float] | None]]:
    ds = {
        "min_scale": 1,
        "delayed_shift": 1,
        "consecutive_hysteresis": False,
        "raise_error_at_min_scale": False,
    }
    if key == "deepspeed":
        # deepspeedai/DeepSpeed tests/unit/runtime/half_precision/test_dynamic_loss_scale.py
        # (commit 7f0482cc00be21db0a16ded1b1d56ca2ddd88dfd), the current rule.
        return [
            # TestFused.test_all_overflow: 2**4, window 2, hysteresis 1, floor 1.
            (
                {**ds, "init_scale": 2.0**4, "scale_window": 2},
                [True] * 8,
                [8.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            ),
            # TestUnfused.test_all_overflow: the same with min_loss_scale 2.
            (
                {**ds, "init_scale": 2.0**4, "scale_window": 2, "min_scale": 2.0},
                [True] * 8,
                [8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
            ),
            # test_some_overflow: two overflows, scale_window + 1 clean steps grow once.
            (
                {**ds, "init_scale": 2.0**8, "scale_window": 2},
                [True, True, False, False, False, True],
                [2.0**7, 2.0**6, 2.0**6, 2.0**6, 2.0**7, 2.0**6],
            ),
            # test_no_overflow: grows on clean steps 3, 5, 7, 9.
            (
                {**ds, "init_scale": 2.0**8, "scale_window": 2},
                [False] * 10,
                [
                    2.0**8,
                    2.0**8,
                    2.0**9,
                    2.0**9,
                    2.0**10,
                    2.0**10,
                    2.0**11,
                    2.0**11,
                    2.0**12,
                    2.0**12,
                ],
            ),
            # TestZeroStage0Hysteresis.test_hysteresis: hysteresis 3.
            (
                {**ds, "init_scale": 2.0**8, "scale_window": 1000, "delayed_shift": 3},
                [True] * 4,
                [2.0**8, 2.0**8, 2.0**7, 2.0**6],
            ),
            # test_consecutive_hysteresis: a clean step refills it.
            (
                {
                    **ds,
                    "init_scale": 2.0**8,
                    "scale_window": 1000,
                    "delayed_shift": 2,
                    "consecutive_hysteresis": True,
                },
                [True, False] * 4,
                [2.0**8] * 8,
            ),
        ]
    if key == "deepspeed@0.17.0":
        return [({**p, "scale_factor": 2.0}, f, None) for p, f, _ in _examples("deepspeed")]
    if key == "paddle_static":
        # PaddlePaddle/Paddle test/legacy_test/test_update_loss_scaling_op.py: from
        # prev_loss_scaling 2048, num_good_steps 999 / num_bad_steps 1 (a "_start" here),
        # incr_every_n_steps 1000, decr_every_n_nan_or_inf 2, ratios 2.0 and 0.8.
        p = {
            "init_loss_scaling": 2048.0,
            "incr_ratio": 2.0,
            "decr_ratio": 0.8,
            "incr_every_n_steps": 1000,
            "decr_every_n_nan_or_inf": 2,
            "_start": {"good": 999, "bad": 1},
        }
        return [(p, [False], [4096.0]), (p, [True], [f32(2048.0 * f32(0.8))])]
    if key == "torch":
        # pytorch/pytorch test/test_cuda.py test_grad_scaling_update_scale: growth 2.0,
        # backoff 0.25, interval 2, from 4.0 (on the CPU here).
        p = {"init_scale": 4.0, "growth_factor": 2.0, "backoff_factor": 0.25, "growth_interval": 2}
        return [(p, [False, False, True], [4.0, 8.0, 2.0])]
    return []


def corpus(key: str, seed: int = 22) -> list[tuple[Params, list[bool], list[float] | None]]:
    """The seeded sequences one anchor is compared on."""
    rng = random.Random(f"{key}/{seed}")
    cases: list[tuple[Params, list[bool], list[float] | None]] = list(_examples(key))
    # A step of Keras (NumPy backend), of PyTorch's and of Paddle's optimizer loop takes
    # 0.5 to 1 ms: fewer and shorter runs there (still past 2,000 steps).
    long, short = (2500, 16) if key in ("keras", "torch", "paddle") else (4500, 28)
    cases.append((DEFAULTS[key], _long_run(rng, long), None))  # the defaults, long
    for _ in range(short):  # bursty, small windows, every hysteresis, both ends of float32
        flags = bursty(
            rng, rng.choice([60, 150, 300]), rng.choice([2, 5, 20]), rng.choice([1.5, 3, 10])
        )
        cases.append((random_params(key, rng), flags, None))
    # The far ends: all overflows, all clean.
    cases += [(random_params(key, rng), [rng.random() < 0.5] * 300, None) for _ in range(4)]
    return cases


# ------------------------------------------------------------------ comparing
def _start(key: str, params: Params) -> sc.ScalerState:
    name, extra = PRESET[key]
    own = {k: v for k, v in params.items() if not k.startswith("_")}
    state = sc.init(sc.preset(name, **extra, **own))
    start = params.get("_start")
    if start:  # Paddle's operator test starts from given counters
        hyst = state.config.hysteresis - start["bad"]
        state = sc.ScalerState(state.config, state.scale, start["good"], hyst)
    return state


def _normal(x: float) -> bool:
    return FLT_MIN <= x <= FLT_MAX


def compare(
    key: str, params: Params, flags: list[bool], theirs: dict[str, Any]
) -> tuple[int, str | None]:
    """Step the preset beside the library's trajectory; the steps found equal and the
    stated difference met at the end (None: none, the sequence ran out)."""
    scales, skips, raised = theirs["scales"], theirs["skips"], theirs["raised"]
    where = f"{key} with {params} on flags {flags}"
    assert raised is None or scales or flags == [], f"{where}: the library refused: {raised}"
    state = _start(key, params)
    for i, flag in enumerate(flags):
        before = state
        try:
            state = sc.update(before, flag)
        except sc.ScaleCollapseError as err:
            return i, _refusal(key, where, i, str(err), theirs)
        assert i < len(scales), f"{where}: the library raised {raised} at step {i}; we went on"
        if not _normal(scales[i]):
            if scales[i] > FLT_MAX:  # the library grew past float32; we kept the scale
                assert "growth" in _ALLOWED[key], f"{where}: growth past float32 at {i}"
                assert state.last_step is sc.StepKind.GROWTH_BLOCKED, (where, i, state)
                assert state.scale == before.scale
                return i, "growth"
            pytest.fail(
                f"{where}: the library's scale became {scales[i]!r} at step {i}; "
                f"we did not refuse ({state.scale!r})"
            )
        assert state.scale == scales[i], (
            f"{where}: step {i}: the library's scale {scales[i]!r}, the preset's {state.scale!r}"
        )
        assert sc.step_skipped(state) is flag, (where, i)  # every anchor skips on overflow
        if skips[i] is not None:
            assert skips[i] is flag, f"{where}: step {i}: the library skipped={skips[i]}"
    assert raised is None, f"{where}: the library raised {raised}; we did not"
    return len(flags), None


def _refusal(key: str, where: str, i: int, err: str, theirs: dict[str, Any]) -> str:
    """The stated difference a refused step ``i`` is, or a failure."""
    scales, raised = theirs["scales"], theirs["raised"]
    if i < len(scales) and scales[i] < FLT_MIN:  # the library backed off to 0 or subnormal
        assert "collapse" in _ALLOWED[key], f"{where}: collapse at {i}"
        return "collapse"
    if i == len(scales) and raised is not None:  # the library raised at its floor
        assert "floor" in _ALLOWED[key], f"{where}: floor at {i}"
        assert "at_min_scale='raise'" in err, err
        return "floor"
    pytest.fail(f"{where}: step {i} refused ({err}); the library went on: {scales[i : i + 1]}")


def _record(tally: dict[str, Any], key: str, release: str, steps: int, seen: str | None) -> None:
    t = tally.setdefault(key, {"against": "", "sequences": 0, "steps": 0, "differences": Counter()})
    t["against"] = f"{AGAINST[key]} {release}"
    t["sequences"] += 1
    t["steps"] += steps
    if seen is not None:
        t["differences"][seen] += 1


# ------------------------------------------------------------------------ tests
@pytest.mark.parametrize("key", sorted(PRESET))
def test_preset_equals_its_library_step_by_step(
    key: str, anchors: Any, oracle_tally: dict[str, Any], record_property: Callable[..., None]
) -> None:
    release = anchors.version(key)
    cases = corpus(key)
    answers = anchors.run(key, [(p, f) for p, f, _ in cases])
    steps, seen = 0, Counter[str]()
    for (params, flags, expected), theirs in zip(cases, answers, strict=True):
        if expected is not None:  # the library's own test still holds, for both
            assert theirs["scales"] == expected, (key, params, theirs)
        n, kind = compare(key, params, flags, theirs)
        steps += n
        _record(oracle_tally, key, release, n, kind)
        if kind:
            seen[kind] += 1
    record_property("steps_compared", steps)
    record_property("sequences", len(cases))
    print(
        f"{key} vs {release}: {len(cases)} sequences, {steps} steps equal, differences {dict(seen)}"
    )
    assert steps >= 2000
    # Every difference the preset states is met, and is stated in its words.
    assert set(seen) == _ALLOWED[key]
    text = sc.PRESETS[PRESET[key][0]].differences
    for kind in _ALLOWED[key]:
        assert _STATED[kind] in text, (key, kind)


def _hypothesis_params(key: str, data: st.DataObject) -> Params:
    """A config the library takes, drawn by hypothesis (so a failure shrinks to it):
    any float32 scale, factors, windows, floors, hysteresis, each by the library's name."""
    scale = st.one_of(st.sampled_from(_LOW + _HIGH + _MID), scales())
    window = st.integers(1, 6)
    if key == "flax":  # its static fields compile once per set: drawn from a few sets
        interval, growth, backoff, floor = data.draw(st.sampled_from(_FLAX_STATIC))
        init = data.draw(scale.filter(lambda x: floor is None or x >= floor), label="scale")
        return {
            "scale": init,
            "growth_interval": interval,
            "growth_factor": growth,
            "backoff_factor": backoff,
            "minimum_scale": floor,
        }
    if key.startswith("deepspeed"):  # DeepSpeed's scales are powers of two (or 3 * 2**k)
        scale = st.builds(
            lambda m, e: m * 2.0**e, st.sampled_from([1.0, 3.0]), st.integers(-120, 125)
        )
    init = data.draw(scale, label="init")
    floor = st.one_of(st.sampled_from([1.0, 0.25, FLT_MIN]), scales()).filter(lambda x: x <= init)
    growth, backoff = st.sampled_from(_GROWTH), st.sampled_from(_BACKOFF)
    drawn: dict[str, st.SearchStrategy[Any]]
    if key == "torch":
        drawn = {
            "init_scale": st.just(init),
            "growth_factor": growth,
            "backoff_factor": backoff,
            "growth_interval": window,
        }
    elif key.startswith("deepspeed"):
        drawn = {
            "init_scale": st.just(init),
            "scale_window": window,
            "min_scale": floor,
            "delayed_shift": st.integers(1, 4),
            "consecutive_hysteresis": st.booleans(),
            "raise_error_at_min_scale": st.booleans(),
        }
        if key == "deepspeed@0.17.0":
            drawn["scale_factor"] = st.sampled_from([2.0, 4.0])
    elif key == "megatron":
        drawn = {
            "initial_scale": st.just(init),
            "min_scale": floor,
            "growth_factor": growth,
            "backoff_factor": backoff,
            "growth_interval": window,
            "hysteresis": st.integers(1, 4),
        }
    elif key in ("paddle", "paddle_static"):
        if key == "paddle_static":
            init = max(init, 1.0)  # its floor of 1 is above any smaller start
        drawn = {
            "init_loss_scaling": st.just(init),
            "incr_ratio": growth,
            "decr_ratio": backoff,
            "incr_every_n_steps": window,
            "decr_every_n_nan_or_inf": st.integers(1, 4),
        }
    elif key == "jmp":
        drawn = {
            "loss_scale": st.just(init),
            "period": window,
            "factor": st.sampled_from([2, 4]),
            "min_loss_scale": floor,
        }
    else:
        assert key == "keras"
        drawn = {"initial_scale": st.just(init), "dynamic_growth_steps": window}
    return data.draw(st.fixed_dictionaries(drawn), label="params")


@pytest.mark.parametrize("key", sorted(PRESET))
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_preset_equals_its_library_on_drawn_configs(
    key: str, anchors: Any, oracle_tally: dict[str, Any], data: st.DataObject
) -> None:
    release = anchors.version(key)
    params = _hypothesis_params(key, data)
    flags = data.draw(flag_sequences(max_size=120), label="flags")
    (theirs,) = anchors.run(key, [(params, flags)])
    n, kind = compare(key, params, flags, theirs)
    _record(oracle_tally, key, release, n, kind)


#: Configs the preset refuses: the library takes them (True), as the preset's
#: PRESETS[...].differences says (the phrase quoted), or refuses them too (False).
REFUSED = [
    ("torch", {"init_scale": 1e-40}, True, "refused by the config"),
    ("deepspeed", {**DEFAULTS["deepspeed"], "init_scale": 0.1}, True, "init_scale=0.1"),
    (
        "deepspeed",
        {**DEFAULTS["deepspeed"], "init_scale": 1.0, "min_scale": 1e-40},
        True,
        "a subnormal min_scale",
    ),
    # Both refuse: the class has had no scale_factor since 0.17.1 (TypeError).
    ("deepspeed", {**DEFAULTS["deepspeed"], "scale_factor": 4.0}, False, ""),
    (
        "deepspeed@0.17.0",
        {**DEFAULTS["deepspeed@0.17.0"], "scale_factor": 3.0},
        True,
        "only power-of-two scale_factor",
    ),
    ("megatron", {**DEFAULTS["megatron"], "initial_scale": 1e39}, True, "refused by the config"),
    (
        "megatron",
        {**DEFAULTS["megatron"], "initial_scale": 1.0, "min_scale": 1e-40},
        True,
        "refused by the config",
    ),
    ("paddle", {**DEFAULTS["paddle"], "init_loss_scaling": 1e-40}, True, "refused by the config"),
    (
        "paddle_static",
        {**DEFAULTS["paddle"], "init_loss_scaling": 0.5},
        True,
        "initial scale below 1",
    ),
    ("jmp", {**DEFAULTS["jmp"], "factor": 3}, True, "only powers of two are accepted"),
    (
        "flax",
        {**DEFAULTS["flax"], "scale": 1e-40, "minimum_scale": None},
        True,
        "refused by the config",
    ),
    ("keras", {"initial_scale": 1e-40, "dynamic_growth_steps": 2}, True, "refused by the config"),
]


@pytest.mark.parametrize(("key", "params", "takes", "stated"), REFUSED)
def test_configs_the_preset_refuses_are_stated(
    key: str, params: Params, takes: bool, stated: str, anchors: Any
) -> None:
    anchors.version(key)
    name, extra = PRESET[key]
    with pytest.raises(sc.InvalidConfigError):
        sc.preset(name, **extra, **params)
    (theirs,) = anchors.run(key, [(params, [False, True])])
    assert (theirs["raised"] is None) is takes, theirs
    if takes:  # a config both refuse is no difference
        assert stated in sc.PRESETS[name].differences
