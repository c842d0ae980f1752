"""scaler_core.deepspeed against DeepSpeed's own DynamicLossScaler and ZeRO engine.

* Two real ranks (gloo, CPU) train a ZeRO-1 fp16 engine with DeepSpeed's scaler and
  with scaler-core's (``install``): float16 parameters, skips (an inf in rank 1's
  gradient only), a backoff, growths; the scale, DeepSpeed's counters, the float16
  parameters, the fp32 partitions and Adam's state equal after every step, bit for
  bit; a checkpoint saved by either engine resumes in the other, bit for bit, and
  loading never swaps scaler-core's scaler out (``torch_scripts/deepspeed_zero.py``).
* One process: the class against DeepSpeed's class over long seeded random overflow
  sequences, with a hand-over (``from_deepspeed``) and a pickle round trip mid-way.
* The refusals, each leaving everything as it was.
"""

from __future__ import annotations

import itertools
import json
import pickle
import random
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="scaler_core.deepspeed needs PyTorch")
pytest.importorskip("deepspeed", reason="DeepSpeed (the oracle) is not installed")

import torch
from deepspeed.runtime.fp16 import loss_scaler as ds_loss_scaler

import scaler_core as sc
from scaler_core._f32 import FLT_MAX
from scaler_core.deepspeed import DynamicLossScaler, install

pytestmark = pytest.mark.torch

STEPS, SAVE_AT = 14, 7  # as torch_scripts/deepspeed_zero.py
OURS = "scaler_core.deepspeed.DynamicLossScaler"
THEIRS = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit: tensors of the same dtype and values, recursively."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


_COMPARED = ("scale", "counters", "params", "fp32", "adam")
_RUNS: list[dict[str, Any]] = []


# ------------------------------------------------------------------ two ranks
@pytest.fixture
def runs(torch_ranks: Callable[[str, str], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    if not _RUNS:  # one run (about 10 s) serves every test here
        _RUNS.extend(torch_ranks("deepspeed_zero.py", "all"))
    return _RUNS


def test_zero1_two_ranks_bit_for_bit_and_checkpoints_both_ways(runs: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(runs):
        where = f"rank {rank}"
        assert out["dtypes"] == {"torch.float16"}, where  # float16 parameters really
        theirs, ours = out["deepspeed"], out["ours"]
        assert [s["scaler_class"] for s in theirs] == [THEIRS] * STEPS
        assert [s["scaler_class"] for s in ours] == [OURS] * STEPS
        scales = [s["scale"] for s in theirs]
        skipped = [s["skipped"] for s in theirs]
        # The run meets each rule: skips (hysteresis, then a backoff), growths.
        assert skipped[-1] == 3, (where, skipped)
        assert any(b < a for a, b in itertools.pairwise(scales)), scales  # a backoff
        assert sum(b > a for a, b in itertools.pairwise(scales)) >= 2, scales  # growths
        assert not _same(theirs[0]["params"], theirs[-1]["params"])  # it trains
        for step, (t, o) in enumerate(zip(theirs, ours, strict=True)):
            for key in (*_COMPARED, "skipped"):
                assert _same(t[key], o[key]), (where, step, key, t[key], o[key])
            assert isinstance(o["scale"], float)
        # Checkpoints both ways: what was loaded, and every step after it.
        for resumed, scaler in (("ours_from_deepspeed", OURS), ("deepspeed_from_ours", OURS)):
            loaded = out[f"{resumed}_loaded"]
            assert loaded["scaler_class"] == scaler, resumed  # never swapped back
            for key in _COMPARED:
                assert _same(loaded[key], theirs[SAVE_AT - 1][key]), (where, resumed, key)
            for step, s in enumerate(out[resumed], start=SAVE_AT):
                assert s["scaler_class"] == scaler, (resumed, step)
                for key in _COMPARED:
                    assert _same(s[key], theirs[step][key]), (where, resumed, step, key)
    # ZeRO shards the fp32 master weights; both ranks take the same decisions.
    assert not _same(runs[0]["ours"][-1]["fp32"], runs[1]["ours"][-1]["fp32"])
    assert [s["scale"] for s in runs[0]["ours"]] == [s["scale"] for s in runs[1]["ours"]]
    # ZeRO pickles the scaler object: ours by reference to scaler_core.deepspeed.
    for name, module in (("ours", b"scaler_core.deepspeed"), ("deepspeed", b"deepspeed.runtime")):
        folder = Path(runs[0]["checkpoints"][name]) / "mid"
        with zipfile.ZipFile(folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt") as z:
            pkl = next(z.read(n) for n in z.namelist() if n.endswith("data.pkl"))
        assert module in pkl, name
        assert b"DynamicLossScaler" in pkl, name


def test_install_refuses_engines_without_a_zero_dynamic_scaler(runs: list[dict[str, Any]]) -> None:
    refusals = runs[0]["refusals"]
    optimizer, message, unchanged = refusals["no_zero"]
    assert optimizer in ("FP16_Optimizer", "FP16_UnfusedOptimizer")
    assert message is not None
    assert "without ZeRO" in message
    assert '"stage": 1' in message
    assert unchanged
    for name, scale in (("static", "128.0"), ("bf16", "1.0")):
        optimizer, message, unchanged = refusals[name]
        assert optimizer == "DeepSpeedZeroOptimizer", name
        assert message is not None
        assert f"static LossScaler (cur_scale={scale})" in message
        assert unchanged, name


# --------------------------------------------------------------- one process
@pytest.fixture
def rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's class asks deepspeed.comm for the rank when it logs an overflow;
    with no process group here, rank 0 answers (the class's numbers are untouched)."""
    monkeypatch.setattr(ds_loss_scaler.dist, "get_rank", lambda *a, **k: 0)


def _params(rng: random.Random) -> dict[str, Any]:
    init = rng.choice([2.0 ** rng.randint(-20, 100), 3.0 * 2.0 ** rng.randint(-20, 90)])
    return {
        "init_scale": init,
        "scale_window": rng.randint(1, 6),
        "min_scale": rng.choice([x for x in (1.0, 0.25, 2.0**-20, init) if x <= init]),
        "delayed_shift": rng.randint(1, 4),
        "consecutive_hysteresis": rng.random() < 0.5,
        "raise_error_at_min_scale": rng.random() < 0.5,
    }


def _flags(rng: random.Random, n: int) -> list[bool]:
    flags: list[bool] = []
    while len(flags) < n:
        clean = rng.choice([1, 2, 5, 12])
        flags += [False] * max(1, round(rng.expovariate(1 / clean)))
        flags += [True] * max(1, round(rng.expovariate(1 / rng.choice([1.2, 2, 4]))))
    return flags[:n]


def _view(s: Any) -> tuple[Any, ...]:
    return (s.cur_scale, s.cur_iter, s.last_overflow_iter, s.cur_hysteresis)


@pytest.mark.usefixtures("rank_zero")
@pytest.mark.parametrize("seed", range(6))
def test_update_scale_equals_deepspeeds_step_by_step(seed: int) -> None:
    rng = random.Random(f"deepspeed-scaler/{seed}")
    steps = floors = 0
    for _ in range(25):
        params = _params(rng)
        flags = _flags(rng, rng.choice([200, 400]))
        theirs = ds_loss_scaler.DynamicLossScaler(**params)
        ours = DynamicLossScaler(**params)
        handover = rng.randrange(len(flags))
        for i, flag in enumerate(flags):
            if i == handover:  # carry DeepSpeed's state over, then a pickle round trip
                ours = DynamicLossScaler.from_deepspeed(theirs)
                ours = pickle.loads(pickle.dumps(ours))
                assert _view(ours) == _view(theirs)
            try:
                theirs.update_scale(flag)
            except Exception as exc:  # DeepSpeed's bare Exception at its floor
                message = str(exc)
            else:
                message = None
            if message is not None:
                assert "minimum" in message
                before = ours.state_dict()
                with pytest.raises(sc.ScaleCollapseError, match="at_min_scale='raise'"):
                    ours.update_scale(flag)
                assert ours.state_dict() == before  # nothing changed
                floors += 1
                break
            if theirs.cur_scale > FLT_MAX:  # the stated difference: ours blocks the growth
                break
            ours.update_scale(flag)
            assert _view(ours) == _view(theirs), (params, i, flags[: i + 1])
            steps += 1
    assert steps > 3000
    assert floors >= 1


@pytest.mark.usefixtures("rank_zero")
def test_defaults_are_deepspeeds_fp16_config() -> None:
    ours = DynamicLossScaler()
    theirs = ds_loss_scaler.DynamicLossScaler(
        init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2,
        consecutive_hysteresis=False, raise_error_at_min_scale=True,
    )  # fmt: skip
    for name in ("cur_scale", "scale_window", "min_scale", "delayed_shift", "scale_factor"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.dynamic
    assert ours.dtype == torch.float16
    assert ours.config == sc.preset("deepspeed")
    flags = [False] * 2500 + [True, True, True] + [False] * 1200
    for flag in flags:
        theirs.update_scale(flag)
        ours.update_scale(flag)
        assert _view(ours) == _view(theirs)
    loss = torch.tensor(0.5, dtype=torch.float16, requires_grad=True)
    assert torch.equal(ours.scale_loss(loss), theirs.scale_loss(loss))  # DeepSpeed's own code


def test_state_dict_is_json_safe_and_pickles_by_reference() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**10, scale_window=2, delayed_shift=1)
    for flag in (False, True, False, False):
        scaler.update_scale(flag)
    data = scaler.state_dict()
    assert json.loads(json.dumps(data)) == data
    blob = pickle.dumps(scaler)
    assert b"scaler_core.deepspeed" in blob
    assert b"DynamicLossScaler" in blob
    back = pickle.loads(blob)
    assert type(back) is DynamicLossScaler
    assert back.state == scaler.state
    assert _view(back) == _view(scaler) == (512.0, 4, 1, 1)


def test_refusals_change_nothing() -> None:
    scaler = DynamicLossScaler(init_scale=2.0**10)
    before = scaler.state_dict()
    with pytest.raises(sc.InvalidArgumentError, match=r"must be a deepspeed\.DeepSpeedEngine"):
        install("engine")
    with pytest.raises(sc.InvalidArgumentError, match="DeepSpeed's arguments"):
        DynamicLossScaler(init_scale=2.0, config=sc.preset("deepspeed"))
    with pytest.raises(sc.InvalidArgumentError, match="spike_threshold"):
        DynamicLossScaler(config=sc.preset("deepspeed", spike_threshold=4.0))
    with pytest.raises(sc.InvalidConfigError, match="scale_factor"):
        DynamicLossScaler.from_deepspeed(_their(scale_factor=4.0))
    with pytest.raises(sc.InvalidArgumentError, match=r"must be DeepSpeed's DynamicLossScaler"):
        DynamicLossScaler.from_deepspeed(ds_loss_scaler.LossScaler(128.0))
    with pytest.raises(sc.GradientTypeError, match="overflow=1"):
        scaler.update_scale(1)
    with pytest.raises(sc.InvalidStateError, match="cur_scale"):
        scaler.cur_scale = float("inf")
    with pytest.raises(sc.InvalidStateError, match="missing keys"):
        scaler.load_state_dict({k: v for k, v in before.items() if k != "cur_iter"})
    with pytest.raises(sc.InvalidStateError, match="last_overflow_iter"):
        scaler.load_state_dict({**before, "last_overflow_iter": 5})
    assert scaler.state_dict() == before
    scaler.cur_scale = 2.0**12  # ZeRO's optimizer.loss_scale = x
    assert scaler.cur_scale == scaler.loss_scale == 4096.0


def _their(**attrs: Any) -> Any:
    scaler = ds_loss_scaler.DynamicLossScaler(2.0**8, 4, 1, 2, False)
    for name, value in attrs.items():
        setattr(scaler, name, value)
    return scaler
