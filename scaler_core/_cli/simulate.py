"""``scaler-core simulate``: the command line over :mod:`scaler_core.simulate`."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from scaler_core import simulate as library
from scaler_core._config import ScalerConfig
from scaler_core._errors import InvalidArgumentError
from scaler_core._presets import PRESETS, preset
from scaler_core.simulate import (
    DTYPE_MAX,
    EXAMPLE_TRACES,
    PolicyResult,
    PolicySpec,
    format_report,
    load_trace,
    simulate,
)

from . import plain_text
from ._files import PLOT_FORMATS, check_output, write
from ._plot import pyplot

__all__ = ["add_parser", "run", "write_plot"]


def write_plot(results: Mapping[str, PolicyResult], path: str | Path, title: str) -> None:
    """Draw each policy's scale trajectory (log scale) into an image file.

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    plt = pyplot("--plot")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for result in results.values():
        label = result.name + (" (collapsed)" if result.collapsed else "")
        ax.step(range(result.steps), result.scales, where="post", label=label, linewidth=1)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fmt = PLOT_FORMATS.get(Path(path).suffix.lower(), "png")
    try:
        write("--plot", str(path), lambda p: fig.savefig(p, format=fmt, dpi=110))
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- CLI
_MODULE_ATTR = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def _policy_arg(text: str) -> tuple[str, PolicySpec]:
    """A preset name, or ``module:attr`` naming a config, a (config, policy) pair or a policy."""
    if ":" not in text:
        if text not in PRESETS:
            raise InvalidArgumentError(
                f"--policy {text!r} is not a preset ({', '.join(sorted(PRESETS))}) nor a "
                f"module:attribute"
            )
        return text, text
    if not _MODULE_ATTR.fullmatch(text):
        raise InvalidArgumentError(
            f"--policy {text!r} is not a preset nor module:attribute (a dotted module name, "
            f"a colon, a name: my_policies:cautious)"
        )
    module, _, attr = text.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # not found, or the module itself raised while importing
        raise InvalidArgumentError(
            f"--policy {text!r} cannot be imported: {type(exc).__name__}: {exc}"
        ) from None
    if isinstance(obj, (ScalerConfig, tuple)):
        return attr, obj
    if callable(obj):
        return attr, (ScalerConfig(), obj)
    raise InvalidArgumentError(
        f"--policy {text!r} is a {type(obj).__name__}, but it must be a ScalerConfig, a "
        f"(ScalerConfig, policy) pair or a policy function"
    )


def _with_spikes(spec: PolicySpec, args: argparse.Namespace) -> PolicySpec:
    """``spec`` with the command line's spike skipping in its config."""
    if args.spike_threshold is None:
        raise InvalidArgumentError(
            f"--spike-window {args.spike_window} needs --spike-threshold K too (spike "
            f"skipping is off without a threshold)"
        )
    knobs: dict[str, Any] = {"spike_threshold": args.spike_threshold}
    if args.spike_window is not None:
        knobs["spike_window"] = args.spike_window
    if isinstance(spec, str):
        return preset(spec, **knobs)
    if isinstance(spec, ScalerConfig):
        return dataclasses.replace(spec, **knobs)
    if isinstance(spec, tuple) and spec and isinstance(spec[0], ScalerConfig):
        return (dataclasses.replace(spec[0], **knobs), *spec[1:])
    return spec  # not a policy spec: simulate() refuses it, naming it


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``simulate`` command to a ``scaler-core`` argument parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay a trace under several loss-scale policies and compare them",
        description=plain_text(library.__doc__.split("\n\n")[1]) if library.__doc__ else None,
    )
    parser.add_argument(
        "trace",
        help=f"a .csv or .json trace, or a shipped example: {', '.join(EXAMPLE_TRACES)}",
    )
    parser.add_argument(
        "--policy",
        action="append",
        metavar="NAME",
        help="a preset (repeatable; default: all presets) or module:attribute of your own",
    )
    parser.add_argument(
        "--dtype",
        default="float16",
        choices=sorted(DTYPE_MAX),
        help="gradient dtype for max_abs_grad traces (default float16)",
    )
    parser.add_argument(
        "--spike-threshold",
        type=float,
        metavar="K",
        help="turn spike skipping on in every policy: skip a step whose grad_norm is more "
        "than K standard deviations above its window (needs a trace with grad_norm)",
    )
    parser.add_argument(
        "--spike-window",
        type=int,
        metavar="W",
        help="the window of steps for --spike-threshold (default 128)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="draw the scale trajectories to this .png, .pdf or .svg file",
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``scaler-core simulate`` with parsed arguments; returns the exit code."""
    out = sys.stdout if out is None else out
    if args.plot is not None:  # everything that can be refused is, before any work
        check_output("--plot", args.plot, PLOT_FORMATS)
        pyplot("--plot")
    names = args.policy or sorted(PRESETS)
    specs = dict(_policy_arg(text) for text in names)
    if args.spike_threshold is not None or args.spike_window is not None:
        specs = {name: _with_spikes(spec, args) for name, spec in specs.items()}
    trace = load_trace(args.trace)
    if args.spike_threshold is not None and trace.grad_norm is None:
        raise InvalidArgumentError(
            f"--spike-threshold {args.spike_threshold:g} needs each step's gradient norm, but "
            f"trace {trace.name!r} has no grad_norm column (CSV) or list (JSON); record it, "
            f"or leave out --spike-threshold"
        )
    results = simulate(trace, specs, dtype=args.dtype)
    if args.json:
        recorded = trace.recorded_with
        payload = {
            "trace": trace.name,
            "steps": len(trace),
            "dtype": args.dtype,
            "recorded_with": None if recorded is None else recorded.to_dict(),
            "policies": [r.summary() for r in results.values()],
        }
        json.dump(payload, out, indent=2)
        out.write("\n")
    else:
        out.write(format_report(trace, results, args.dtype) + "\n")
    if args.plot:
        write_plot(results, args.plot, f"loss scale on trace {trace.name}")
        if not args.json:
            out.write(f"plot written to {args.plot}\n")
    return 0
