"""Run under mpiexec: rank 1 raises ScaleCollapseError while the others go on to the next step.

Rank 1 starts from a scale at the float32 floor, so the first skipped step collapses it; the
others would then wait forever in the next step's collective. With ``--guard`` the loop runs
inside ``abort_on_error(comm)``, which aborts the job.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib

import numpy as np
from mpi4py import MPI

import scaler_core as sc
from scaler_core.mpi import abort_on_error, found_reducer

parser = argparse.ArgumentParser()
parser.add_argument("--guard", action="store_true")
parser.add_argument("--marker", help="file to create when this rank raises (without --guard)")
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
config = sc.ScalerConfig(init_scale=2.0**-126 if rank == 1 else 2.0**16)
scaler = sc.LossScaler(config, reduce_found=found_reducer(comm))

guard = abort_on_error(comm) if args.guard else contextlib.nullcontext()
try:
    with guard:
        for step in range(1000):
            grads = [np.ones(4, np.float32)]
            if step == 3 and rank == 0:
                grads[0][0] = np.inf  # one overflow, OR-ed to every rank: all of them back off
            scaler.unscale(grads)
            scaler.should_skip_step()
            scaler.update()  # rank 1: ScaleCollapseError at step 3
except sc.ScaleCollapseError:
    if args.marker:
        pathlib.Path(args.marker).write_text(f"rank {rank} raised", encoding="utf-8")
    raise
print(f"rank {rank} finished")
