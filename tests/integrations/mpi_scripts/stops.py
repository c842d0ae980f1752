"""Run under mpiexec: rank 1 runs out of data after 3 steps and leaves its loop early.

A classic hang of data-parallel jobs (uneven data shards): the other ranks wait for rank 1 in
the next step's reduction. With ``--timeout S`` the reduction waits at most S seconds and raises
ReplicaTimeoutError, which ``abort_on_error`` turns into an abort of the whole job.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import scaler_core as sc
from scaler_core.mpi import abort_on_error, found_reducer

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, required=True)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
scaler = sc.LossScaler(reduce_found=found_reducer(comm, timeout=args.timeout))
batches = 3 if rank == 1 else 1000

with abort_on_error(comm):
    for _ in range(batches):
        scaler.unscale([np.ones(4, np.float32)])
        scaler.should_skip_step()
        scaler.update()
print(f"rank {rank} finished {scaler.state.steps} steps", flush=True)
if rank == 1:
    # Rank 1 stays alive (as if evaluating) instead of exiting: the test is about the others'
    # bounded wait. An exiting rank would let mpiexec end the job on its own schedule, racing
    # the timeout and making the messages this test checks nondeterministic.
    time.sleep(30)
