"""``GradScaler`` over ``torch.distributed``: ranks that check different gradients skip together.

Two real processes over ``torch.distributed`` (gloo on the loopback interface, on
the CPU) run a script from ``torch_scripts/`` (the ``torch_ranks`` fixture of
this folder's ``conftest.py``):

* ``sharded.py``: each rank owns half the parameters, as under ZeRO, and an inf
  lands in rank 1's half only. With ``process_group=`` both ranks make the same
  decisions and end with the same state and parameters; without it they part ways
  (which is what the group is for).
* ``fsdp2.py``: FSDP2 (``fully_shard``, DTensor gradients), scaler-core's drop-in
  with ``unscale_and_clip_`` and ``report_leaves=True`` beside PyTorch's own
  ``unscale_`` and clip, with no process group.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch integration needs PyTorch")
dist = pytest.importorskip("torch.distributed")

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in"),
]


@pytest.mark.parametrize("mode", ["group", "group-fold"], ids=["step", "clip_and_step"])
def test_ranks_decide_together_over_the_process_group(torch_ranks: Any, mode: str) -> None:
    """Each rank checks only its own shard; the group ORs the flags, so both skip the
    four steps with an inf on rank 1 (with ``clip_and_step`` too, whose flag reaches
    the fused optimizer only after the OR)."""
    rank0, rank1 = torch_ranks("sharded.py", mode)
    assert rank0["decisions"] == rank1["decisions"]
    assert rank0["decisions"].count(False) == 4  # the four injected steps, on both ranks
    assert rank0["state"] == rank1["state"]
    assert rank0["state"]["scaler_core"]["state"]["skipped_steps"] == 4
    for a, b in zip(rank0["params"], rank1["params"], strict=True):
        assert torch.equal(a, b)


def test_without_the_group_the_ranks_part_ways(torch_ranks: Any) -> None:
    rank0, rank1 = torch_ranks("sharded.py", "none")
    assert rank0["decisions"].count(False) == 0  # rank 0 never saw rank 1's inf
    assert rank1["decisions"].count(False) == 4
    assert rank0["state"]["scale"] != rank1["state"]["scale"]


def test_fsdp2_gradients_take_every_extra_as_pytorchs_pair(torch_ranks: Any) -> None:
    """FSDP2 (DTensor gradients): ``unscale_and_clip_`` gives the global norm, the same
    flag on every rank and PyTorch's clip; the report names the leaf on every rank.

    PyTorch's clip gets scaler-core's norm (``clip_grads_with_norm_``), so the two runs
    are bit-identical; the two norms differ only in how the squares are summed
    (PyTorch: float32; scaler-core: float64, rounded once), so scaler-core's is within
    one float32 ulp of the exact norm and PyTorch's within a few.
    """
    runs = torch_ranks("fsdp2.py", "-")
    inf_steps = [3, 8]
    for rank, run in enumerate(runs):
        # PyTorch's own pair, with no process group: its DTensor layer all-reduces the
        # flag of its unscale kernel, so rank 0 sees rank 1's inf (process_group= is not
        # needed under FSDP2), and so does scaler-core's drop-in.
        for step, (our_flags, their_flags) in enumerate(run["flags"]):
            expected = [1.0] if step in inf_steps else [0.0]
            assert our_flags == their_flags == expected, (rank, step)
        assert [not s for s in run["stepped"]] == [s in inf_steps for s in range(12)]
        assert run["leaves"] == [
            ["grads[0][2]: 1 inf, 0 nan"] if s in inf_steps else [] for s in range(12)
        ]
        for step, (ours, theirs, exact) in enumerate(
            zip(run["ours"], run["theirs"], run["exact"], strict=True)
        ):
            if step in inf_steps:
                assert math.isinf(ours)
                assert math.isinf(theirs)
                continue
            ulp = float(np.spacing(np.float32(exact)))
            assert abs(ours - exact) <= ulp, step  # the float64 sum, rounded once
            assert ours == pytest.approx(theirs, rel=1e-6), step  # PyTorch's float32 sum
        for ours, theirs in run["params"]:
            assert torch.equal(ours, theirs)
        assert run["scales"][0] == run["scales"][1] == 2.0**10
        assert run["found"]
        assert run["report"] == ["grads['w']: 0 inf, 1 nan"]
        message, untouched = run["refused"]
        assert message.startswith("grads['w'] is a DTensor placed (Partial(sum),)")
        assert ".redistribute(" in message
        assert untouched == [4.0, 4.0]
    assert runs[0]["ours"] == runs[1]["ours"]  # the global norm, on every rank
    # The folded step, fused Adam, on DTensor gradients: the recipe's decisions, its
    # norms and parameters to within the drift of a few ulps a step (each step's own
    # bound is tests/integrations/test_torch_fold.py's), the same on every rank.
    for run in runs:
        assert [s for _, s in run["fold"]] == [s not in inf_steps for s in range(12)]
        assert [s for _, s in run["recipe"]] == [s not in inf_steps for s in range(12)]
        for (folded, _), (unfolded, _) in zip(run["fold"], run["recipe"], strict=True):
            assert folded == pytest.approx(unfolded, rel=1e-5, nan_ok=True)
        for folded, unfolded in run["fused_params"]:
            torch.testing.assert_close(folded, unfolded, rtol=1e-5, atol=1e-7)
    assert runs[0]["fold"] == runs[1]["fold"]


def test_fsdp1_sharded_grad_scaler_trains_as_pytorchs(torch_ranks: Any) -> None:
    """FSDP1 with float16 low-precision gradients: scaler_core.torch.ShardedGradScaler,
    built with PyTorch's positional order, gives PyTorch's ShardedGradScaler's scales,
    skips and parameters bit for bit; an inf in one rank's shard skips both ranks."""
    ours = torch_ranks("fsdp1.py", "ours")
    want = torch_ranks("fsdp1.py", "torch")
    for rank in range(2):
        assert ours[rank]["scales"] == want[rank]["scales"]
        assert ours[rank]["stepped"] == want[rank]["stepped"]
        assert ours[rank]["dtypes"] == want[rank]["dtypes"] == {"torch.float16"}
        for p, q in zip(ours[rank]["params"], want[rank]["params"], strict=True):
            assert torch.equal(p, q)
    skipped = [not s for s in ours[0]["stepped"]]
    assert skipped == [not s for s in ours[1]["stepped"]]  # the ranks decide together
    assert sum(skipped) >= 3


def test_fsdp1_with_a_fused_optimizer_skips_an_overflow_on_every_rank(torch_ranks: Any) -> None:
    """An inf in both ranks' shards, ``unscale_`` then a fused Adam's ``step``: the flags
    are ORed (a maximum), so the fused kernel sees 1 and skips; the parameters stay
    finite. (PyTorch's ShardedGradScaler sums the flags, to 2 here, and a fused Adam
    steps on a found_inf of 2; on the CPU its class fails earlier, on the shape of
    its flag.)"""
    ours = torch_ranks("fsdp1.py", "ours-fused")
    for rank in range(2):
        assert all(torch.isfinite(p).all() for p in ours[rank]["params"])
        skipped = [i for i, s in enumerate(ours[rank]["stepped"]) if not s]
        assert set(skipped) >= {3, 9, 10}


def test_fsdp1_a_rank_without_an_optimizers_gradients_steps_as_with_pytorchs(
    torch_ranks: Any,
) -> None:
    """FSDP1 with ``use_orig_params=True``: rank 0 holds no gradient of the optimizer of
    the last bias. As PyTorch's ShardedGradScaler does, it gets a flag on the scale's
    device and joins the all-reduce (scaler-core's used to raise "No inf checks were
    recorded for this optimizer" there, leaving rank 1 in the all-reduce); rank 1's
    infs skip that optimizer on both ranks, bit for bit as PyTorch's."""
    ours = torch_ranks("fsdp1_idle.py", "ours")
    want = torch_ranks("fsdp1_idle.py", "torch")
    assert not any(ours[0]["held"])  # the case: rank 0 has none of that optimizer's gradients
    assert all(ours[1]["held"])
    for rank in range(2):
        assert ours[rank]["scales"] == want[rank]["scales"]
        for p, q in zip(ours[rank]["params"], want[rank]["params"], strict=True):
            assert torch.equal(p, q)
    backoffs = [s for s in range(1, 8) if ours[0]["scales"][s] < ours[0]["scales"][s - 1]]
    assert backoffs == [2, 5]  # rank 1's infs, on rank 0 too
    assert ours[0]["scales"] == ours[1]["scales"]


# ------------------------------------------------------ the process-group seams
def test_sharded_grad_scaler_clips_by_the_norm_over_the_group_as_fsdp(torch_ranks: Any) -> None:
    """FSDP1: ``unscale_and_clip_`` clips every rank by the norm over all the shards, as
    PyTorch's ShardedGradScaler with FSDP's ``clip_grad_norm_`` does. (It used to clip
    each rank by its own shard's norm: two different norms, and ranks that part ways.)

    With float16 gradients FSDP returns its norm rounded to float16 and multiplies by
    its coefficient rounded to float16; scaler-core multiplies in float32 by
    ``clip_grad_norm_``'s coefficient and rounds once. So the norms agree to float16's
    precision and the parameters to a float16 ulp or so; the skips and scales exactly.
    (``clip_and_step``'s test below compares float32 norms to float32 precision.)"""
    ours = torch_ranks("fsdp1_clip.py", "ours")
    want = torch_ranks("fsdp1_clip.py", "torch")
    np.testing.assert_array_equal(ours[0]["norms"], ours[1]["norms"])  # one norm, every rank
    for rank in range(2):
        assert ours[rank]["scales"] == want[rank]["scales"]
        assert ours[rank]["stepped"] == want[rank]["stepped"]
        assert [not s for s in ours[rank]["stepped"]] == [s in {4, 9} for s in range(12)]
        for step, (a, b) in enumerate(zip(ours[rank]["norms"], want[rank]["norms"], strict=True)):
            if step in {4, 9}:
                assert math.isinf(a) or math.isnan(a)
                continue
            assert a > 0.25  # the clip is active (MAX_NORM)
            assert a == pytest.approx(b, rel=2.0**-11), step  # FSDP's is a float16
        for p, q in zip(ours[rank]["params"], want[rank]["params"], strict=True):
            torch.testing.assert_close(p, q, rtol=2.0**-10, atol=2.0**-14)


def test_sharded_clip_and_step_folds_the_norm_over_the_group(torch_ranks: Any) -> None:
    """FSDP1 with a fused Adam: ``clip_and_step`` divides by the norm over the group,
    FSDP's own norm of the same gradients, the same on both ranks."""
    runs = torch_ranks("fsdp1_clip.py", "ours-fold")
    np.testing.assert_array_equal(runs[0]["norms"], runs[1]["norms"])  # NaN on skipped steps
    for run in runs:
        assert [not s for s in run["stepped"]] == [s in {4, 9} for s in range(12)]
        for step, (ours, fsdp) in enumerate(zip(run["norms"], run["fsdp"], strict=True)):
            if step not in {4, 9}:
                assert ours == pytest.approx(fsdp, rel=2e-7), step


def test_sharded_clip_refuses_a_parameter_fsdp_does_not_shard(torch_ranks: Any) -> None:
    """A parameter each rank holds whole would be counted once per rank: refused on
    every rank alike (none is left in a collective), before anything changes."""
    for run in torch_ranks("fsdp1_clip.py", "ours-replicated"):
        assert "is not one FSDP manages" in run["refused"]
        assert run["untouched"]


@pytest.mark.parametrize("how", ["none", "deepcopy", "pickle"])
def test_sharded_grad_scaler_ors_over_the_default_group_as_pytorchs(
    torch_ranks: Any, how: str
) -> None:
    """``process_group=None`` is the default group, as in PyTorch's class, and a scaler
    copied or unpickled keeps ORing over it: rank 1's infs skip rank 0 too, bit for bit
    as PyTorch's ShardedGradScaler. (``None`` used to mean no group, and a copy dropped
    the group: the ranks parted ways.)"""
    ours = torch_ranks("groups.py", f"{how}-ours")
    want = torch_ranks("groups.py", f"{how}-torch")
    for rank in range(2):
        assert [not s for s in want[rank]["stepped"]] == [s in {2, 5} for s in range(8)]
        assert ours[rank]["stepped"] == want[rank]["stepped"]
        assert ours[rank]["scales"] == want[rank]["scales"]
        assert ours[rank]["group"] == want[rank]["group"] == "None"  # its process_group
        for p, q in zip(ours[rank]["params"], want[rank]["params"], strict=True):
            assert torch.equal(p, q)


def test_sharded_grad_scaler_sums_float16_sparse_duplicates_in_float32(torch_ranks: Any) -> None:
    """A row looked up 3,510 times: PyTorch's class sums its float16 duplicates in
    float32 (7020 scaled, 27.42 unscaled); summed in float16 they stopped at 4096 (16
    unscaled)."""
    ours = torch_ranks("groups.py", "sparse-ours")
    want = torch_ranks("groups.py", "sparse-torch")
    for rank in range(2):
        assert torch.equal(ours[rank]["grad"], want[rank]["grad"])
        assert float(want[rank]["grad"][0, 0]) == 3510 * 2.0**-7
        assert torch.equal(ours[rank]["params"][0], want[rank]["params"][0])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_a_rank_without_an_optimizers_gradients_joins_every_exchange(
    torch_ranks: Any, fused: bool
) -> None:
    """``GradScaler(process_group=...)``: rank 0 holds no gradient of the first optimizer.
    It still takes part in that optimizer's exchange of flags, in order, so rank 1's
    infs skip it on both ranks and the scales agree. (Rank 0 used to make no exchange
    there: the ranks' exchanges paired up out of order, rank 1 stepped what rank 0
    skipped, then gloo failed.)"""
    runs = torch_ranks("groups.py", f"idle-{'fused' if fused else 'plain'}-ours")
    assert runs[0]["scales"] == runs[1]["scales"]
    assert runs[0]["stepped"] == runs[1]["stepped"]
    assert [first for first, _ in runs[0]["stepped"]] == [s not in {2, 5} for s in range(8)]
    assert all(second for _, second in runs[0]["stepped"])
    backoffs = [s for s in range(1, 8) if runs[0]["scales"][s] < runs[0]["scales"][s - 1]]
    assert backoffs == [2, 5]
