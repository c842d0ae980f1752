"""Data-parallel mixed-precision training with NumPy and MPI: one skip decision for all replicas.

Run with:  mpiexec -n 4 python examples/mpi_data_parallel.py

Every process holds a replica of a linear model and trains on its own data. Each unscales and
checks its *own* float16 gradients, so an overflow on one replica is seen only there; the found
flag is OR-reduced across the replicas (one 1-byte MPI_Allreduce per step) so that all of them
skip that step together. Rank 2 injects an inf every 50 steps to show it.
"""

import numpy as np
from mpi4py import MPI

import scaler_core as sc
from scaler_core.mpi import abort_on_error, check_consistent, found_reducer

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

w_true = np.random.default_rng(0).standard_normal(8).astype(np.float32)  # same on every rank
w = np.zeros(8, np.float32)  # the replicated parameters
data = np.random.default_rng(1 + rank)  # each rank its own data shard

scaler = sc.LossScaler(
    sc.ScalerConfig(init_scale=2.0**10, growth_interval=20),
    reduce_found=found_reducer(comm),  # OR the found flag across the replicas
)

with abort_on_error(comm):  # an exception on one rank ends the job instead of hanging it
    for step in range(200):
        x = data.standard_normal((32, 8)).astype(np.float32)
        err = x @ w - x @ w_true
        # The backward pass of the scaled loss, with float16 gradients.
        grads = {"w": (2 * x.T @ err / len(x) * scaler.current_scale()).astype(np.float16)}
        if rank == size - 1 and step % 50 == 7:
            grads["w"][0] = np.inf  # an overflow on one replica only
        grads = scaler.unscale(grads)  # local check, in place
        g = grads["w"].astype(np.float32)
        comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)  # average the gradients
        if not scaler.should_skip_step():  # the same answer on every rank
            w -= 0.05 * g / size
        scaler.update()

    digest = check_consistent(scaler.state, comm, params={"w": w})  # raises if replicas differ

if rank == 0:
    state = scaler.state
    print(f"{size} replicas agree: fingerprint {digest}")
    print(f"steps={state.steps} skipped={state.skipped_steps} scale={state.scale}")
    print(f"max |w - w_true| = {np.abs(w - w_true).max():.2e}")
