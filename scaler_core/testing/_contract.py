"""The Backend contract as runnable checks: :func:`check_backend`.

One place states what every backend must do, in the terms of the
:class:`~scaler_core.Backend` protocol's docstrings, and every backend of
scaler-core runs it (``tests/backends/test_contract.py``); the author of a
backend registered with :func:`scaler_core.register_backend` runs the same
checks. The expected values are computed with NumPy, from the rules alone
(``_rules``): ``inv_scale = f32(1 / f64(scale))``, float16/bfloat16 computed in
float32 and rounded back, the non-finite check on the unscaled values. So passing
the checks means giving the same bits as every other backend (NaN payloads aside).

This module runs the checks and reports their failures; the checks themselves live
in ``_checks_namespace``, ``_checks_unscale``, ``_checks_clip`` and ``_checks_step``,
the arrays of each library come from ``_conversions``.

Needs NumPy only (no hypothesis): the inputs are fixed and seeded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from .._backend import Backend, get_backend
from .._errors import BackendContractError, InvalidArgumentError
from ._checks_clip import check_norm_and_clip
from ._checks_namespace import check_namespace, check_protocol
from ._checks_step import check_flags, check_select, check_update
from ._checks_unscale import (
    check_find_non_finite,
    check_leaf_report,
    check_rejects_bad_leaves,
    check_rejects_bad_scales,
    check_scale_loss,
    check_subnormals,
    check_unscale_trees,
    check_unscale_values,
)
from ._conversions import default_conversions, round_trips
from ._harness import BackendSubject, Check

__all__ = ["BACKEND_CHECKS", "check_backend"]

_CHECKS: Mapping[str, Callable[[Check], None]] = MappingProxyType(
    {
        "protocol": check_protocol,
        "namespace": check_namespace,
        "unscale_values": check_unscale_values,
        "unscale_trees": check_unscale_trees,
        "subnormals": check_subnormals,
        "find_non_finite": check_find_non_finite,
        "leaf_report": check_leaf_report,
        "norm_and_clip": check_norm_and_clip,
        "rejects_bad_leaves": check_rejects_bad_leaves,
        "rejects_bad_scales": check_rejects_bad_scales,
        "scale_loss": check_scale_loss,
        "select": check_select,
        "flags": check_flags,
        "update": check_update,
    }
)

#: What each check asks of a backend, by name, in the order :func:`check_backend` runs them.
BACKEND_CHECKS: Mapping[str, str] = MappingProxyType(
    {name: " ".join((check.__doc__ or "").split()) for name, check in _CHECKS.items()}
)


def check_backend(
    backend: Backend | str,
    *,
    asarray: Callable[[np.ndarray], Any] | None = None,
    to_numpy: Callable[[Any], np.ndarray] | None = None,
    flushes_subnormals: bool | None = None,
    only: Iterable[str] | None = None,
) -> list[str]:
    """Run the Backend contract's checks on ``backend``; raise at the first broken one.

    The checks (:data:`BACKEND_CHECKS`) cover the arithmetic of ``unscale``
    for every dtype the library has (bits equal to the rules, the flag taken on
    the unscaled values, a host or a device scale), nested trees with ``None``,
    0-d, empty and strided leaves, detection alone, refusals before anything is
    touched (bad leaves, bad scales), ``scale_loss``, ``select`` (and its
    refusal of mismatched trees), ``any``/``to_bool`` and ``update``.

    Args:
        backend: A backend object, or the name it is registered under.
        asarray: Turns a host NumPy array into an array of the backend's library;
            known for the ``numpy``, ``jax``, ``cupy``, ``torch``, ``mlx`` and
            ``array_api`` backends.
        to_numpy: The way back.
        flushes_subnormals: The library flushes subnormals in arithmetic (see
            :class:`BackendSubject`); by default true for ``jax`` (XLA), false
            otherwise.
        only: Names of the checks to run; all when omitted.

    Returns:
        The names of the checks that ran (all passed).

    Raises:
        BackendContractError: A check failed; the message names it, the case,
            the member and what the rules expect. An exception the contract does
            not document, raised by a member (or by ``asarray``/``to_numpy``), is
            reported so too, naming the call and chained from the original.
        InvalidArgumentError: ``only`` names an unknown check, or ``asarray`` /
            ``to_numpy`` are needed and missing.

    >>> import scaler_core as sc
    >>> check_backend(sc.get_backend("numpy"), only=["unscale_values", "select"])
    ['unscale_values', 'select']
    """
    backend = get_backend(backend)
    names = list(_CHECKS) if only is None else list(only)
    unknown = sorted(set(names) - set(_CHECKS))
    if unknown:
        raise InvalidArgumentError(
            f"only={names!r} names {unknown!r}, but the checks are {list(BACKEND_CHECKS)!r}"
        )
    if asarray is None or to_numpy is None:
        default_in, default_out = default_conversions(backend)
        asarray = default_in if asarray is None else asarray
        to_numpy = default_out if to_numpy is None else to_numpy
    name = str(getattr(backend, "name", ""))
    flushes = name == "jax" if flushes_subnormals is None else bool(flushes_subnormals)
    subject = BackendSubject(backend, asarray, to_numpy, round_trips(asarray, to_numpy), flushes)
    if not subject.dtypes:
        raise BackendContractError(
            f"check 'dtypes' failed for backend {subject.name!r}: asarray/to_numpy round-trip "
            f"none of float16, bfloat16, float32, float64"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        for name in names:
            _run(name, subject)
    return names


def _run(name: str, subject: BackendSubject) -> None:
    """Check ``name``; whatever a member raises that the contract does not document
    becomes a :class:`BackendContractError` naming the call (chained from it), with the
    namespace's own fault where it has one (the flag operations and the transition run
    on it, so its faults surface anywhere)."""
    check = Check(name, subject)
    try:
        _CHECKS[name](check)
    except Exception as exc:
        error = exc if isinstance(exc, BackendContractError) else check.unexpected(exc)
        fault = None if name in ("protocol", "namespace") else _namespace_fault(subject)
        if fault is not None:
            error = BackendContractError(
                f"{error}; namespace() breaks the contract too, which may be why: {fault}"
            )
        if error is exc:
            raise
        raise error from exc


def _namespace_fault(subject: BackendSubject) -> str | None:
    """What the ``namespace`` check finds wrong with the backend's namespace, or None."""
    probe = Check("namespace", subject)
    try:
        check_namespace(probe)
    except BackendContractError as exc:
        return str(exc).removeprefix(probe.prefix)
    except Exception as exc:
        return str(probe.unexpected(exc)).removeprefix(probe.prefix)
    return None
