"""Run under mpiexec (3 processes): the exact semantics of the MPI helpers.

Rank 0 writes the results of every case to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
from mpi4py import MPI

import scaler_core as sc
from scaler_core.mpi import check_consistent, found_reducer, reduce_found

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
out: dict[str, object] = {"size": size}

# Truth table of the OR, for every pattern of local flags, as every flag type we accept.
kinds = {
    "bool": lambda b: b,
    "numpy_bool": np.bool_,
    "0d_array": np.array,
}
table = []
for pattern in itertools.product([False, True], repeat=size):
    for kind, make in kinds.items():
        got = reduce_found(make(pattern[rank]), comm)
        got_type = f"{type(got).__module__}.{type(got).__name__}"
        table.append([list(pattern), kind, got_type, bool(got)])
    # The bounded wait (MPI_Iallreduce polled with MPI_Test) computes the same OR.
    got = reduce_found(pattern[rank], comm, timeout=30.0)
    got_type = f"{type(got).__module__}.{type(got).__name__}"
    table.append([list(pattern), "bool, timeout", got_type, bool(got)])
out["table"] = table

# The LossScaler hook: one reduction per step, whatever the number of groups and queries.
calls = []
reduce = found_reducer(comm)


def counting(found: object) -> np.bool_:
    calls.append(1)
    return reduce(found)


scaler = sc.LossScaler(reduce_found=counting)
g = [np.array([1.0, np.inf if rank == 1 else 2.0], np.float32)]
scaler.unscale(g, group="a")
scaler.unscale([np.ones(2, np.float32)], group="b")
out["facade"] = {
    "local": bool(scaler.found_non_finite),
    "skip": scaler.should_skip_step(),
    "skip_again": scaler.should_skip_step(),
    "stepped": scaler.step(lambda: "stepped"),
    "state": sc.to_dict(scaler.update()),
    "calls": len(calls),
}

# A bad flag is refused before the collective, on every rank: nobody is left waiting.
try:
    reduce_found(1, comm)
    out["bad_flag"] = None
except sc.GradientTypeError as exc:
    out["bad_flag"] = str(exc)

# check_consistent: agreement returns the common fingerprint...
params = {"w": np.arange(4, dtype=np.float32)}
out["agree"] = check_consistent(sc.init(), comm, params=params)

# ...a different state on the last rank raises on every rank, naming it...
state = sc.init()
if rank == size - 1:
    state = sc.update(sc.init(sc.ScalerConfig(growth_interval=7)), True)
try:
    check_consistent(state, comm)
    out["state_mismatch"] = None
except sc.ReplicaMismatchError as exc:
    out["state_mismatch"] = {
        "message": str(exc),
        "groups": exc.groups,
        "differences": {k: {str(r): v for r, v in d.items()} for k, d in exc.differences.items()},
    }

# ...and parameters that differ by one bit are caught even when the states agree.
if rank == 0:
    params["w"][3] = np.nextafter(params["w"][3], np.float32(10))
try:
    check_consistent(sc.init(), comm, params=params)
    out["param_mismatch"] = None
except sc.ReplicaMismatchError as exc:
    out["param_mismatch"] = {
        "message": str(exc),
        "groups": exc.groups,
        "keys": list(exc.differences),
    }

gathered = comm.gather(out, root=0)
if rank == 0:
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(gathered, f)
