"""MPI integration: one skip decision for every replica, and a check that they agree.

Data-parallel replicas must all skip a step or all take it. When each replica
checks different data (its own gradients before averaging them, or only its
shard of them as in ZeRO/FSDP), a NaN on one replica makes that replica skip
while the others step: their parameters and scaler states silently diverge, or
they hang in the next collective. :func:`reduce_found` OR-reduces the found
flag across a communicator with one small ``MPI_Allreduce`` (one byte,
``MPI.LOR``) per step, so every replica takes the same decision;
:func:`found_reducer` plugs it into :class:`scaler_core.LossScaler`. (The same
two names exist in :mod:`scaler_core.jax` and :mod:`scaler_core.cupy`.)

:func:`fingerprint` digests a state (its config and every field) and,
optionally, a parameter tree; :func:`check_consistent` compares the digests of
every replica with one ``MPI_Allgather`` of 16 bytes and raises
:class:`~scaler_core.ReplicaMismatchError`, on every replica at once, naming the
ranks that disagree and what differs.

A replica that raises while the others wait in a collective would leave them
waiting forever (MPI has no timeout). :func:`abort_on_error` wraps the training
loop: on an exception it prints the error with the rank to stderr and calls
``comm.Abort()``, which ends every process of the job with a nonzero exit code.
A replica that stops without raising (out of data first, or stuck in another
collective) is caught by ``timeout=``: the waiting replicas raise
:class:`~scaler_core.ReplicaTimeoutError`, which the guard turns into the same
abort.

mpi4py is imported only inside the functions that talk to MPI (importing this
module never imports it); the communicator is always passed in. Install with
``pip install "scaler-core[mpi]"`` (mpi4py and the ``mpich`` wheel: no system
MPI needed) and launch with ``mpiexec -n 4 python train.py``.

>>> from scaler_core import ScalerConfig, init, update
>>> a, b = init(), init()
>>> fingerprint(a) == fingerprint(b)
True
>>> fingerprint(update(a, True)) == fingerprint(b)
False
>>> fingerprint(init(ScalerConfig(growth_interval=100))) == fingerprint(b)
False
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import numbers
import os
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._backend import backend_for
from ._coerce import host_flag
from ._config import ScalerConfig
from ._errors import InvalidArgumentError, ReplicaMismatchError, ReplicaTimeoutError
from ._state import DATA_FIELDS, FLOAT_FIELDS, ScalerState
from ._tree import leaves_with_paths

#: Polls of a bounded wait before it starts sleeping between polls.
_SPINS = 64
#: The largest exit code a process can return.
_MAX_EXIT_CODE = 255
#: Seconds an aborting rank waits for the launcher to forward its error message.
_ABORT_GRACE_S = 0.25

__all__ = [
    "abort_on_error",
    "check_consistent",
    "fingerprint",
    "found_reducer",
    "reduce_found",
]

#: Bytes of a fingerprint digest (SHA-256, truncated); 128 bits make a chance
#: collision between replicas negligible.
DIGEST_SIZE = 16
_DOMAIN = b"scaler_core.fingerprint/2"
#: Config fields added after fingerprints were pinned: encoded only when not default.
_LATER_KNOBS = frozenset({"growth_delay"})
_MPI: Any = None
_buffers = threading.local()
#: Timed-out requests, kept alive with their buffers (MPI may still write to them).
_abandoned: list[tuple[Any, Any]] = []
#: DATA_FIELDS in order, little-endian: each float32 field by its float32 bits
#: (the scale, the norm statistics), each int32 counter as an int64.
_STATE = struct.Struct("<" + "".join("f" if n in FLOAT_FIELDS else "q" for n in DATA_FIELDS))


def _need_comm(comm: Any, *methods: str) -> None:
    missing = [m for m in methods if not callable(getattr(comm, m, None))]
    if missing:
        raise InvalidArgumentError(
            f"comm={comm!r}, but it must be an mpi4py communicator (it has no "
            f"{', '.join(missing)}); pass mpi4py.MPI.COMM_WORLD or a communicator "
            f"derived from it"
        )


def _flag_to_bool(found: Any) -> bool:
    if type(found) is np.bool_ or type(found) is bool:  # the common case, in well under 1 us
        return bool(found)
    flag = host_flag(found)
    if flag is not None:
        return flag
    # A device flag (CuPy, JAX): this is the one host read of the step.
    return backend_for(found).to_bool(found)


def reduce_found(found: Any, comm: Any, *, timeout: float | None = None) -> np.bool_:
    """OR a found-non-finite flag across every process of ``comm``.

    One ``MPI_Allreduce`` of one byte with ``MPI.LOR``: the result is true on
    every process if the flag was true on any. Every process of ``comm`` must
    call it once per step, in the same order as its other collectives.

    Args:
        found: This process's flag: a bool, a NumPy bool, or a 0-d boolean
            device array (read to the host first).
        comm: An mpi4py communicator (``MPI.COMM_WORLD``, or a sub-communicator
            holding exactly the data-parallel replicas).
        timeout: ``None`` (the default) waits as long as MPI does, i.e. for
            ever if a rank never joins. A number of seconds makes the wait
            bounded: the reduction runs as ``MPI_Iallreduce`` polled with
            ``MPI_Test`` (spinning first, then sleeping up to 1 ms between
            polls), and :class:`~scaler_core.ReplicaTimeoutError` is raised if
            some rank has not joined by then.

    Returns:
        The OR over all processes, as a NumPy bool (a host flag that
        :func:`scaler_core.update` and :class:`scaler_core.LossScaler` accept).

    Raises:
        InvalidArgumentError: ``comm`` is not a communicator, or ``timeout`` is
            not ``None`` or a positive, finite number of seconds.
        GradientTypeError: ``found`` is not a boolean flag.
        ReplicaTimeoutError: ``timeout`` passed before every rank joined. The
            communicator is unusable afterwards: abort the job
            (:func:`abort_on_error` does so when the error reaches it).

    Example (under ``mpiexec``)::

        grads, found = scaler_core.unscale(grads, state)
        found = reduce_found(found, MPI.COMM_WORLD)
        if not found:
            params -= lr * grads
        state = scaler_core.update(state, found)
    """
    _need_comm(comm, "Allreduce", *(() if timeout is None else ("Iallreduce",)))
    return _allreduce_or(_flag_to_bool(found), comm, _need_timeout(timeout))


def _need_timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not 0 < float(timeout) < math.inf
    ):
        raise InvalidArgumentError(
            f"timeout={timeout!r}, but it must be None (wait as long as MPI does) or a "
            f"positive, finite number of seconds"
        )
    return float(timeout)


def _allreduce_or(flag: bool, comm: Any, timeout: float | None) -> np.bool_:
    mpi = _mpi()
    # One buffer per thread, reused: a fresh buffer each step cost MPICH ~15 us more per
    # call (measured with 2 ranks here), more than the rest of this function.
    buf = _buffers.__dict__.get("flag")
    if buf is None:
        buf = _buffers.flag = np.zeros(1, dtype=np.uint8)
    buf[0] = flag
    if timeout is None:
        comm.Allreduce(mpi.IN_PLACE, buf, op=mpi.LOR)
    else:
        request = comm.Iallreduce(mpi.IN_PLACE, buf, op=mpi.LOR)
        if not _wait(request, timeout):
            # MPI cannot cancel a collective: the request (and the buffer it writes to)
            # must outlive this call, and this thread gets a fresh buffer next time.
            _abandoned.append((request, buf))
            _buffers.flag = None
            rank, size = comm.Get_rank(), comm.Get_size()
            raise ReplicaTimeoutError(
                f"rank {rank} of {size} waited timeout={timeout!r} s for the other ranks to "
                f"join the found-flag reduction; at least one has stopped (it raised, left "
                f"its training loop early, e.g. on uneven data shards, or waits in another "
                f"collective). The communicator is unusable now: abort the job "
                f"(abort_on_error(comm) does it) and look at the other ranks' output."
            )
    return np.bool_(buf[0] != 0)


def _wait(request: Any, timeout: float) -> bool:
    """Poll ``request`` until it completes (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    spins, pause = 0, 0.0
    while not request.Test():
        spins += 1
        if spins > _SPINS:  # a healthy step completes while spinning; then stop burning a core
            if time.monotonic() >= deadline:
                return False
            pause = min(max(2 * pause, 1e-5), 1e-3)
            time.sleep(pause)
    return True


def _mpi() -> Any:
    global _MPI  # noqa: PLW0603 - imported on first use so importing scaler_core never does
    if _MPI is None:
        from mpi4py import MPI  # noqa: PLC0415

        _MPI = MPI
    return _MPI


def found_reducer(comm: Any, *, timeout: float | None = None) -> Callable[[Any], np.bool_]:
    """A ``reduce_found`` hook for :class:`scaler_core.LossScaler` over ``comm``.

    The facade calls it once per step, on the OR of the local gradient groups,
    before the skip decision::

        scaler = LossScaler(reduce_found=found_reducer(MPI.COMM_WORLD))

    Args:
        comm: An mpi4py communicator holding the data-parallel replicas.
        timeout: Bound on each wait, in seconds (see :func:`reduce_found`).

    Returns:
        ``found -> reduce_found(found, comm, timeout=timeout)``.

    Raises:
        InvalidArgumentError: ``comm`` is not a communicator, or ``timeout`` is
            invalid (checked now, not at the first step).
    """
    _need_comm(comm, "Allreduce", *(() if timeout is None else ("Iallreduce",)))
    seconds = _need_timeout(timeout)

    def reduce(found: Any) -> np.bool_:
        return _allreduce_or(_flag_to_bool(found), comm, seconds)

    return reduce


# ------------------------------------------------------------------ fingerprints
def _canonical(value: object) -> bytes:
    # Floats as their exact hex form: repr() would do too, but hex is defined
    # identically everywhere and cannot round.
    if isinstance(value, float):
        return b"f" + value.hex().encode()
    if value is None or isinstance(value, (bool, int, str)):
        return type(value).__name__.encode() + b":" + repr(value).encode()
    raise InvalidArgumentError(
        f"cannot fingerprint {value!r}"
    )  # pragma: no cover - config fields only


def _host_fields(state: ScalerState) -> dict[str, float | int]:
    """The data fields as Python scalars, without raising a recorded failure."""
    return {
        name: (float if name in FLOAT_FIELDS else int)(getattr(state, name)) for name in DATA_FIELDS
    }


def _leaf(path: str, leaf: Any) -> tuple[np.ndarray, bytes, memoryview]:
    """``(array, header, data)``: the leaf as an array, its dtype and shape, its bytes.

    ``data`` is a byte view of a little-endian, C-contiguous version of the
    array (no copy for the usual native little-endian contiguous arrays), so the
    same values give the same bytes on every platform and for every layout.
    """
    array = np.asarray(leaf)
    if array.dtype.hasobject:
        raise InvalidArgumentError(
            f"{path} has dtype object, but fingerprint() needs numeric arrays; pass only "
            f"the parameter arrays"
        )
    array = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False))
    header = f"{array.dtype.str}|{array.shape}".encode()
    return array, header, array.reshape(-1).view(np.uint8).data


def _param_leaves(params: Any) -> list[tuple[str, Any]]:
    # Sorted by path, so two replicas that built the same dict in a different
    # insertion order still agree.
    return sorted(leaves_with_paths(params, "params"), key=lambda item: item[0])


def _need_state(state: object) -> ScalerState:
    if not isinstance(state, ScalerState):
        raise InvalidArgumentError(
            f"state={state!r}, but it must be a ScalerState (LossScaler.state, or the "
            f"state returned by scaler_core.update)"
        )
    return state


@functools.lru_cache(maxsize=64)
def _config_bytes(config: ScalerConfig) -> bytes:
    """The config's canonical encoding (configs are frozen, so it is computed once).

    A knob added later is encoded only when it differs from its default (as
    checkpoints write it), so every fingerprint of a config without it stays the one
    an earlier scaler-core computes.
    """
    return b"".join(
        b"\0config." + f.name.encode() + b"=" + _canonical(getattr(config, f.name))
        for f in dataclasses.fields(config)
        if f.name not in _LATER_KNOBS or getattr(config, f.name) != f.default
    )


def _digest(state: ScalerState, params: Any) -> bytes:
    # SHA-256 (truncated): hardware-accelerated on current x86 and ARM CPUs, about twice
    # BLAKE2b's speed here, which matters when parameters are hashed too.
    h = hashlib.sha256(_DOMAIN)
    h.update(_config_bytes(state.config))
    # Float fields by their float32 bits (a state is float32 by contract), counters as int64.
    h.update(_STATE.pack(*_host_fields(state).values()))
    if params is not None:
        for path, leaf in _param_leaves(params):
            _, header, data = _leaf(path, leaf)
            h.update(b"\0" + path.encode() + b"=" + header + len(data).to_bytes(8, "little"))
            h.update(data)
    return h.digest()[:DIGEST_SIZE]


def fingerprint(state: ScalerState, params: Any = None) -> str:
    """A short, deterministic digest of a state (and optionally parameters).

    Covers every config field and every state field (scale, trackers,
    counters, spike-window statistics, last step kind, recorded failure);
    equal states give equal fingerprints in every process, on every platform
    and Python version (no ``hash()`` salt, no pickle). A device state is read
    to the host. ``params`` (a tree of arrays:
    dicts, lists, tuples) adds each leaf's path, dtype, shape and bytes, so
    "bit-identical parameters" is part of the comparison; hashing reads every
    byte once, so pass parameters only to occasional checks.

    Args:
        state: A :class:`ScalerState`, host or device.
        params: Optional tree of NumPy arrays (or array-likes ``numpy.asarray``
            accepts). Leaves are taken in sorted path order.

    Returns:
        32 hexadecimal characters (128 bits of SHA-256).

    Raises:
        InvalidArgumentError: ``state`` is not a ScalerState, or a parameter leaf
            is an object array.

    >>> from scaler_core import init
    >>> import numpy as np
    >>> len(fingerprint(init()))
    32
    >>> w = np.zeros(3, np.float32)
    >>> fingerprint(init(), {"w": w}) == fingerprint(init(), {"w": w.copy()})
    True
    >>> fingerprint(init(), {"w": w}) == fingerprint(init(), {"w": -w})  # -0.0 != 0.0 bitwise
    False
    """
    return _digest(_need_state(state), params).hex()


# ------------------------------------------------------------- consistency check
def _describe(state: ScalerState, params: Any) -> dict[str, object]:
    """What a replica holds, field by field (only gathered on a mismatch)."""
    out: dict[str, object] = {
        f"config.{f.name}": getattr(state.config, f.name) for f in dataclasses.fields(state.config)
    }
    out.update({f"state.{name}": value for name, value in _host_fields(state).items()})
    if params is not None:
        for path, leaf in _param_leaves(params):
            array, header, data = _leaf(path, leaf)
            h = hashlib.sha256(header)
            h.update(data)
            digest = h.hexdigest()[:16]
            out[path] = f"{array.dtype.name}{list(array.shape)} with digest {digest}"
    return out


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"ranks 0-2, 5"``, so a thousand ranks stay readable."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _mismatch(digests: list[bytes], described: list[dict[str, object]]) -> ReplicaMismatchError:
    groups: dict[bytes, list[int]] = {}
    for rank, digest in enumerate(digests):
        groups.setdefault(digest, []).append(rank)
    ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
    keys = list(described[0])
    for d in described[1:]:
        keys.extend(k for k in d if k not in keys)
    differences: dict[str, dict[int, object]] = {}
    lines: list[str] = []
    for key in keys:
        values = {rank: d.get(key, "<missing>") for rank, d in enumerate(described)}
        by_value: dict[str, list[int]] = {}
        for rank, value in values.items():
            # Parameter descriptions are already text; config and state values are shown
            # as Python literals.
            text = value if key.startswith("params") and isinstance(value, str) else repr(value)
            by_value.setdefault(text, []).append(rank)
        if len(by_value) > 1:
            differences[key] = values
            shown = "; ".join(f"{v} on {_ranks(r)}" for v, r in by_value.items())
            lines.append(f"  {key}: {shown}")
    summary = " | ".join(_ranks(g) for g in ordered)
    if not lines:  # pragma: no cover - a digest differs, so some described value does
        lines.append("  (the digests differ but no summarised field does)")
    message = (
        f"data-parallel replicas disagree: {len(ordered)} groups hold different scaler "
        f"states or parameters ({summary}). What differs:\n"
        + "\n".join(lines)
        + "\nEvery replica must take the same skip decision each step: OR-reduce the found "
        "flag (LossScaler(reduce_found=found_reducer(comm)) or reduce_found(found, "
        "comm)), and start every replica from the same checkpoint and initial parameters."
    )
    return ReplicaMismatchError(message, ordered, differences)


def check_consistent(state: ScalerState, comm: Any, params: Any = None) -> str:
    """Check that every process of ``comm`` holds the same state (and parameters).

    A collective: every process of ``comm`` must call it at the same point.
    The common case costs one ``MPI_Allgather`` of a 16-byte digest (plus
    hashing ``params`` if given). On a mismatch a second, small gather collects
    a field-by-field description, and every process raises the same error, so
    none is left waiting.

    Args:
        state: This process's :class:`ScalerState` (``LossScaler.state``).
        comm: An mpi4py communicator holding the data-parallel replicas.
        params: Optional tree of parameter arrays that must also be
            bit-identical across replicas (see :func:`fingerprint`).

    Returns:
        The common fingerprint.

    Raises:
        ReplicaMismatchError: Some process differs. The message lists the groups
            of ranks that agree and, for every differing config field, state
            field or parameter leaf, which value each rank holds; the error's
            ``groups`` and ``differences`` hold the same data.
        InvalidArgumentError: ``comm`` is not a communicator, or ``state`` is not
            a ScalerState.

    Example (under ``mpiexec``)::

        if step % 100 == 0:
            check_consistent(scaler.state, MPI.COMM_WORLD, params=params)
    """
    _need_comm(comm, "Allgather", "allgather", "Get_size")
    mine = _digest(_need_state(state), params)
    size = comm.Get_size()
    send = np.frombuffer(mine, dtype=np.uint8)
    recv = np.empty((size, DIGEST_SIZE), dtype=np.uint8)
    comm.Allgather(send, recv)
    digests = [row.tobytes() for row in recv]
    if all(d == mine for d in digests):
        return mine.hex()
    # Every process saw the same gathered digests, so all of them take this
    # branch together and the second collective cannot hang.
    described = comm.allgather(_describe(state, params))
    raise _mismatch(digests, described)


# ---------------------------------------------------------------- error handling
@contextlib.contextmanager
def abort_on_error(comm: Any, errorcode: int = 1) -> Iterator[None]:
    """End the whole MPI job if this process raises, instead of hanging the others.

    An exception on one process (a :class:`~scaler_core.ScaleCollapseError`, a
    bad batch, a bug) otherwise leaves every other process blocked in its next
    collective forever: MPI collectives have no timeout, and a Python process
    that exits normally does not stop the others. Inside this block an
    exception (or ``KeyboardInterrupt``) is printed to stderr with the rank,
    then ``comm.Abort(errorcode)`` terminates every process of the job; the
    launcher (``mpiexec``) exits nonzero. ``sys.exit(0)`` passes through
    untouched. If ``MPI_Abort`` returns (MPICH does once another rank has
    finalized), the process ends at once with ``os._exit(errorcode)``.
    (``python -m mpi4py train.py`` gives the same abort for uncaught
    exceptions of a whole script.)

    Args:
        comm: The communicator to abort (``MPI.COMM_WORLD`` ends the job).
        errorcode: The exit code passed to ``MPI_Abort`` (1..255).

    Raises:
        InvalidArgumentError: ``comm`` is not a communicator, or ``errorcode``
            is not an int in 1..255 (checked on entry).

    Example (under ``mpiexec``)::

        with abort_on_error(MPI.COMM_WORLD):
            for step in range(steps):
                train_step()
    """
    _need_comm(comm, "Abort", "Get_rank", "Get_size")
    if (
        isinstance(errorcode, bool)
        or not isinstance(errorcode, int)
        or not 1 <= errorcode <= _MAX_EXIT_CODE
    ):
        raise InvalidArgumentError(
            f"errorcode={errorcode!r}, but it must be an int in [1, 255] (a nonzero exit code)"
        )
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise
        _abort(comm, errorcode, exc)
        raise
    except BaseException as exc:
        _abort(comm, errorcode, exc)
        raise  # only reached if Abort returned (it does not under a real MPI)


def _abort(comm: Any, errorcode: int, exc: BaseException) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stderr.write(
        f"{text}scaler_core.mpi.abort_on_error: rank {rank} of {size} raised "
        f"{type(exc).__name__} (traceback above); calling comm.Abort({errorcode}) so the "
        f"other ranks do not wait forever in their next collective\n"
    )
    sys.stdout.flush()
    sys.stderr.flush()
    # The launcher forwards each rank's stderr asynchronously and an abort tears the
    # forwarding down: give it a moment, or the one message that explains the abort can
    # be lost (seen with MPICH's hydra when two ranks abort at once).
    time.sleep(_ABORT_GRACE_S)
    comm.Abort(errorcode)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(comm, mpi.Comm):
        # MPI_Abort returned: MPICH does so once another rank has finalized, and the
        # launcher kills this process a moment later. Exit now rather than unwind into
        # interpreter shutdown (a second traceback, then MPI_Finalize at exit).
        os._exit(errorcode)
