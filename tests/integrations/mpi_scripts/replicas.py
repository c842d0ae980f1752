"""Run under mpiexec: data-parallel replicas with NaN/inf injected into one rank at random steps.

Each rank trains the same linear model on its own data with float16 scaled gradients (so real
overflows happen too, at different steps on different ranks), unscales its *local* gradients,
decides whether to skip, averages the gradients with ``MPI_Allreduce`` (every rank, every step)
and applies a momentum step unless skipping. ``--mode``:

* ``facade``: ``LossScaler(reduce_found=found_reducer(comm))``;
* ``functional``: ``unscale`` + ``reduce_found`` + ``update``;
* ``local``: ``LossScaler`` without the reduction (what the reduction prevents).

Rank 0 writes what every rank did to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

import scaler_core as sc
from scaler_core.mpi import (
    abort_on_error,
    check_consistent,
    fingerprint,
    found_reducer,
    reduce_found,
)

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["facade", "functional", "local"], required=True)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", required=True)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
DIM, BATCH, LR = 16, 8, 0.002
BAD = [np.nan, np.inf, -np.inf]

# min_scale keeps a diverged replica (NaN parameters, a skip every step) from collapsing.
config = sc.ScalerConfig(init_scale=2.0**12, growth_interval=4, min_scale=1.0)
common = np.random.default_rng(args.seed)  # identical stream on every rank
w_true = common.standard_normal(DIM).astype(np.float32)
w = np.zeros(DIM, np.float32)
m = np.zeros(DIM, np.float32)
data = np.random.default_rng([args.seed, 1 + rank])  # each rank its own data

scaler = sc.LossScaler(config, reduce_found=found_reducer(comm) if args.mode == "facade" else None)
state = sc.init(config)
decisions: list[bool] = []
local_flags: list[bool] = []
fingerprints: list[str] = []  # of (state, parameters) after every step
injected: list[list[int]] = []
checks = 0
mismatch = None

with abort_on_error(comm):
    for step in range(args.steps):
        # The injection schedule comes from the common stream: every rank draws the same.
        victim = int(common.integers(size)) if common.random() < 0.08 else -1
        where, bad = int(common.integers(DIM)), BAD[int(common.integers(3))]
        if victim >= 0:
            injected.append([step, victim])

        x = data.standard_normal((BATCH, DIM)).astype(np.float32)
        noise = np.float32(0.1) * data.standard_normal(BATCH).astype(np.float32)
        err = x @ w - (x @ w_true + noise)
        grad = 2.0 * x.T @ err / BATCH
        scale = scaler.current_scale() if args.mode != "functional" else state.scale
        with np.errstate(over="ignore"):  # a float16 overflow is the point: it gives inf
            g16 = {"w": (grad * np.float32(scale)).astype(np.float16)}
        if victim == rank:
            g16["w"][where] = bad

        if args.mode == "functional":
            g16, local = sc.unscale(g16, state)
            found = reduce_found(local, comm)
            skip = bool(found)
        else:
            g16 = scaler.unscale(g16)
            local = scaler.found_non_finite
            skip = scaler.should_skip_step()
        local_flags.append(bool(local))
        decisions.append(skip)

        g = g16["w"].astype(np.float32)
        comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)  # every rank, every step
        if not skip:
            m = np.float32(0.9) * m + g / np.float32(size)
            w = w - np.float32(LR) * m
        state = sc.update(state, found) if args.mode == "functional" else scaler.update()
        fingerprints.append(fingerprint(state, {"w": w, "m": m}))

        if args.mode != "local" and step % 50 == 49:
            check_consistent(state, comm, params={"w": w, "m": m})
            checks += 1

    try:
        check_consistent(state, comm, params={"w": w, "m": m})
    except sc.ReplicaMismatchError as exc:
        mismatch = {"message": str(exc), "groups": exc.groups, "differences": list(exc.differences)}

report = {
    "decisions": decisions,
    "local_flags": local_flags,
    "fingerprints": fingerprints,
    "state": sc.to_dict(state),
    "w": w.tobytes().hex(),
    "w_finite": bool(np.isfinite(w).all()),
    "checks": checks,
    "mismatch": mismatch,
}
gathered = comm.gather(report, root=0)
if rank == 0:
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"size": size, "injected": injected, "ranks": gathered}, f)
