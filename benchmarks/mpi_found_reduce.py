"""What one skip decision across MPI replicas costs, side by side.

Run with:  mpiexec -n 4 python benchmarks/mpi_found_reduce.py

Per call, median over interleaved rounds (every contender runs once per round, in turn, so
drift hits all of them alike): ``reduce_found`` against the bare 1-byte ``MPI_Allreduce``
it wraps and the pickle-based ``comm.allreduce``; ``check_consistent`` on the state alone and
with a 4 MB parameter tree; ``fingerprint`` alone. Rank 0 prints the table.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import scaler_core as sc
from scaler_core.mpi import check_consistent, fingerprint, reduce_found

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
state = sc.update(sc.init(), True)
params = {"w": np.ones((1024, 1024), np.float32)}
flag = np.bool_(rank == size - 1)
buf = np.zeros(1, np.uint8)


def bare() -> None:
    buf[0] = flag
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.LOR)


CONTENDERS: dict[str, tuple[Callable[[], object], int]] = {
    "MPI_Allreduce, 1 byte (bare)": (bare, 200),
    "reduce_found": (lambda: reduce_found(flag, comm), 200),
    "comm.allreduce (pickle)": (lambda: comm.allreduce(bool(flag), op=MPI.LOR), 200),
    "check_consistent(state)": (lambda: check_consistent(state, comm), 200),
    "fingerprint(state)": (lambda: fingerprint(state), 200),
    "check_consistent(state, 4 MB params)": (lambda: check_consistent(state, comm, params), 5),
}
times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
for _ in range(3):  # warm-up
    for fn, _n in CONTENDERS.values():
        fn()
for _round in range(15):
    for name, (fn, n) in CONTENDERS.items():
        comm.Barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times[name].append((time.perf_counter() - start) / n)

medians = {name: statistics.median(t) for name, t in times.items()}
everyone = comm.gather(medians, root=0)
if rank == 0:
    base = max(m["MPI_Allreduce, 1 byte (bare)"] for m in everyone)
    print(f"{size} ranks, MPI: {MPI.Get_library_version().splitlines()[0].strip()}")
    print(f"{platform.processor() or platform.machine()}, {platform.python_version()}")
    print(f"{'contender':40s} {'median us (slowest rank)':>26s} {'x bare':>8s}")
    for name in CONTENDERS:
        slowest = max(m[name] for m in everyone)
        print(f"{name:40s} {slowest * 1e6:26.1f} {slowest / base:8.2f}")
