"""Replay a trace under several policies and compare them (also ``scaler-core simulate``).

A *trace* is what a training run saw at each step: either the found-non-finite
flag itself, or the largest absolute gradient value before scaling
(``max_abs_grad``). From the latter the simulator derives the flag under each
policy's own scale: a step overflows when ``max_abs_grad * scale`` exceeds the
largest finite value of the gradient dtype (65504 for float16), or when the
value is NaN or infinite (a NaN loss overflows at every scale).

For each policy the report gives the steps skipped; the overflow *spikes*
(runs of consecutive skipped steps) with the time to recover from each (steps
from its first overflow to the next clean step) and the time to regrow (steps
from there until the scale is back at its value before the spike); the steps
spent at the floor (``min_scale``, or the smallest normal float32 without one);
whether the policy collapsed (refused a step, or a user policy produced a scale
that is no longer a normal float32); and the final scale.

A trace may also carry each step's global gradient norm (``grad_norm``, unscaled,
so the same under every policy). A policy with spike skipping on
(``spike_threshold``) needs it: each step's norm is passed to the transition,
and the report counts the steps it skipped as spikes (``spike_skips``, part of
``skipped_steps`` but not of the overflow spikes).

Policies are preset names (see :data:`scaler_core.PRESETS`), configs, or a
user's own transition as ``(config, policy)``::

    >>> from scaler_core import ScalerConfig
    >>> trace = Trace(name="toy", max_abs_grad=(0.5, 0.5, 3.0, 0.5, 0.5, 0.5))
    >>> res = simulate(trace, {"fast": ScalerConfig(init_scale=2.0**15, growth_interval=2)})
    >>> res["fast"].scales
    (32768.0, 32768.0, 65536.0, 32768.0, 32768.0, 65536.0)
    >>> res["fast"].skipped_steps, res["fast"].recovery_steps, res["fast"].regrowth_steps
    (1, (1,), (2,))
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import statistics
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from ._api import PolicyStep, policy_result, policy_step, update
from ._config import ScalerConfig
from ._errors import (
    InvalidArgumentError,
    InvalidConfigError,
    ScaleCollapseError,
    TraceError,
)
from ._f32 import FLT_MAX, FLT_MIN
from ._presets import preset
from ._state import ScalerState, init, step_skipped

__all__ = [
    "DTYPE_MAX",
    "EXAMPLE_TRACES",
    "Policy",
    "PolicyResult",
    "PolicySpec",
    "Trace",
    "example_trace",
    "format_report",
    "load_trace",
    "simulate",
]

#: Largest finite value of each gradient dtype; a larger scaled gradient overflows.
DTYPE_MAX: Mapping[str, float] = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": FLT_MAX,
}

#: The example traces shipped in ``scaler_core/traces`` (see docs/simulate.md).
EXAMPLE_TRACES: Mapping[str, str] = {
    "spikes": "mlp_fp16_spikes.csv",
    "nan-burst": "mlp_fp16_nan_burst.json",
    "demo": "mlp_fp16_demo.json",
}

#: ``policy(state, found) -> state``; ``policy(state, found, grad_norm)`` when the
#: policy's config has spike skipping on (a two-argument policy runs there too: the
#: spike decision is then the core's, see :func:`simulate`).
Policy = Callable[..., ScalerState]
PolicySpec = str | ScalerConfig | tuple[ScalerConfig, Policy]


@dataclasses.dataclass(frozen=True)
class Trace:
    """Per-step observations of one training run. Give exactly one of the two.

    Attributes:
        name: Shown in reports.
        found: Per-step found-non-finite flags (the policy cannot change them).
        max_abs_grad: Per-step largest absolute unscaled gradient value; NaN
            or inf for a step whose gradients are non-finite at every scale.
        recorded_with: For ``found`` flags, the config whose scales they were
            recorded at, when known: a policy replaying them at other scales
            did not meet these overflows, and the report says so.
        source: Where the trace came from (free text, shown in reports).
        grad_norm: Optional per-step global gradient norm (unscaled; NaN or
            inf allowed), one per step: what a policy with spike skipping
            needs.
    """

    name: str = "trace"
    found: tuple[bool, ...] | None = None
    max_abs_grad: tuple[float, ...] | None = None
    recorded_with: ScalerConfig | None = None
    source: str = ""
    grad_norm: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if (self.found is None) == (self.max_abs_grad is None):
            raise TraceError(
                f"trace {self.name!r} has found={self.found is not None} and "
                f"max_abs_grad={self.max_abs_grad is not None}, but it must have exactly one"
            )
        if len(self) == 0:
            raise TraceError(f"trace {self.name!r} has no steps; it must have at least one")
        if self.max_abs_grad is not None:
            for i, g in enumerate(self.max_abs_grad):
                if g < 0:
                    raise TraceError(
                        f"trace {self.name!r}: max_abs_grad[{i}]={g!r}, but it must be >= 0 "
                        f"(an absolute value), NaN or inf"
                    )
        if self.grad_norm is not None:
            if len(self.grad_norm) != len(self):
                raise TraceError(
                    f"trace {self.name!r} has {len(self.grad_norm)} grad_norm values for "
                    f"{len(self)} steps, but it must have one per step"
                )
            for i, g in enumerate(self.grad_norm):
                if g < 0:
                    raise TraceError(
                        f"trace {self.name!r}: grad_norm[{i}]={g!r}, but it must be >= 0 "
                        f"(a norm), NaN or inf"
                    )

    def __len__(self) -> int:
        values = self.found if self.found is not None else self.max_abs_grad
        return len(values or ())

    def overflows(self, step: int, scale: float, dtype_max: float) -> bool:
        """Whether step ``step`` has non-finite gradients under ``scale``."""
        if self.max_abs_grad is None:
            return bool(self.found and self.found[step])
        g = self.max_abs_grad[step]
        return not math.isfinite(g) or g * scale > dtype_max


@dataclasses.dataclass(frozen=True)
class PolicyResult:
    """What one policy did on a trace.

    Attributes:
        name: The policy's name in the report.
        steps: Steps replayed (fewer than the trace when it collapsed).
        skipped_steps: Steps whose optimizer update was skipped (overflows and
            spike skips).
        recovery_steps: Per spike (run of skipped steps), the steps from its
            first overflow to the next clean step (its length).
        regrowth_steps: Per spike, steps from that clean step until the scale
            is back at its value before the spike; ``None`` if it never is.
        steps_at_floor: Steps taken at the floor (``min_scale``, or the
            smallest normal float32 without one).
        collapsed: Whether the policy refused a step or left the normal range.
        collapse_step: The step it collapsed at, or ``None``.
        final_scale: The scale after the last step replayed.
        scales: The scale used at each step replayed.
        matches_recording: For a ``found`` trace with ``recorded_with``, whether
            this policy replayed the flags at the scales they were recorded at
            (only then are they the overflows it would have met); else ``None``.
        spike_skips: Steps skipped by spike skipping (``StepKind.SPIKE_SKIP``);
            0 for a policy without it.
    """

    name: str
    steps: int
    skipped_steps: int
    recovery_steps: tuple[int, ...]
    regrowth_steps: tuple[int | None, ...]
    steps_at_floor: int
    collapsed: bool
    collapse_step: int | None
    final_scale: float
    scales: tuple[float, ...]
    matches_recording: bool | None = None
    spike_skips: int = 0

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a JSON-safe dict (no per-step data)."""
        regrown = [n for n in self.regrowth_steps if n is not None]
        return {
            "policy": self.name,
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "spike_skips": self.spike_skips,
            "spikes": len(self.recovery_steps),
            "recovery_steps_mean": _mean(self.recovery_steps),
            "recovery_steps_max": max(self.recovery_steps, default=None),
            "regrowth_steps_mean": _mean(regrown),
            "never_regrown": len(self.regrowth_steps) - len(regrown),
            "steps_at_floor": self.steps_at_floor,
            "collapsed": self.collapsed,
            "collapse_step": self.collapse_step,
            "final_scale": self.final_scale,
            "matches_recording": self.matches_recording,
        }


def _mean(values: Sequence[int]) -> float | None:
    return round(statistics.fmean(values), 2) if values else None


def _resolve(name: str, spec: PolicySpec) -> tuple[ScalerConfig, PolicyStep]:
    if isinstance(spec, str):
        return preset(spec), update
    if isinstance(spec, ScalerConfig):
        return spec, update
    match spec:
        case (ScalerConfig() as config, policy) if callable(policy):
            return config, policy_step(repr(name), config, policy)
    raise InvalidArgumentError(
        f"policy {name!r}={spec!r}, but it must be a preset name, a ScalerConfig or a "
        f"(ScalerConfig, policy) pair with policy(state, found) -> state"
    )


def simulate(
    trace: Trace,
    policies: Mapping[str, PolicySpec] | Iterable[str],
    *,
    dtype: str = "float16",
) -> dict[str, PolicyResult]:
    """Replay ``trace`` under each policy.

    Args:
        trace: The per-step observations.
        policies: ``{name: spec}`` where a spec is a preset name, a
            :class:`ScalerConfig` or ``(config, policy)`` for a user's own
            transition; or just preset names. A policy whose config has spike
            skipping on is called with each step's ``grad_norm`` as a third
            argument; a two-argument ``policy(state, found)``, which cannot see
            the norm, runs under the core's spike rule: a spike step is
            :func:`scaler_core.update`'s (only the skip counters and the window
            move) and the policy is not called; every other step is the
            policy's, on the state with ``spike_threshold=None`` in its config,
            and the window statistics are kept as ``update`` keeps them.
        dtype: Gradient dtype for ``max_abs_grad`` traces (``float16``,
            ``bfloat16``, ``float32``).

    Returns:
        ``{name: PolicyResult}`` in the order given.

    Raises:
        InvalidConfigError: An unknown preset name.
        InvalidArgumentError: A bad spec or dtype, no policies, or a policy that
            cannot be called with the arguments its config needs.
        TraceError: A policy has spike skipping on, or the trace's
            ``recorded_with`` has, and the trace has no ``grad_norm``.
    """
    if dtype not in DTYPE_MAX:
        raise InvalidArgumentError(f"dtype={dtype!r}, but it must be one of {sorted(DTYPE_MAX)}")
    specs: Mapping[str, PolicySpec] = (
        policies if isinstance(policies, Mapping) else {name: name for name in policies}
    )
    if not specs:
        raise InvalidArgumentError("policies is empty, but it must name at least one policy")
    resolved = {name: _resolve(name, spec) for name, spec in specs.items()}
    recorded = trace.recorded_with
    if trace.grad_norm is None and recorded is not None and recorded.spike_threshold is not None:
        raise TraceError(
            f"trace {trace.name!r} was recorded with spike skipping on (its recorded_with has "
            f"spike_threshold={recorded.spike_threshold!r}), but it has no grad_norm list, "
            f"which replaying the recording needs; add the recorded run's per-step gradient "
            f"norms as a grad_norm list, or take spike_threshold out of recorded_with"
        )
    if trace.grad_norm is None:
        spiking = [n for n, (cfg, _) in resolved.items() if cfg.spike_threshold is not None]
        if spiking:
            raise TraceError(
                f"policy {spiking[0]!r} has spike skipping on (spike_threshold="
                f"{resolved[spiking[0]][0].spike_threshold!r}), but trace {trace.name!r} has "
                f"no grad_norm; record each step's gradient norm in a grad_norm column "
                f"(CSV) or list (JSON), or leave spike_threshold unset"
            )
    results = {
        name: _replay(name, trace, config, policy, DTYPE_MAX[dtype])
        for name, (config, policy) in resolved.items()
    }
    if trace.found is None or trace.recorded_with is None:
        return results
    recording = _replay("recording", trace, trace.recorded_with, update, DTYPE_MAX[dtype])
    return {
        name: dataclasses.replace(
            r, matches_recording=r.scales == recording.scales[: len(r.scales)]
        )
        for name, r in results.items()
    }


def _replay(
    name: str, trace: Trace, config: ScalerConfig, policy: PolicyStep, dtype_max: float
) -> PolicyResult:
    state = init(config)
    floor = FLT_MIN if config.min_scale is None else config.min_scale
    scales: list[float] = []
    overflowed: list[bool] = []
    skipped = spike_skips = 0
    collapse_step = None
    norms = trace.grad_norm if config.spike_threshold is not None else None
    for step in range(len(trace)):
        scale = float(state.scale)
        found = trace.overflows(step, scale, dtype_max)
        norm = None if norms is None else norms[step]
        try:
            new = policy_result(repr(name), policy(state, found, norm))
        except ScaleCollapseError:
            collapse_step = step
            break
        scales.append(scale)
        overflowed.append(found)
        # A non-finite step is skipped under every rule; a policy of the user's may not
        # record its kind in last_kind, so the flag counts by itself too.
        if found or step_skipped(new):
            skipped += 1
            spike_skips += not found  # skipped with finite gradients: a spike
        state = new
        if not FLT_MIN <= float(state.scale) <= FLT_MAX:  # a user policy that failed open
            collapse_step = step + 1
            break
    recovery, regrowth = _spikes(scales, overflowed)
    return PolicyResult(
        name=name,
        steps=len(scales),
        skipped_steps=skipped,
        recovery_steps=recovery,
        regrowth_steps=regrowth,
        steps_at_floor=sum(s <= floor for s in scales),
        collapsed=collapse_step is not None,
        collapse_step=collapse_step,
        final_scale=float(state.scale),
        scales=tuple(scales),
        spike_skips=spike_skips,
    )


def _spikes(
    scales: Sequence[float], skipped: Sequence[bool]
) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    recovery: list[int] = []
    regrowth: list[int | None] = []
    n = len(scales)
    t = 0
    while t < n:
        if not skipped[t]:
            t += 1
            continue
        start = t
        while t < n and skipped[t]:
            t += 1
        if t == n:  # the trace ended inside the spike: not recovered
            break
        recovery.append(t - start)
        target = scales[start]
        back = next((u for u in range(t, n) if scales[u] >= target), None)
        regrowth.append(None if back is None else back - t)
    return tuple(recovery), tuple(regrowth)


# ------------------------------------------------------------------------ traces
def load_trace(source: str | Path) -> Trace:
    """Read a trace from a CSV or JSON file, or name a shipped example.

    CSV: a header row with a ``found`` column (``0``/``1``/``true``/``false``)
    or a ``max_abs_grad`` column (numbers, ``nan``, ``inf``); other columns
    (``step``) are ignored. JSON: an object with a ``found`` list (bools) or a
    ``max_abs_grad`` list (numbers; ``null``, ``NaN`` or ``Infinity`` for a
    non-finite step); other keys are ignored. Either may add the per-step
    global gradient norm, a ``grad_norm`` column or list (numbers, ``nan``,
    ``inf``; ``null`` in JSON), which spike skipping needs.

    Args:
        source: A path, or a name from :data:`EXAMPLE_TRACES`.

    Raises:
        TraceError: Missing file, unknown format or a malformed value (the
            message names the file, row and value).
    """
    if str(source) in EXAMPLE_TRACES and not Path(source).exists():
        return example_trace(str(source))
    path = Path(source)
    if not path.is_file():
        raise TraceError(
            f"trace={str(source)!r} is not a file; pass a .csv or .json path or one of "
            f"the examples {sorted(EXAMPLE_TRACES)}"
        )
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a byte order mark is not a header
    except UnicodeDecodeError as exc:
        raise TraceError(
            f"trace {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
            f"save it as UTF-8"
        ) from None
    except OSError as exc:
        raise TraceError(f"trace {str(path)!r} cannot be read: {exc.strerror}") from None
    return _parse(text, path.suffix.lower(), path.stem, str(path))


def example_trace(name: str) -> Trace:
    """One of the shipped example traces (see :data:`EXAMPLE_TRACES`)."""
    if name not in EXAMPLE_TRACES:
        raise TraceError(f"example={name!r}, but it must be one of {sorted(EXAMPLE_TRACES)}")
    filename = EXAMPLE_TRACES[name]
    text = resources.files("scaler_core").joinpath("traces").joinpath(filename).read_text("utf-8")
    return _parse(text, Path(filename).suffix, name, filename)


def _parse(text: str, suffix: str, name: str, where: str) -> Trace:
    if suffix == ".json":
        return _parse_json(text, name, where)
    if suffix == ".csv":
        return _parse_csv(text, name, where)
    raise TraceError(f"trace {where!r} has suffix {suffix!r}, but it must be .csv or .json")


_SHOWN_BITS, _SHOWN_CHARS = 64, 60


def _show(value: object) -> str:
    """``repr(value)``, short: an integer too long to print is described instead."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _SHOWN_BITS:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _flag(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = value.strip().lower() if isinstance(value, str) else None
    if text in ("1", "true"):
        return True
    if text in ("0", "false"):
        return False
    raise TraceError(f"{where}: found={_show(value)}, but it must be 0, 1, true or false")


def _grad(value: object, where: str, key: str = "max_abs_grad") -> float:
    if value is None:
        return math.nan
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
        except OverflowError:  # an integer beyond every float
            raise TraceError(
                f"{where}: {key}={_show(value)} is too large for a float; write "
                f"Infinity (or inf) for a step that overflows at every scale"
            ) from None
    raise TraceError(f"{where}: {key}={_show(value)}, but it must be a number, nan or inf")


def _parse_csv(text: str, name: str, where: str) -> Trace:
    rows = [row for row in csv.reader(io.StringIO(text)) if row]  # blank lines are no steps
    if not rows:
        raise TraceError(f"trace {where!r} is empty; it needs a header row and one row a step")
    header = [cell.strip() for cell in rows[0]]
    repeated = sorted({c for c in header if header.count(c) > 1})
    if repeated:
        raise TraceError(f"trace {where!r} repeats the column {repeated[0]!r} in its header")
    for i, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise TraceError(
                f"trace {where!r} row {i} has {len(row)} cells but the header has {len(header)}"
            )
    norms = None
    if "grad_norm" in header:
        col = header.index("grad_norm")
        norms = tuple(
            _grad(r[col], f"{where} row {i}", "grad_norm") for i, r in enumerate(rows[1:], start=2)
        )
    if "found" in header:
        col = header.index("found")
        found = tuple(_flag(r[col], f"{where} row {i}") for i, r in enumerate(rows[1:], start=2))
        return Trace(name=name, found=found, grad_norm=norms)
    if "max_abs_grad" in header:
        col = header.index("max_abs_grad")
        grads = tuple(_grad(r[col], f"{where} row {i}") for i, r in enumerate(rows[1:], start=2))
        return Trace(name=name, max_abs_grad=grads, grad_norm=norms)
    raise TraceError(
        f"trace {where!r} has columns {sorted(header)}, but it needs a 'found' or a "
        f"'max_abs_grad' column (and a header row)"
    )


def _parse_json(text: str, name: str, where: str) -> Trace:
    try:
        data = json.loads(text)
    except RecursionError:
        raise TraceError(f"trace {where!r} is nested too deeply to be a trace") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise TraceError(f"trace {where!r} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise TraceError(f"trace {where!r} holds a {type(data).__name__}, not a JSON object")
    for key in ("found", "max_abs_grad", "grad_norm"):
        if key in data and not isinstance(data[key], list):
            raise TraceError(f"trace {where!r}: {key!r} must be a list")
    norms = None
    if "grad_norm" in data:
        norms = tuple(
            _grad(v, f"{where} grad_norm[{i}]", "grad_norm")
            for i, v in enumerate(data["grad_norm"])
        )
    source = data.get("source", "")
    if not isinstance(source, str):
        raise TraceError(f"trace {where!r}: 'source' must be a string")
    recorded_with = _recorded_with(data.get("recorded_with"), where)
    if "found" in data:
        return Trace(
            name=name,
            found=tuple(_flag(v, f"{where} found[{i}]") for i, v in enumerate(data["found"])),
            recorded_with=recorded_with,
            source=source,
            grad_norm=norms,
        )
    if "max_abs_grad" in data:
        grads = data["max_abs_grad"]
        return Trace(
            name=name,
            max_abs_grad=tuple(_grad(v, f"{where} max_abs_grad[{i}]") for i, v in enumerate(grads)),
            source=source,
            grad_norm=norms,
        )
    raise TraceError(
        f"trace {where!r} has keys {sorted(data)}, but it needs a 'found' or a 'max_abs_grad' list"
    )


def _recorded_with(data: object, where: str) -> ScalerConfig | None:
    """The ``recorded_with`` key: a config's fields (``ScalerConfig.to_dict()``)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise TraceError(f"trace {where!r}: 'recorded_with' must be an object of config fields")
    try:
        return ScalerConfig(**data)
    except (InvalidConfigError, TypeError) as exc:
        raise TraceError(f"trace {where!r}: 'recorded_with' is not a config: {exc}") from None


# ------------------------------------------------------------------------ report
_COLUMNS = (
    ("policy", "policy"),
    ("steps", "steps"),
    ("skipped", "skipped_steps"),
    ("spikes", "spikes"),
    ("recover mean/max", None),
    ("regrow mean", "regrowth_steps_mean"),
    ("at floor", "steps_at_floor"),
    ("collapsed", None),
    ("final scale", "final_scale"),
)


def format_report(trace: Trace, results: Mapping[str, PolicyResult], dtype: str) -> str:
    """A plain-text table of :meth:`PolicyResult.summary` for every policy.

    A trace with ``grad_norm`` adds a ``spike skips`` column after ``skipped``.
    """
    columns = list(_COLUMNS)
    norms = trace.grad_norm is not None
    if norms:
        columns.insert(3, ("spike skips", "spike_skips"))
    rows = [[title for title, _ in columns]]
    for result in results.values():
        s = result.summary()
        rows.append(
            [
                s["policy"],
                str(s["steps"]),
                str(s["skipped_steps"]),
                *([str(s["spike_skips"])] if norms else []),
                str(s["spikes"]),
                f"{_num(s['recovery_steps_mean'])}/{_num(s['recovery_steps_max'])}",
                _num(s["regrowth_steps_mean"])
                + (f" ({s['never_regrown']} never)" if s["never_regrown"] else ""),
                str(s["steps_at_floor"]),
                f"at step {s['collapse_step']}" if s["collapsed"] else "no",
                f"{s['final_scale']:.6g}",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    lines = [
        f"trace {trace.name}: {len(trace)} steps, "
        + (f"max_abs_grad under {dtype}" if trace.max_abs_grad is not None else "found flags")
        + (", grad_norm" if norms else "")
    ]
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.extend(_notes(trace, results))
    return "\n".join(lines)


def _notes(trace: Trace, results: Mapping[str, PolicyResult]) -> list[str]:
    """What a reader must know to trust the table: found flags are not policy-free."""
    if trace.found is None:
        return []
    others = [name for name, r in results.items() if r.matches_recording is False]
    if trace.recorded_with is None:
        return [
            "note: found flags are replayed as recorded; a policy at other scales than the "
            "recording run would have met other overflows (compare policies on a "
            "max_abs_grad trace)"
        ]
    if not others:
        return []
    they = len(others) > 1
    text = (
        f"note: these flags were recorded under another policy than {', '.join(others)} "
        f"({_brief(trace.recorded_with)}): at the scales {'they' if they else 'it'} replayed "
        f"them the run's overflows would have differed, so {'their' if they else 'its'} rows "
        f"are not what {'they' if they else 'it'} would have met; compare policies on a "
        f"max_abs_grad trace"
    )
    return textwrap.wrap(text, width=96, subsequent_indent="  ")


def _brief(config: ScalerConfig) -> str:
    """The fields of ``config`` that differ from the defaults, as ``name=value``."""
    default = ScalerConfig()
    changed = [
        f"{f.name}={getattr(config, f.name)!r}"
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(default, f.name)
    ]
    return "ScalerConfig(" + ", ".join(changed) + ")"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
