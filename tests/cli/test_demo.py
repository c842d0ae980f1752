"""``scaler-core demo`` end to end: the numbers, the files, the CLI.

The full default demo (400 steps on the digits, a few seconds) runs once, to check
the numbers docs/demo.md shows; the synthetic task runs at 150 steps and the CLI at 20.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import scaler_core as sc
from scaler_core import _cli
from scaler_core._cli import demo
from scaler_core._cli._plot import pyplot

STEPS = 150


@pytest.fixture(scope="module")
def full_result() -> demo.DemoResult:
    """The full default demo, as the README's command runs it (a few seconds)."""
    pytest.importorskip("sklearn", reason="the digits dataset ships with scikit-learn")
    return demo.run_demo(demo.DemoSettings())


@pytest.fixture(scope="module")
def synthetic_result() -> demo.DemoResult:
    return demo.run_demo(demo.DemoSettings(steps=STEPS, dataset="synthetic"))


def _check_three_runs(result: demo.DemoResult) -> None:
    ref, plain, scaled = (result.runs[m] for m in demo.MODES)
    # float16 + scaler-core ends within a small tolerance of float32.
    assert abs(scaled.test_loss - ref.test_loss) <= 0.06, (scaled.test_loss, ref.test_loss)
    assert abs(scaled.test_accuracy - ref.test_accuracy) <= 0.025
    # float16 without scaling loses a large share of its gradient values to
    # underflow and fails to train.
    assert plain.underflow_share is not None
    assert plain.underflow_share > 0.3
    assert plain.test_loss > ref.test_loss + 1.0
    assert plain.test_accuracy < ref.test_accuracy - 0.2
    # With the scaler almost nothing underflows.
    assert scaled.underflow_share is not None
    assert scaled.underflow_share < 0.01
    assert ref.underflow_share is None
    assert ref.subnormal_share is None


def test_full_demo_three_runs(full_result: demo.DemoResult) -> None:
    assert full_result.dataset == "scikit-learn digits"
    _check_three_runs(full_result)


def _shown_rows() -> dict[str, str]:
    """The demo's table as the README or a docs page shows it, a row per mode."""
    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    lines = [ln for page in pages for ln in page.read_text(encoding="utf-8").splitlines()]
    return {
        mode: next(line for line in lines if line.startswith(label))
        for mode, label in demo.MODE_LABELS.items()
    }


def test_documented_table_is_what_the_demo_prints(
    tmp_path: Path, pinned_blas_env: dict[str, str]
) -> None:
    """The numbers the docs show are the default demo's, on the BLAS kernels they came from."""
    pytest.importorskip("sklearn", reason="the digits dataset ships with scikit-learn")
    out = tmp_path / "demo.json"
    subprocess.run(
        [sys.executable, "-m", "scaler_core", "demo", "--quiet", "--json", str(out)],
        env=pinned_blas_env,
        capture_output=True,
        check=True,
    )
    runs = json.loads(out.read_text())["runs"]
    for mode, row in _shown_rows().items():
        run = runs[mode]
        cells = row[len(demo.MODE_LABELS[mode]) :].split()
        assert float(cells[0]) == pytest.approx(run["test_loss"], abs=5e-5), row
        assert float(cells[1].rstrip("%")) == pytest.approx(100 * run["test_accuracy"], abs=0.05)
        if run["underflow_share"] is not None:
            assert float(cells[2].rstrip("%")) == pytest.approx(
                100 * run["underflow_share"], abs=0.05
            )
        if mode == "float16+scaler":
            assert int(cells[4]) == run["skipped_steps"], row


def test_synthetic_three_runs(synthetic_result: demo.DemoResult) -> None:
    assert synthetic_result.dataset == "synthetic patterns"
    _check_three_runs(synthetic_result)


def test_runs_report_every_step(synthetic_result: demo.DemoResult) -> None:
    for mode, run in synthetic_result.runs.items():
        assert run.mode == mode
        assert len(run.losses) == len(run.scales) == STEPS
        assert run.wall_time_s > 0
        assert all(s == 1.0 for s in run.scales) or mode == "float16+scaler"


def test_scale_trajectory_is_the_scalers(synthetic_result: demo.DemoResult) -> None:
    """The reported scales and skips are exactly what scaler_core.update does."""
    run = synthetic_result.runs["float16+scaler"]
    settings = synthetic_result.settings
    # The deliberately high first scale overflows, so the first steps are skipped.
    assert run.skipped[:3] == [0, 1, 2]
    state = sc.init(settings.scaler_config())
    skipped = set(run.skipped)
    for step, scale in enumerate(run.scales):
        assert scale == state.scale, step
        state = sc.update(state, step in skipped)
    assert state.skipped_steps == len(run.skipped)


def test_underflow_measure_is_not_constant() -> None:
    """With normal-sized gradients (loss weight 1), float16 loses almost nothing."""
    settings = demo.DemoSettings(steps=20, loss_weight=1.0, dataset="synthetic")
    run = demo.train(settings, "float16", demo.load_dataset("synthetic"))
    assert run.underflow_share is not None
    assert run.underflow_share < 0.05
    small = demo.train(
        demo.DemoSettings(steps=20, dataset="synthetic"), "float16", demo.load_dataset("synthetic")
    )
    assert small.underflow_share is not None
    assert small.underflow_share > 10 * run.underflow_share


def test_loss_weight_leaves_float32_training_unchanged() -> None:
    """The demo page's claim: in float32 the power-of-two loss weight changes nothing."""
    data = demo.load_dataset("synthetic")
    plain = demo.train(demo.DemoSettings(steps=15, loss_weight=1.0), "float32", data)
    weighted = demo.train(demo.DemoSettings(steps=15), "float32", data)
    assert weighted.losses == plain.losses
    assert weighted.test_loss == plain.test_loss


def test_same_seed_same_numbers() -> None:
    settings = demo.DemoSettings(steps=10, dataset="synthetic")
    data = demo.load_dataset("synthetic")
    a = demo.train(settings, "float16+scaler", data)
    b = demo.train(settings, "float16+scaler", data)
    assert a.losses == b.losses
    assert a.test_loss == b.test_loss


def test_summary_table(full_result: demo.DemoResult) -> None:
    text = demo.format_summary(full_result)
    for label in demo.MODE_LABELS.values():
        assert label in text
    plain = full_result.runs["float16"]
    assert f"{100 * plain.underflow_share:.1f}%" in text  # type: ignore[operator]
    assert "2^40 ->" in text


def test_json_file(full_result: demo.DemoResult, tmp_path: Path) -> None:
    path = tmp_path / "demo.json"
    demo.write_json(full_result, str(path))
    data = json.loads(path.read_text())
    assert data["schema"] == demo.JSON_SCHEMA
    assert data["dataset"] == "scikit-learn digits"
    assert data["settings"]["steps"] == full_result.settings.steps
    assert set(data["runs"]) == set(demo.MODES)
    for mode, run in full_result.runs.items():
        saved = data["runs"][mode]
        assert saved["test_loss"] == run.test_loss
        assert saved["test_accuracy"] == run.test_accuracy
        assert saved["underflow_share"] == run.underflow_share
        assert saved["skipped_steps"] == len(run.skipped)
        assert saved["scales"] == run.scales
        assert len(saved["losses"]) == full_result.settings.steps
    assert (
        data["runs"]["float16+scaler"]["final_scale"]
        == full_result.runs["float16+scaler"].scales[-1]
    )


def test_json_writes_null_for_a_diverged_loss(tmp_path: Path) -> None:
    run = demo.RunResult("float16", math.nan, 0.1, [math.inf, 1.0], [1.0, 1.0], [], 0.5, 0.1, 1.0)
    result = demo.DemoResult(demo.DemoSettings(), "x", {"float16": run})
    path = tmp_path / "d.json"
    demo.write_json(result, str(path))  # strict JSON: would raise on NaN
    saved = json.loads(path.read_text())["runs"]["float16"]
    assert saved["test_loss"] is None
    assert saved["losses"] == [None, 1.0]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_file(full_result: demo.DemoResult, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    path = tmp_path / "demo.png"
    demo.write_plot(full_result, str(path))
    assert _png_size(path) == (800, 650)


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(sc.MissingDependencyError, match=r"pip install 'scaler-core\[demo\]'"):
        pyplot("--plot")


def test_digits_without_sklearn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert demo.load_dataset("auto").name == "synthetic patterns"
    with pytest.raises(sc.MissingDependencyError, match="--dataset synthetic"):
        demo.load_dataset("digits")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("steps", 0),
        ("steps", 2.5),
        ("batch_size", True),
        ("width", -1),
        ("depth", 0),
        ("lr", math.nan),
        ("lr", 0.0),
        ("loss_weight", math.inf),
        ("loss_weight", 1e-50),
        ("init_scale", 0.0),
        ("growth_interval", 0),
        ("seed", -1),
        ("backend", "torch"),
        ("dataset", "mnist"),
    ],
)
def test_settings_reject_bad_values(field: str, value: Any) -> None:
    with pytest.raises((sc.InvalidArgumentError, sc.InvalidConfigError), match=field):
        demo.DemoSettings(**{field: value})


def test_train_rejects_a_batch_larger_than_the_data() -> None:
    data = demo.load_dataset("synthetic")
    with pytest.raises(sc.InvalidArgumentError, match="batch_size=5000"):
        demo.train(demo.DemoSettings(batch_size=5000), "float32", data)
    with pytest.raises(sc.InvalidArgumentError, match="mode="):
        demo.train(demo.DemoSettings(), "bfloat16", data)


def test_parse_number() -> None:
    assert demo.parse_number("2^-17") == 2.0**-17
    assert demo.parse_number("2**40") == 2.0**40
    assert demo.parse_number("1e-3") == 1e-3
    with pytest.raises(Exception, match="not a number"):
        demo.parse_number("2^x")


def test_model_runs_on_jax_arrays() -> None:
    """The model is array-API generic: JAX computes what NumPy computes."""
    pytest.importorskip("jax", reason="JAX is optional")
    import jax.numpy as jnp

    settings = demo.DemoSettings(steps=3, depth=1, width=16, dataset="synthetic")
    data = demo.load_dataset("synthetic")
    # The float16 run also runs the float32 model (its underflow reference).
    a = demo.train(settings, "float16", data, xp=np)
    b = demo.train(settings, "float16", data, xp=jnp)
    np.testing.assert_allclose(b.losses, a.losses, rtol=1e-3)
    assert b.test_loss == pytest.approx(a.test_loss, rel=1e-3)
    assert b.underflow_share == pytest.approx(a.underflow_share, abs=1e-3)


# ------------------------------------------------------------------------ CLI
def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = _cli.main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


SMALL = ["demo", "--steps", "20", "--dataset", "synthetic", "--quiet"]


def test_cli_demo_writes_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    js, png = tmp_path / "d.json", tmp_path / "d.png"
    code, out, err = _run_cli([*SMALL, "--json", str(js), "--plot", str(png)], capsys)
    assert (code, err) == (0, "")
    assert "float16 + scaler-core" in out
    assert json.loads(js.read_text())["settings"]["steps"] == 20
    assert _png_size(png) == (800, 650)


def _available(name: str) -> bool:
    try:
        sc.get_backend(name)
    except sc.BackendUnavailableError:
        return False
    return True


BAD_INPUT = [
    (["demo", "--backend", "tensorflow"], "invalid choice: 'tensorflow'"),
    (["demo", "--steps", "0"], "steps=0"),
    (["demo", "--steps", "ten"], "invalid int value: 'ten'"),
    (["demo", "--batch-size", "100000", "--dataset", "synthetic"], "batch_size=100000"),
    (["demo", "--lr", "nan"], "lr=nan"),
    (["demo", "--loss-weight", "2^x"], "'2^x' is not a number"),
    (["demo", "--init-scale", "2^200"], "init_scale="),
    (["demo", "--growth-interval", "0"], "growth_interval=0"),
    (["demo", "--plot", "/no/such/folder/x.png"], "does not exist"),
    (["demo", "--json", "/no/such/folder/x.json"], "does not exist"),
    (["demo", "--unknown-flag"], "unrecognized arguments"),
    ([], "required: COMMAND"),
    (["train"], "invalid choice: 'train'"),
]
BAD_INPUT += [
    (["demo", "--backend", name], f"backend={name!r}")
    for name in ("jax", "cupy")
    if not _available(name)
]


@pytest.mark.parametrize(
    ("argv", "message"), BAD_INPUT, ids=[" ".join(argv) or "(nothing)" for argv, _ in BAD_INPUT]
)
def test_cli_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run_cli(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("scaler-core")
    assert message in err
    assert "Traceback" not in err


def test_cli_interrupt_exits_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", interrupted)
    code, _, err = _run_cli(SMALL, capsys)
    assert code == 130
    assert err == "scaler-core demo: interrupted\n"


def test_progress_text_fallback_without_tqdm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with demo._progress(10, enabled=True) as report:
        assert report is not None
        for done in range(1, 11):
            report("float32", done)
    err = capsys.readouterr().err
    assert err.endswith("float32 (reference)         10/10 steps\n")


def test_progress_with_tqdm(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm", reason="tqdm is optional")
    with demo._progress(5, enabled=True) as report:
        assert report is not None
        for done in range(1, 6):
            report("float16", done)
    assert "5/5" in capsys.readouterr().err


def test_no_progress_when_disabled() -> None:
    with demo._progress(5, enabled=False) as report:
        assert report is None


def test_python_dash_m_and_console_script(tmp_path: Path) -> None:
    """Both entry points run the demo; bad input is one line, exit 2, in a real process."""
    ok = subprocess.run(
        [sys.executable, "-m", "scaler_core", *SMALL],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == ""  # stderr is not a TTY here: no progress bar
    assert "float16, no scaling" in ok.stdout
    script = Path(sys.executable).with_name("scaler-core")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (not installed with pip)")
    bad = subprocess.run(
        [str(script), "demo", "--steps", "-1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    assert bad.returncode == 2
    assert (
        bad.stderr == "scaler-core demo: error: steps=-1, but it must be an int in [1, 10000000]\n"
    )


def test_cli_imports_no_optional_library() -> None:
    """Building the parser (what --help does) imports no optional library."""
    code = (
        "import sys, scaler_core._cli as c; c.build_parser(); "
        "print(sorted(m for m in ('jax', 'torch', 'cupy', 'sklearn', 'matplotlib', 'tqdm') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("backend", ["jax", "cupy"])
def test_demo_on_other_backends(backend: str) -> None:
    """Where a backend is installed, its demo gives NumPy's numbers up to rounding."""
    if not _available(backend):
        pytest.skip(f"the {backend} backend is not installed (its error path is tested above)")
    if backend == "cupy":
        pytest.importorskip("cupy", reason="CuPy is optional")
    settings = demo.DemoSettings(steps=20, depth=1, width=16, dataset="synthetic")
    data = demo.load_dataset("synthetic")
    ours = demo.run_demo(dataclasses.replace(settings, backend=backend), data=data)
    ref = demo.run_demo(settings, data=data)
    for mode in demo.MODES:
        assert ours.runs[mode].test_loss == pytest.approx(ref.runs[mode].test_loss, rel=1e-3)
    assert ours.runs["float16+scaler"].skipped == ref.runs["float16+scaler"].skipped


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--loss-weight", "1e39"], "loss_weight=1e+39"),
        (["--lr", "1e39"], "lr=1e+39"),
        (["--lr", "1e30", "--loss-weight", "1e-30"], "lr / loss_weight"),
        (["--plot", "out.gif"], "--plot 'out.gif'"),
    ],
)
def test_cli_refuses_settings_no_float32_run_can_use(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Values that pass as float64 but are inf in float32 (where the demo computes)
    would run to the end with NaN losses and exit 0; they are refused up front."""
    code, out, err = _run_cli([*SMALL, *argv], capsys)
    assert code == 2
    assert out == ""
    assert message in err
    assert err.count("\n") == 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_json_file_that_cannot_be_written_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run_cli([*SMALL, "--json", "/dev/full"], capsys)
    assert code == 2
    assert "--json '/dev/full' could not be written: No space left on device" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("suffix", "magic"), [(".pdf", b"%PDF"), (".svg", b"<?xml"), (".png", b"\x89PNG")]
)
def test_the_plot_is_written_in_the_format_its_name_asks_for(
    tmp_path: Path, suffix: str, magic: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    path = tmp_path / f"demo{suffix}"
    code, _, err = _run_cli([*SMALL, "--plot", str(path)], capsys)
    assert code == 0, err
    assert path.read_bytes().startswith(magic)
