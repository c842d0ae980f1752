"""The trace simulator, end to end on the shipped traces and through the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core._cli import main
from scaler_core._cli.make_traces import grad_maxima
from scaler_core.simulate import (
    EXAMPLE_TRACES,
    Trace,
    example_trace,
    load_trace,
    simulate,
)

FP16_MAX = 65504.0


def test_the_shipped_traces_load() -> None:
    spikes = example_trace("spikes")
    assert spikes.max_abs_grad is not None
    assert len(spikes) == 3000
    assert all(g > 0 for g in spikes.max_abs_grad)
    burst = example_trace("nan-burst")
    assert burst.found is not None
    assert [i for i, f in enumerate(burst.found) if f] == list(range(700, 850))
    demo = example_trace("demo")
    assert demo.found is not None
    assert len(demo) == 400
    assert 0 < sum(demo.found) < 400


def test_regenerating_the_traces_gives_the_shipped_files(
    tmp_path: Path, pinned_blas_env: dict[str, str]
) -> None:
    pytest.importorskip("sklearn", reason="the demo trace trains on scikit-learn's digits")
    subprocess.run(
        [sys.executable, "-m", "scaler_core._cli.make_traces", str(tmp_path)],
        env=pinned_blas_env,
        capture_output=True,
        check=True,
    )
    for name, filename in EXAMPLE_TRACES.items():
        shipped, fresh = example_trace(name), load_trace(tmp_path / filename)
        if shipped.found is not None:
            assert fresh.found == shipped.found
            assert fresh.recorded_with == shipped.recorded_with is not None
            assert fresh.source == shipped.source
        else:
            assert np.allclose(fresh.max_abs_grad, shipped.max_abs_grad, rtol=1e-4)


def test_each_policy_replays_the_spikes_trace_consistently() -> None:
    trace = example_trace("spikes")
    assert trace.max_abs_grad is not None
    results = simulate(trace, sorted(sc.PRESETS))
    for name, res in results.items():
        assert res.steps == 3000, name
        # The flags follow from the scale each policy used, step by step.
        flags = [g * s > FP16_MAX for g, s in zip(trace.max_abs_grad, res.scales, strict=True)]
        assert res.skipped_steps == sum(flags), name
        state = sc.init(sc.preset(name))
        for step, flag in enumerate(flags):
            assert state.scale == res.scales[step], (name, step)
            state = sc.update(state, flag)
        assert res.final_scale == state.scale
    # DeepSpeed's 2**16 (its config's initial_scale_power) must first back off until the
    # step's gradient fits: the first overflow only spends the hysteresis credit, each
    # later one halves.
    scale, credit, t = 2.0**16, 2, 0
    while trace.max_abs_grad[t] * scale > FP16_MAX:
        scale, credit = (scale, credit - 1) if credit > 1 else (scale / 2, credit)
        t += 1
    assert results["deepspeed"].recovery_steps[0] == t
    # PyTorch's 2**16 meets only the largest spikes.
    assert results["torch"].skipped_steps < results["deepspeed"].skipped_steps


def test_the_nan_burst_separates_floors_from_collapses() -> None:
    results = simulate(example_trace("nan-burst"), sorted(sc.PRESETS))
    # No floor: 2**16 halves 142 times to 2**-126; the 143rd backoff is refused.
    assert results["torch"].collapse_step == 700 + 142
    assert results["keras"].collapse_step == 700 + 141  # starts at 2**15
    # Paddle's dygraph GradScaler has no floor either: 2**16 down to 2**-126.
    assert results["paddle"].collapse_step == 700 + 142
    # DeepSpeed: hysteresis absorbs step 700, 16 backoffs take 2**16 to the floor 1,
    # and raise_error_at_min_scale refuses the next overflow.
    assert results["deepspeed"].collapse_step == 700 + 1 + 16
    for name in ("jmp", "megatron", "paddle_static", "flax"):
        res = results[name]
        assert not res.collapsed, name
        assert res.skipped_steps == 150
        assert res.recovery_steps == (150,)
    # jmp reaches its floor of 1 after 15 halvings of 2**15 and stays there.
    assert results["jmp"].steps_at_floor == 1500 - 715
    assert results["jmp"].final_scale == 1.0


def test_a_users_own_policy_runs_in_the_simulator() -> None:
    def fail_open(state: sc.ScalerState, found: Any) -> sc.ScalerState:
        new = sc.update(dataclasses.replace(state, config=sc.ScalerConfig()), found)
        scale = 0.0 if found else new.scale
        return dataclasses.replace(new, config=state.config, scale=scale)

    trace = Trace(name="t", found=(False, True, False))
    res = simulate(trace, {"mine": (sc.ScalerConfig(), fail_open), "torch": "torch"})
    assert res["mine"].collapsed
    assert res["mine"].collapse_step == 2
    assert not res["torch"].collapsed


def test_max_abs_grad_overflow_depends_on_the_dtype() -> None:
    config = sc.ScalerConfig(init_scale=2.0**15)
    fits = Trace(name="t", max_abs_grad=(1.99,))  # 1.99 * 2**15 = 65208 <= 65504
    assert simulate(fits, {"p": config})["p"].skipped_steps == 0
    trace = Trace(name="t", max_abs_grad=(2.0,))  # 65536 > 65504
    assert simulate(trace, {"p": config}, dtype="float16")["p"].skipped_steps == 1
    assert simulate(trace, {"p": config}, dtype="bfloat16")["p"].skipped_steps == 0
    nan = Trace(name="t", max_abs_grad=(math.nan,))
    assert simulate(nan, {"p": config}, dtype="float32")["p"].skipped_steps == 1


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.csv", "step,loss\n0,1\n", "needs a 'found' or a 'max_abs_grad' column"),
        ("a.csv", "found\n1\nmaybe\n", "row 3: found='maybe'"),
        ("a.csv", "max_abs_grad\n-1\n", "max_abs_grad[0]=-1.0, but it must be >= 0"),
        ("a.json", '{"found": []}', "has no steps"),
        ("a.json", "[1, 2]", "not a JSON object"),
        ("a.json", '{"max_abs_grad": [1, "x"]}', "max_abs_grad[1]: max_abs_grad='x'"),
        ("a.txt", "found\n1\n", "must be .csv or .json"),
    ],
)
def test_bad_traces_are_refused_by_name(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(sc.TraceError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_trace(path)


def test_both_formats_read_alike(tmp_path: Path) -> None:
    (tmp_path / "t.csv").write_text("step,max_abs_grad\n0,0.5\n1,nan\n2,inf\n")
    (tmp_path / "t.json").write_text('{"max_abs_grad": [0.5, null, Infinity]}')
    a, b = load_trace(tmp_path / "t.csv"), load_trace(tmp_path / "t.json")
    assert a.max_abs_grad is not None
    assert b.max_abs_grad is not None
    assert a.max_abs_grad[0] == b.max_abs_grad[0] == 0.5
    assert all(not math.isfinite(g) for g in (*a.max_abs_grad[1:], *b.max_abs_grad[1:]))


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "nan-burst", "--policy", "torch", "--policy", "jmp"]) == 0
    out = capsys.readouterr().out
    assert "trace nan-burst: 1500 steps, found flags" in out
    torch_row = next(line for line in out.splitlines() if line.startswith("torch"))
    assert "at step 842" in torch_row


def test_cli_json_and_plot_through_python_m(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    png = tmp_path / "scales.png"
    proc = subprocess.run(
        [sys.executable, "-m", "scaler_core", "simulate", "spikes", "--json", "--plot", str(png)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(proc.stdout)
    assert report["steps"] == 3000
    assert [p["policy"] for p in report["policies"]] == sorted(sc.PRESETS)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_takes_a_users_policy_by_module_path(tmp_path: Path) -> None:
    (tmp_path / "my_policies.py").write_text(
        "import scaler_core as sc\n"
        "cautious = sc.ScalerConfig(init_scale=2.0**10, growth_interval=50)\n"
    )
    policies = ["--policy", "my_policies:cautious", "--policy", "torch"]
    proc = subprocess.run(
        [sys.executable, "-m", "scaler_core", "simulate", "spikes", "--json", *policies],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])},
    )
    names = [p["policy"] for p in json.loads(proc.stdout)["policies"]]
    assert names == ["cautious", "torch"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "nowhere.csv"], "trace='nowhere.csv' is not a file"),
        (["simulate", "spikes", "--policy", "tf"], "--policy 'tf' is not a preset"),
        (["simulate", "spikes", "--policy", "no_such_mod:x"], "cannot be imported"),
    ],
)
def test_cli_errors_are_one_line_with_exit_code_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1


def test_grad_maxima_marks_the_corrupted_steps() -> None:
    g = grad_maxima(20, seed=3, corrupt=(5, 7))
    assert [i for i, x in enumerate(g) if not np.isfinite(x)] == [5, 6, 7]


# ------------------------------------------------ hostile traces: one clear line each
def _huge_int_json(digits: int) -> str:
    return '{"max_abs_grad": [1, ' + "9" * digits + "]}"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("short.csv", b"step,found\n0,1\n1\n2,0\n", "row 3 has 1 cells but the header has 2"),
        ("long.csv", b"found\n1\n0,1\n", "row 3 has 2 cells but the header has 1"),
        ("dup.csv", b"found,found\n1,0\n", "repeats the column 'found'"),
        ("empty-cell.csv", b"step,max_abs_grad\n0,\n", "row 2: max_abs_grad=''"),
        ("latin1.csv", "found\n1\n# caf\u00e9\n".encode("latin-1"), "is not UTF-8 text"),
        ("latin1.json", '{"found": [true], "note": "caf\u00e9"}'.encode("latin-1"), "UTF-8"),
        ("400.json", _huge_int_json(400).encode(), "max_abs_grad[1]: max_abs_grad=an integer of"),
        ("5000.json", _huge_int_json(5000).encode(), "is not valid JSON"),
        ("5000-found.json", ('{"found": [' + "1" * 5000 + "]}").encode(), "is not valid JSON"),
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        ("found-int.json", b'{"found": [1, 2]}', "found[1]: found=2"),
    ],
)
def test_hostile_traces_are_one_clear_error(
    tmp_path: Path, name: str, content: bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(sc.TraceError) as info:
        load_trace(path)
    assert message in str(info.value)
    assert len(str(info.value)) < 500  # never the 5000 digits back


def test_a_byte_order_mark_is_not_part_of_the_header(tmp_path: Path) -> None:
    path = tmp_path / "bom.csv"
    path.write_bytes("\ufefffound\n1\n0\n".encode())
    assert load_trace(path).found == (True, False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "spikes", "--policy", ":x"], "--policy ':x'"),
        (["simulate", "spikes", "--policy", ".x:y"], "--policy '.x:y'"),
        (["simulate", "spikes", "--policy", "os:"], "--policy 'os:'"),
        (["simulate", "spikes", "--plot", "/no/such/folder/p.png"], "does not exist"),
        (["simulate", "spikes", "--plot", "p.gif.txt"], "--plot 'p.gif.txt'"),
    ],
)
def test_cli_refuses_bad_arguments_before_any_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.err.count("\n") == 1
    assert captured.out == "", "the table was printed before the refusal"


def test_found_flags_replayed_under_another_policy_say_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The demo trace's flags were recorded at scales near 2**38: replaying them under
    PyTorch's preset is not what PyTorch would have seen, and the report says so."""
    trace = example_trace("demo")
    assert trace.recorded_with is not None
    assert trace.recorded_with.init_scale == 2.0**40
    assert main(["simulate", "demo", "--policy", "torch"]) == 0
    out = capsys.readouterr().out
    assert "recorded under another policy" in out
    assert "torch" in out.split("recorded under another policy")[1]
    report = simulate(trace, {"same": trace.recorded_with, "torch": "torch"})
    assert report["same"].matches_recording is True
    assert report["torch"].matches_recording is False


# ------------------------------------------------------------ spike skipping
def _spike_csv(path: Path, *, norms: bool = True) -> Path:
    rows = ["step,max_abs_grad" + (",grad_norm" if norms else "")]
    for i in range(40):
        norm = 50.0 if i in (25, 33) else 1.0 + 0.01 * (i % 5)
        rows.append(f"{i},0.5" + (f",{norm}" if norms else ""))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def test_a_trace_with_grad_norm_replays_spike_skipping(tmp_path: Path) -> None:
    trace = load_trace(_spike_csv(tmp_path / "t.csv"))
    assert trace.grad_norm is not None
    assert trace.grad_norm[25] == 50.0
    spiky = sc.preset("torch", spike_threshold=4.0, spike_window=8)
    results = simulate(trace, {"torch": "torch", "spiky": spiky})
    assert results["torch"].spike_skips == 0
    assert results["torch"].skipped_steps == 0
    res = results["spiky"]
    assert (res.spike_skips, res.skipped_steps) == (2, 2)
    assert res.recovery_steps == ()  # spike skips are not overflow spikes
    assert res.summary()["spike_skips"] == 2
    # The same trajectory as update with the norms, step by step.
    state = sc.init(spiky)
    for norm in trace.grad_norm:
        state = sc.update(state, False, grad_norm=norm)
    assert state.skipped_steps == 2
    assert res.final_scale == state.scale
    report = sc.simulate.format_report(trace, results, "float16")
    header = report.splitlines()[1].split()
    assert header[:5] == ["policy", "steps", "skipped", "spike", "skips"]
    assert report.splitlines()[0].endswith(", grad_norm")


def test_a_json_trace_carries_grad_norm_too(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"found": [False, True, False], "grad_norm": [1.0, None, 2.0]}))
    trace = load_trace(path)
    assert trace.grad_norm is not None
    assert trace.grad_norm[0] == 1.0
    assert math.isnan(trace.grad_norm[1])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"found": [False, True], "grad_norm": [1.0]}))
    with pytest.raises(sc.TraceError, match="1 grad_norm values for 2 steps"):
        load_trace(bad)
    bad.write_text(json.dumps({"found": [False], "grad_norm": ["x"]}))
    with pytest.raises(
        sc.TraceError, match=r"grad_norm\[0\]: grad_norm='x', but it must be a number"
    ):
        load_trace(bad)
    with pytest.raises(sc.TraceError, match=r"grad_norm\[0\]=-1\.0"):
        Trace(found=(False,), grad_norm=(-1.0,))


def test_spike_skipping_on_a_trace_without_grad_norm_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _spike_csv(tmp_path / "plain.csv", norms=False)
    with pytest.raises(sc.TraceError, match="has no grad_norm"):
        simulate(load_trace(path), {"s": sc.ScalerConfig(spike_threshold=3.0)})
    (tmp_path / "spiky_policy.py").write_text(
        "import scaler_core as sc\nspiky = sc.ScalerConfig(spike_threshold=3.0)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["simulate", str(path), "--policy", "spiky_policy:spiky"]) == 2
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "has no grad_norm" in err


def test_the_command_line_turns_spike_skipping_on_for_every_policy(tmp_path: Path) -> None:
    trace = _spike_csv(tmp_path / "t.csv")
    argv = ["simulate", str(trace), "--policy", "torch", "--policy", "megatron", "--json"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scaler_core",
            *argv,
            "--spike-threshold",
            "4",
            "--spike-window",
            "8",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    policies = json.loads(out.stdout)["policies"]
    assert [p["spike_skips"] for p in policies] == [2, 2]
    plain = subprocess.run(
        [sys.executable, "-m", "scaler_core", *argv], capture_output=True, text=True, check=False
    )
    assert [p["spike_skips"] for p in json.loads(plain.stdout)["policies"]] == [0, 0]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--spike-threshold", "-1"], "spike_threshold=-1.0"),
        (["--spike-window", "8"], "--spike-window 8 needs --spike-threshold"),
        (["--spike-threshold", "4", "--spike-window", "1"], "spike_window=1"),
    ],
)
def test_bad_spike_options_are_one_line_and_exit_2(
    tmp_path: Path, extra: list[str], says: str
) -> None:
    trace = _spike_csv(tmp_path / "t.csv")
    out = subprocess.run(
        [sys.executable, "-m", "scaler_core", "simulate", str(trace), *extra],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1
    assert says in out.stderr


def test_spike_options_on_a_trace_without_grad_norm_say_what_is_missing(tmp_path: Path) -> None:
    trace = _spike_csv(tmp_path / "t.csv", norms=False)
    out = subprocess.run(
        [sys.executable, "-m", "scaler_core", "simulate", str(trace), "--spike-threshold", "4"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2
    assert "grad_norm" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# ------------------------------------------- your own policy under spike skipping
_SPIKY = sc.preset("torch", spike_threshold=4.0, spike_window=8)
_CAP = 2.0**14


def _capped(state: sc.ScalerState, found: bool) -> sc.ScalerState:
    """The documented two-argument policy: the built-in rule, never above 2**14."""
    new = sc.update(state, found)
    return dataclasses.replace(new, scale=min(new.scale, _CAP))


def test_a_two_argument_policy_replays_under_spike_skipping(tmp_path: Path) -> None:
    trace = load_trace(_spike_csv(tmp_path / "t.csv"))
    seen: list[sc.ScalerConfig] = []

    def watched(state: sc.ScalerState, found: bool) -> sc.ScalerState:
        seen.append(state.config)
        return _capped(state, found)

    results = simulate(trace, {"capped": (_SPIKY, watched), "spiky": _SPIKY})
    capped, spiky = results["capped"], results["spiky"]
    # The spike decision is the core's: the same steps as the built-in rule skips.
    assert (capped.spike_skips, capped.skipped_steps) == (spiky.spike_skips, 2)
    assert capped.scales == (65536.0,) + (_CAP,) * 39
    # The policy runs on every other step, and sees a config it can hand to update().
    assert len(seen) == 38
    assert all(c.spike_threshold is None for c in seen)
    assert all(c == dataclasses.replace(_SPIKY, spike_threshold=None) for c in seen)


def test_a_two_argument_policy_keeps_the_window_the_core_keeps(tmp_path: Path) -> None:
    trace = load_trace(_spike_csv(tmp_path / "t.csv"))
    assert trace.grad_norm is not None
    last: list[sc.ScalerState] = []

    def recording(state: sc.ScalerState, found: bool, grad_norm: float) -> sc.ScalerState:
        new = sc.update(state, found, grad_norm=grad_norm)
        last.append(new)
        return new

    results = simulate(trace, {"plain": (_SPIKY, sc.update), "rec": (_SPIKY, recording)})
    assert results["plain"] == dataclasses.replace(results["rec"], name="plain")
    state = sc.init(_SPIKY)
    for norm in trace.grad_norm:
        state = sc.update(state, False, grad_norm=norm)
    assert last[-1] == state


def test_the_command_line_takes_a_two_argument_policy_with_spike_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = _spike_csv(tmp_path / "t.csv")
    (tmp_path / "two_arg_policies.py").write_text(
        "import dataclasses\n"
        "import scaler_core as sc\n\n\n"
        "def capped(state, found):\n"
        "    new = sc.update(state, found)\n"
        "    return dataclasses.replace(new, scale=min(new.scale, 2.0**14))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["simulate", str(trace), "--policy", "two_arg_policies:capped", "--json"]
    assert main([*argv, "--spike-threshold", "4", "--spike-window", "8"]) == 0
    (policy,) = json.loads(capsys.readouterr().out)["policies"]
    assert (policy["policy"], policy["spike_skips"], policy["final_scale"]) == ("capped", 2, _CAP)


@pytest.mark.parametrize(
    ("policy", "spiking", "says"),
    [
        (lambda state, found, grad_norm: state, False, "takes (state, found, grad_norm)"),
        (lambda state: state, False, "takes (state)"),
        (lambda state: state, True, "takes (state)"),
        (lambda state, found, grad_norm, extra: state, True, "takes (state, found, grad_norm"),
    ],
)
def test_a_policy_that_cannot_take_its_arguments_is_refused_before_replaying(
    policy: Any, spiking: bool, says: str
) -> None:
    trace = Trace(found=(False, False), grad_norm=(1.0, 1.0))
    config = _SPIKY if spiking else sc.preset("torch")
    with pytest.raises(sc.InvalidArgumentError) as err:
        simulate(trace, {"mine": (config, policy)})
    message = str(err.value)
    assert "policy 'mine'" in message
    assert says in message
    assert "policy(state, found" in message  # what it must take


def _recorded_json(path: Path, *, norms: bool) -> Path:
    data: dict[str, Any] = {
        "found": [False] * 10 + [True] + [False] * 9,
        "recorded_with": {"init_scale": 1024.0, "spike_threshold": 3.0, "spike_window": 4},
    }
    if norms:
        data["grad_norm"] = [1.0] * 20
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_a_trace_recorded_with_spike_skipping_needs_its_norms(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _recorded_json(tmp_path / "rec.json", norms=False)
    with pytest.raises(sc.TraceError) as err:
        simulate(load_trace(path), ["torch"])
    for words in ("recorded_with", "spike_threshold=3.0", "grad_norm", "trace 'rec'"):
        assert words in str(err.value), words
    assert "unscale_and_norm" not in str(err.value)  # advice for library code, not here
    assert main(["simulate", str(path), "--policy", "torch"]) == 2
    out = capsys.readouterr().err
    assert out.count("\n") == 1
    assert "recorded_with" in out
    assert "grad_norm" in out
    with_norms = _recorded_json(tmp_path / "ok.json", norms=True)
    assert simulate(load_trace(with_norms), ["torch"])["torch"].matches_recording is False
