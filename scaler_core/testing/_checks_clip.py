"""The check ``norm_and_clip``: the global norm and PyTorch's clip coefficient, through
the operations users call and through the passes under them as the core calls them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._errors import InvalidArgumentError
from .._f32 import f32
from ._harness import Check
from ._rules import gradients, same_bits, unscaled

__all__ = ["check_norm_and_clip"]


def _exact_norm(arrays: Iterable[np.ndarray]) -> float:
    return math.sqrt(math.fsum(float(v) ** 2 for a in arrays for v in a.astype(np.float64).ravel()))


def _clipped(u: np.ndarray, coef: np.float32) -> np.ndarray:
    """The rules' clipped value of an unscaled leaf: ``u * coef`` in float32 (float64 for
    float64), rounded to the leaf's dtype."""
    if u.dtype == np.dtype(np.float64):
        return np.asarray(u * np.float64(coef))
    return np.asarray(u.astype(np.float32) * coef, dtype=u.dtype)


def _coefficient(norm: float, max_norm: float) -> np.float32:
    """PyTorch's ``clip_grad_norm_`` coefficient in its float32 steps, clamped at 1."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        coef = (np.float32(1.0) / (np.float32(norm) + np.float32(1e-6))) * np.float32(max_norm)
    out: np.float32 = np.float32(min(coef, np.float32(1.0)))
    return out


def check_norm_and_clip(c: Check) -> None:
    """``unscale_and_norm`` writes ``unscale``'s bits and a norm within 1e-6 of the exact one
    (non-finite with the flag); ``unscale_and_clip`` stores the rules' clipped values for its
    norm, the coefficient clamped at 1 (a norm below ``max_norm`` changes nothing), writes
    nothing on a skipped step (a planted NaN, or ``reduce`` saying skip), and refuses a bad
    ``max_norm`` before anything changes; on a tree of every dtype, ``measure`` without
    ``write`` writes nothing, and nothing at all on leaves made with ``writable=False``;
    an array given twice (a tied weight) is counted once in the norm."""
    for i, dtype in enumerate(c.subject.dtypes):
        host = gradients(dtype, 1024.0, 37, seed=900 + i)
        want = unscaled(host, 1024.0)
        exact = _exact_norm([want])
        out, found, norm = c.unscale_and_norm([c.array(host.copy())], 1024.0)
        if not same_bits(c.host(out[0]), want):
            raise c.fail(f"unscale_and_norm of {dtype} did not store unscale()'s values")
        got = float(c.host(norm))
        if c.flag(found, "unscale_and_norm()") or abs(got - exact) > 1e-6 * exact:
            raise c.fail(
                f"unscale_and_norm of {dtype} gave norm {got!r}, the exact one is {exact!r}"
            )
        out, found, norm = c.unscale_and_clip([c.array(host.copy())], 1024.0, 1.0)
        coef = _coefficient(float(c.host(norm)), 1.0)
        if c.flag(found, "unscale_and_clip()") or not same_bits(
            c.host(out[0]), _clipped(want, coef)
        ):
            raise c.fail(
                f"unscale_and_clip of {dtype} did not store the unscaled values times {coef}"
            )
        bad = host.copy()
        bad[3] = np.nan
        for reduce, grads in ((None, bad), (lambda f: c.backend.any(f, True), host)):
            given = [c.array(grads.copy())]
            out, found, norm = c.unscale_and_clip(given, 1024.0, 1.0, reduce)
            if not c.flag(found, "unscale_and_clip()"):
                raise c.fail(f"unscale_and_clip of {dtype} did not report the skip")
            if not (same_bits(c.host(out[0]), grads) and same_bits(c.host(given[0]), grads)):
                raise c.fail(
                    f"unscale_and_clip of {dtype} wrote to the gradients of a skipped step"
                )
        if math.isfinite(float(c.host(c.unscale_and_norm([c.array(bad.copy())], 1024.0)[2]))):
            raise c.fail(f"unscale_and_norm of {dtype} with a NaN gave a finite norm")
    _check_clip_passes(c)
    given = [c.array(gradients(c.subject.dtypes[-1], 2.0, 5, seed=7))]
    before = c.host(given[0])
    bad_norms: tuple[Any, ...] = (0.0, -1.0, float("inf"), float("nan"), True, "1")
    for max_norm in bad_norms:
        c.raises(
            InvalidArgumentError,
            functools.partial(c.unscale_and_clip, given, 2.0, max_norm),
            f"unscale_and_clip(max_norm={max_norm!r})",
            "max_norm",
        )
    if not same_bits(c.host(given[0]), before):
        raise c.fail("a refused unscale_and_clip changed the gradients")
    _check_tied_norm(c)


def _check_tied_norm(c: Check) -> None:
    """One array given twice (a tied weight's gradient) is one gradient: its squares are
    counted once in the norm, as every other pass counts it once."""
    host = gradients(c.subject.dtypes[-1], 1024.0, 37, seed=31)
    exact = _exact_norm([unscaled(host, 1024.0)])
    tied = c.array(host.copy())
    got = float(c.host(c.unscale_and_norm([tied, tied], 1024.0)[2]))
    if abs(got - exact) > 1e-6 * exact:
        raise c.fail(
            f"unscale_and_norm of one array given twice gave norm {got!r}; counted once it "
            f"is {exact!r} (counted twice, {exact * math.sqrt(2)!r})"
        )


def _clip_tree(c: Check, scale: float, nan_at: int | None = None) -> tuple[Any, ...]:
    """A tree of one leaf per dtype and a 0-d leaf: ``(tree, leaves, paths, hosts)``,
    with a NaN in leaf ``nan_at`` when given."""
    dtypes = c.subject.dtypes
    hosts = [gradients(d, scale, 29, seed=950 + i) for i, d in enumerate(dtypes)]
    hosts.append(np.array(gradients(dtypes[-1], scale, 3, seed=990)[2]))
    if nan_at is not None:
        hosts[nan_at].reshape(-1)[-1] = np.nan
    leaves = [c.array(h.copy()) for h in hosts]
    paths = [f"grads['g'][{i}]" for i in range(len(dtypes))] + ["grads['s'][0]"]
    return {"g": leaves[:-1], "s": (leaves[-1],)}, leaves, paths, hosts


def _tree_leaves(tree: Any) -> list[Any]:
    return [*tree["g"], tree["s"][0]]


def _first_changed(c: Check, paths: list[str], leaves: list[Any], hosts: list[Any]) -> str:
    """The path of the first leaf whose values are no longer ``hosts``'s ('' for none)."""
    for path, leaf, host in zip(paths, leaves, hosts, strict=True):
        if not same_bits(c.host(leaf), host):
            return path
    return ""


def _check_clip_passes(c: Check) -> None:
    """The passes under the clip, called as the core calls them, on a tree of every dtype:
    the read-only pass writes nothing, a skipped step writes nothing, and ``clip``
    stores the rules' values, the coefficient clamped at 1."""
    backend, scale = c.backend, 1024.0
    tree, leaves, paths, hosts = _clip_tree(c, scale)
    exact = _exact_norm(unscaled(h, scale) for h in hosts)
    call = "measure(plan(grads, writable=False), scale, write=False)"
    c.now(call)
    _, found, norm = backend.measure(backend.plan(tree, writable=False), scale, write=False)
    changed = _first_changed(c, paths, leaves, hosts)
    if changed:
        raise c.fail(
            f"{call} changed {changed}, but on a plan made with writable=False measure "
            f"must write nothing (the read-only pass: fold_clip measures gradients that a "
            f"fused optimizer then reads, still scaled)"
        )
    got = float(c.host(norm))
    if c.flag(found, "measure()") or abs(got - exact) > 1e-6 * exact:
        raise c.fail(f"{call} gave the norm {got!r}, the exact one is {exact!r}")
    for nan_at in (1, None):  # a NaN flags the skip; else the caller's decision does
        tree, leaves, paths, hosts = _clip_tree(c, scale, nan_at)
        call = "measure(plan(grads, writable=True), scale, write=False)"
        c.now(call)
        prepared = backend.plan(tree, writable=True)
        _, found, norm = backend.measure(prepared, scale, write=False)
        changed = _first_changed(c, paths, leaves, hosts)
        if changed:
            raise c.fail(
                f"{call} changed {changed} before a skipped step, but without write "
                f"measure must write nothing: a skipped step's gradients keep their scaled "
                f"values"
            )
        skip = found if nan_at is not None else backend.any(found, True)
        call = "clip(plan, scale, norm, max_norm=1.0, skip=<a true flag>)"
        c.now(call)
        out = backend.clip(prepared, scale, norm, 1.0, skip)
        changed = _first_changed(c, paths, leaves, hosts) or _first_changed(
            c, paths, _tree_leaves(out), hosts
        )
        if changed:
            raise c.fail(
                f"{call} changed {changed}, but on a skipped step clip must write "
                f"nothing: the gradients keep their scaled values"
            )
    for factor in (0.25, 20.0):  # max_norm below the norm, then above it
        tree, leaves, paths, hosts = _clip_tree(c, scale)
        max_norm = float(f32(exact * factor))
        prepared = backend.plan(tree, writable=True)
        c.now("measure(plan(grads, writable=True), scale, write=False)")
        _, found, norm = backend.measure(prepared, scale, write=False)
        measured = float(c.host(norm))
        coef = _coefficient(measured, max_norm)
        call = f"clip(plan, scale, norm={measured!r}, max_norm={max_norm!r}, skip=False)"
        c.now(call)
        out = backend.clip(prepared, scale, norm, max_norm, found)
        for path, leaf, host in zip(paths, _tree_leaves(out), hosts, strict=True):
            stored, want = c.host(leaf), _clipped(unscaled(host, scale), coef)
            if same_bits(stored, want):
                continue
            shown = _difference(path, stored, want)
            if coef != 1:
                raise c.fail(f"{call} stored {shown} (the unscaled value times {float(coef)!r})")
            raise c.fail(
                f"{call} stored {shown} (the unscaled values times {_ratio(stored, want):.4g}), "
                f"but the coefficient min(1, max_norm / (norm + 1e-6)) is clamped at 1: a "
                f"norm below max_norm must leave unscale()'s values as they are"
            )


def _difference(path: str, got: np.ndarray, want: np.ndarray) -> str:
    """Where ``got`` first differs from ``want``, for a message: ``grads[0][2]=1.5, the
    rules give 0.75``."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return (
            f"{path} as a {got.dtype} array of shape {got.shape}, the rules give a "
            f"{want.dtype} array of shape {want.shape}"
        )
    differs = ~np.array(
        [same_bits(g, w) for g, w in zip(got.reshape(-1), want.reshape(-1), strict=True)]
    )
    at = tuple(int(i) for i in np.unravel_index(int(np.argmax(differs)), got.shape))
    index = "".join(f"[{i}]" for i in at)
    return f"{path}{index}={got[at]}, the rules give {want[at]}"


def _ratio(got: np.ndarray, want: np.ndarray) -> float:
    """The median of ``got / want`` over the finite, non-zero elements (NaN for none)."""
    g, w = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    keep = np.isfinite(g) & np.isfinite(w) & (w != 0)
    return float(np.median(g[keep] / w[keep])) if keep.any() else math.nan
