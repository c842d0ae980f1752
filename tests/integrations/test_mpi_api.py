"""scaler_core.mpi without MPI: fingerprints, the mismatch report, input checks, the guard.

``check_consistent`` runs here over an in-process communicator whose "ranks" are threads meeting
at a barrier (the same collective semantics as MPI's Allgather); the real MPI runs are in
test_mpi.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core.mpi import (
    _wait,  # the polling loop behind timeout=
    abort_on_error,
    check_consistent,
    fingerprint,
    found_reducer,
    reduce_found,
)


def test_importing_scaler_core_mpi_never_imports_mpi4py() -> None:
    code = "import sys, scaler_core.mpi; print('mpi4py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_replica_mismatch_error_is_a_scaler_error_and_a_runtime_error() -> None:
    assert issubclass(sc.ReplicaMismatchError, sc.ScalerError)
    assert issubclass(sc.ReplicaMismatchError, RuntimeError)
    exc = sc.ReplicaMismatchError("x")
    assert exc.groups == []
    assert exc.differences == {}


# ------------------------------------------------------------------ fingerprints
#: Pinned digests: the encoding is part of the contract (equal states give equal fingerprints
#: on every platform and Python version), so a change here must bump the "fingerprint/N" domain.
#: (Re-pinned when ScalerConfig gained at_max_scale: every config field is digested; and with
#: the domain bumped to "fingerprint/2" when the state gained spike skipping's fields.)
GOLDEN = {
    "init": "bdc2b1631aad2436f3bab9ff5ece5120",
    "backed_off_with_params": "4a87af5fab8cf2b1775a8bbed1c2189b",
}
GOLDEN_CODE = textwrap.dedent(
    """
    import numpy as np, scaler_core as sc
    from scaler_core.mpi import fingerprint
    print(fingerprint(sc.init()))
    state = sc.update(sc.init(sc.ScalerConfig(min_scale=1.0, hysteresis=2)), True)
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": [np.float64(-0.0), None]}
    print(fingerprint(state, params))
    """
)


@pytest.mark.parametrize("hashseed", ["0", "12345"])
def test_fingerprint_is_pinned_and_independent_of_hash_randomisation(hashseed: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", GOLDEN_CODE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": hashseed},
    )
    assert out.stdout.split() == [GOLDEN["init"], GOLDEN["backed_off_with_params"]]


def _field_variants(state: sc.ScalerState) -> list[tuple[str, sc.ScalerState]]:
    """The state with one field changed at a time (each change keeps the state plausible)."""
    out = [
        ("scale", dataclasses.replace(state, scale=state.scale * 2)),
        ("growth_tracker", dataclasses.replace(state, growth_tracker=state.growth_tracker + 1)),
        (
            "hysteresis_tracker",
            dataclasses.replace(state, hysteresis_tracker=state.hysteresis_tracker + 1),
        ),
        ("steps", dataclasses.replace(state, steps=state.steps + 1)),
        ("skipped_steps", dataclasses.replace(state, skipped_steps=state.skipped_steps + 1)),
        (
            "consecutive_skips",
            dataclasses.replace(state, consecutive_skips=state.consecutive_skips + 1),
        ),
        ("failure", dataclasses.replace(state, failure=int(sc.Failure.COLLAPSE))),
        ("norm_mean", dataclasses.replace(state, norm_mean=1.5)),
        ("norm_var", dataclasses.replace(state, norm_var=0.25)),
        ("norm_count", dataclasses.replace(state, norm_count=state.norm_count + 1)),
        ("last_kind", dataclasses.replace(state, last_kind=sc.StepKind.SPIKE_SKIP.code)),
    ]
    cfg = state.config
    config_changes: dict[str, Any] = {
        "init_scale": cfg.init_scale * 2,
        "growth_factor": 4.0,
        "backoff_factor": 0.25,
        "growth_interval": cfg.growth_interval + 1,
        "min_scale": 1.0,
        "max_scale": 2.0**30,
        "hysteresis": 3,
        "hysteresis_refill": "on_clean_step",
        "at_max_scale": "clamp",
        "max_consecutive_skips": 5,
        "dynamic": False,
        "spike_threshold": 3.0,
        "spike_window": 64,
        "growth_delay": 1,
    }
    for name, value in config_changes.items():
        out.append(
            (
                f"config.{name}",
                dataclasses.replace(state, config=dataclasses.replace(cfg, **{name: value})),
            )
        )
    min_cfg = dataclasses.replace(cfg, min_scale=1.0)
    out.append(
        (
            "config.at_min_scale",
            dataclasses.replace(state, config=dataclasses.replace(min_cfg, at_min_scale="raise")),
        )
    )
    return out


def test_every_field_and_config_knob_changes_the_fingerprint() -> None:
    state = sc.update(sc.update(sc.init(sc.ScalerConfig(growth_interval=10)), False), True)
    variants = _field_variants(state)
    covered = {name for name, _ in variants}
    assert covered >= set(sc.ScalerState.__dataclass_fields__) - {"config"}
    assert covered >= {f"config.{f.name}" for f in dataclasses.fields(sc.ScalerConfig)}
    digests = {name: fingerprint(v) for name, v in variants}
    base = fingerprint(state)
    assert base not in digests.values()
    assert len(set(digests.values())) == len(digests)  # also pairwise distinct


def test_equal_states_agree_whatever_their_representation() -> None:
    state = sc.init(sc.ScalerConfig(growth_interval=3))
    host = sc.update(sc.update(state, True), False)
    device = sc.device_update(np, sc.device_update(np, state, np.bool_(True)), np.bool_(False))
    assert not device.on_host
    assert fingerprint(device) == fingerprint(host)
    assert fingerprint(host) == fingerprint(sc.from_dict(sc.to_dict(host)))


def test_a_device_state_with_a_recorded_failure_is_fingerprinted_not_raised() -> None:
    tiny = sc.init(sc.ScalerConfig(init_scale=2.0**-126))
    failed = sc.device_update(np, tiny, np.bool_(True))
    assert int(failed.failure) == int(sc.Failure.COLLAPSE)
    assert fingerprint(failed) != fingerprint(tiny)


def test_parameters_are_compared_bit_for_bit() -> None:
    state = sc.init()
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    b = np.zeros(4, np.float32)
    fp = fingerprint(state, {"w": w, "b": b})
    assert fp != fingerprint(state)
    assert fp == fingerprint(state, {"b": b.copy(), "w": w.copy()})  # insertion order is free
    assert fp == fingerprint(state, {"w": np.asfortranarray(w), "b": b})  # memory layout too
    assert fp == fingerprint(state, {"w": w.astype(">f4"), "b": b})  # and byte order
    assert fp == fingerprint(state, {"w": w, "b": b, "frozen": None})  # None leaves are skipped
    one_ulp = w.copy()
    one_ulp[2, 3] = np.nextafter(one_ulp[2, 3], np.float32(2))
    changed = [
        {"w": one_ulp, "b": b},
        {"w": w, "b": -b},  # -0.0 is not 0.0 bitwise
        {"w": w, "b": b.astype(np.float64)},
        {"w": w.reshape(4, 3), "b": b},
        {"w": w, "c": b},
        {"w": w},
    ]
    digests = [fingerprint(state, p) for p in changed]
    assert fp not in digests
    assert len(set(digests)) == len(digests)


def test_every_gradient_dtype_and_scalar_leaves_are_digested() -> None:
    import ml_dtypes

    state = sc.init()
    ones = {
        name: np.ones(3, dtype)
        for name, dtype in [
            ("bf16", ml_dtypes.bfloat16),
            ("f16", np.float16),
            ("f32", np.float32),
            ("f64", np.float64),
        ]
    }
    digests = {fingerprint(state, {"p": a}) for a in ones.values()}
    assert len(digests) == 4  # same values, different dtypes
    scalars = {"step": 3, "lr": 0.5, "ema": np.float32(0.25), "zero_d": np.array(1.0)}
    assert fingerprint(state, scalars) == fingerprint(state, dict(scalars))
    assert fingerprint(state, scalars) != fingerprint(state, {**scalars, "lr": 0.25})


def test_fingerprint_rejects_what_it_cannot_digest() -> None:
    with pytest.raises(sc.InvalidArgumentError, match=r"state=\{'scale': 1\.0\}, but it must be"):
        fingerprint({"scale": 1.0})  # type: ignore[arg-type]
    with pytest.raises(sc.InvalidArgumentError, match=r"params\['w'\] has dtype object"):
        fingerprint(sc.init(), {"w": np.array([object()])})


# ------------------------------------------------------- a communicator of threads
class _World:
    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)
        self.collectives = 0


class ThreadComm:
    """One rank of an in-process world: Allgather/allgather over a barrier, like MPI's."""

    def __init__(self, world: _World, rank: int) -> None:
        self.world, self.rank = world, rank

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.world.size

    def _gather(self, item: Any) -> list[Any]:
        w = self.world
        w.slots[self.rank] = item
        w.barrier.wait()
        out = list(w.slots)
        if self.rank == 0:
            w.collectives += 1
        w.barrier.wait()
        return out

    def Allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        recv[...] = np.stack(self._gather(send.copy()))

    def allgather(self, obj: Any) -> list[Any]:
        return self._gather(obj)


def _run_ranks(
    states: list[sc.ScalerState], params: list[Any] | None = None
) -> tuple[list[Any], int]:
    """check_consistent on every "rank" at once; each rank's result or exception."""
    world = _World(len(states))
    results: list[Any] = [None] * len(states)

    def rank_main(rank: int) -> None:
        try:
            p = None if params is None else params[rank]
            results[rank] = check_consistent(states[rank], ThreadComm(world, rank), p)
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(states))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, world.collectives


def test_agreeing_replicas_pay_one_collective_and_get_the_fingerprint() -> None:
    state = sc.update(sc.init(), True)
    results, collectives = _run_ranks([state] * 5)
    assert results == [fingerprint(state)] * 5
    assert collectives == 1


def test_disagreeing_replicas_all_raise_naming_ranks_and_fields() -> None:
    good = sc.init()
    bad = sc.update(good, True)
    states = [bad if r in (3, 7) else good for r in range(10)]
    results, collectives = _run_ranks(states)
    assert collectives == 2  # the digests, then the description
    assert all(isinstance(r, sc.ReplicaMismatchError) for r in results)
    assert len({str(r) for r in results}) == 1  # every rank reports the same
    exc = results[0]
    assert exc.groups == [[0, 1, 2, 4, 5, 6, 8, 9], [3, 7]]
    assert set(exc.differences) == {
        "state.scale",
        "state.steps",
        "state.skipped_steps",
        "state.consecutive_skips",
        "state.last_kind",
    }
    assert exc.differences["state.scale"] == {
        r: (32768.0 if r in (3, 7) else 65536.0) for r in range(10)
    }
    message = str(exc)
    assert "(ranks 0-2, 4-6, 8-9 | ranks 3, 7)" in message
    assert "state.scale: 65536.0 on ranks 0-2, 4-6, 8-9; 32768.0 on ranks 3, 7" in message
    assert "reduce_found=found_reducer(comm)" in message


def test_disagreeing_parameters_are_named_by_path() -> None:
    w = np.ones(3, np.float32)
    params = [{"w": w, "b": np.zeros(2)} for _ in range(3)]
    params[1] = {"w": w, "b": np.array([0.0, 1e-300])}
    results, _ = _run_ranks([sc.init()] * 3, params)
    exc = results[2]
    assert isinstance(exc, sc.ReplicaMismatchError)
    assert exc.groups == [[0, 2], [1]]
    assert list(exc.differences) == ["params['b']"]
    assert "params['b']: float64[2] with digest " in str(exc)
    assert "on rank 1" in str(exc)


# ------------------------------------------------------------------ input checks
class CountingComm:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def Allreduce(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("Allreduce")


@pytest.mark.parametrize("comm", ["world", None, object(), 0])
def test_a_non_communicator_is_refused_by_name(comm: Any) -> None:
    pattern = rf"comm={comm!r}, but it must be an mpi4py communicator"
    with pytest.raises(sc.InvalidArgumentError, match=pattern):
        reduce_found(True, comm)
    with pytest.raises(sc.InvalidArgumentError, match=pattern):
        found_reducer(comm)
    with pytest.raises(sc.InvalidArgumentError, match=pattern):
        check_consistent(sc.init(), comm)
    with pytest.raises(sc.InvalidArgumentError, match=pattern), abort_on_error(comm):
        pass


@pytest.mark.parametrize("flag", [1, 0.0, None, "yes", np.array([True]), np.int32(1)])
def test_a_bad_flag_is_refused_before_any_collective(flag: Any) -> None:
    comm = CountingComm()
    with pytest.raises(sc.GradientTypeError, match="found_non_finite="):
        reduce_found(flag, comm)
    assert comm.calls == []


# --------------------------------------------------------------------- the guard
class AbortRecorder:
    """Abort returns here (a real MPI_Abort never does), so the guard re-raises."""

    def __init__(self) -> None:
        self.aborted: list[int] = []

    def Get_rank(self) -> int:
        return 2

    def Get_size(self) -> int:
        return 4

    def Abort(self, errorcode: int = 0) -> None:
        self.aborted.append(errorcode)


@pytest.mark.parametrize("exc", [ValueError("bad batch"), KeyboardInterrupt(), SystemExit(3)])
def test_an_exception_aborts_the_communicator(
    exc: BaseException, capsys: pytest.CaptureFixture[str]
) -> None:
    comm = AbortRecorder()
    with pytest.raises(type(exc)), abort_on_error(comm, errorcode=7):
        raise exc
    assert comm.aborted == [7]
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert f"rank 2 of 4 raised {type(exc).__name__}" in err
    assert "comm.Abort(7)" in err


@pytest.mark.parametrize("code", [None, 0])
def test_a_clean_exit_and_a_clean_block_do_not_abort(code: int | None) -> None:
    comm = AbortRecorder()
    with pytest.raises(SystemExit), abort_on_error(comm):
        sys.exit(code)
    with abort_on_error(comm):
        pass
    assert comm.aborted == []


@pytest.mark.parametrize("errorcode", [0, 256, -1, True, 1.0])
def test_abort_errorcode_must_be_a_nonzero_exit_code(errorcode: Any) -> None:
    with (
        pytest.raises(sc.InvalidArgumentError, match=rf"errorcode={errorcode!r}, but it must be"),
        abort_on_error(AbortRecorder(), errorcode=errorcode),
    ):
        pass


# ------------------------------------------------------------------ bounded wait
def test_replica_timeout_error_is_a_scaler_error_and_a_timeout_error() -> None:
    assert issubclass(sc.ReplicaTimeoutError, sc.ScalerError)
    assert issubclass(sc.ReplicaTimeoutError, TimeoutError)


class IallreduceComm(CountingComm):
    def Iallreduce(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("Iallreduce")


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_a_bad_timeout_is_refused_by_name_before_any_collective(timeout: Any) -> None:
    comm = IallreduceComm()
    pattern = rf"timeout={timeout!r}, but it must be None .* or a positive, finite number"
    with pytest.raises(sc.InvalidArgumentError, match=pattern):
        reduce_found(True, comm, timeout=timeout)
    with pytest.raises(sc.InvalidArgumentError, match=pattern):
        found_reducer(comm, timeout=timeout)
    assert comm.calls == []


def test_a_timeout_needs_a_nonblocking_allreduce() -> None:
    with pytest.raises(sc.InvalidArgumentError, match=r"it has no Iallreduce"):
        found_reducer(CountingComm(), timeout=1.0)


class SlowRequest:
    def __init__(self, done_after: float) -> None:
        self.done_at = time.monotonic() + done_after
        self.tests = 0

    def Test(self) -> bool:
        self.tests += 1
        return time.monotonic() >= self.done_at


def test_the_bounded_wait_returns_when_the_request_completes() -> None:
    request = SlowRequest(done_after=0.05)
    start = time.monotonic()
    assert _wait(request, timeout=5.0) is True
    assert time.monotonic() - start < 1.0  # polled at least every 1 ms, not slept through
    assert request.tests > 64  # it spun first, then slept between polls


def test_the_bounded_wait_gives_up_at_the_timeout() -> None:
    request = SlowRequest(done_after=1e9)
    start = time.monotonic()
    assert _wait(request, timeout=0.2) is False
    assert 0.2 <= time.monotonic() - start < 1.0
