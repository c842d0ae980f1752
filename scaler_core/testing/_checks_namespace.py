"""The checks of what a backend is: ``protocol`` (every member of the Backend protocol)
and ``namespace`` (what its :meth:`~scaler_core.Backend.namespace` serves the core,
member by member, as :data:`NAMESPACE_DUTIES` states it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from .._backend import missing_members
from .._coerce import describe, host_flag
from .._errors import BackendContractError, GradientTypeError, InvalidArgumentError
from .._f32 import f32
from ._harness import Check
from ._rules import same_bits

__all__ = ["NAMESPACE_DUTIES", "check_namespace", "check_protocol"]


def check_protocol(c: Check) -> None:
    """The object has every method of the protocol and a non-empty ``name``."""
    missing = missing_members(c.backend)
    if missing:
        raise c.fail(
            f"it lacks {missing} of the Backend protocol (members served by __getattr__ "
            f"do not count: define them on its class)"
        )
    if not isinstance(c.backend.name, str) or not c.backend.name:
        raise c.fail(f"name={c.backend.name!r} is not a non-empty str")


#: What the core asks of a backend's :meth:`~scaler_core.Backend.namespace`, member by
#: member: the call as the core makes it, and what it must give. Every member the core
#: reads is here (a test holds this against ``scaler_core._ops`` and ``_state``), and the
#: ``namespace`` check holds each one to its line, naming it when it breaks.
NAMESPACE_DUTIES: Mapping[str, str] = MappingProxyType(
    {
        "on_host": "on_host must be True (flags are host values and the core decides on "
        "the host) or False (a device library: nothing is read back)",
        "float64_missing": "float64_missing must be None where float64 is exact, else a str "
        "saying how to enable it",
        "flag": "flag(value) must return a flag holding the bool value: where on_host, a "
        "bool or numpy.bool_; else a 0-d array of its library whose dtype isdtype calls "
        "'bool', made on its device",
        "read": "read(flag) must return the flag's value as a Python bool (the one host "
        "synchronisation)",
        "is_array": "is_array(value) must return whether value is an array of its library "
        "(True for its flags and arrays, False for a Python float)",
        "logical_or": "logical_or(a, b) must return the flag a or b",
        "where": "where(cond, a, b) must return a where the flag cond is true, else b, bit "
        "for bit (a and b arrays, float32(x) values or Python numbers)",
        "map_pairs": "map_pairs(fn, on_skip, on_step) must call fn(path, a, b) for each pair "
        "of leaves (path a str naming the leaf, a from on_skip, b from on_step), return a "
        "tree of on_step's structure holding fn's results, and raise InvalidArgumentError "
        "where the trees differ",
        "asarray": "asarray(value, dtype=None) must return an array of its library with "
        ".shape and .dtype: of a Python number or bool a 0-d array holding it rounded to "
        "dtype (float32, float64, int32, Python bool or None), of one of its arrays an "
        "array of the same shape and dtype",
        "float32": "float32 must be a dtype asarray(value, dtype=float32) takes, and "
        "callable: float32(x) is x rounded to float32, a 0-d value arrays compute with",
        "float64": "float64 must be a dtype asarray(value, dtype=float64) takes, and "
        "callable: float64(x) is x as a float64 value arrays compute with (exact where "
        "float64_missing is None)",
        "int32": "int32 must be a dtype asarray(value, dtype=int32) takes",
        "isdtype": "isdtype(dtype, kind) must answer, as the Array API's isdtype does, "
        "whether a dtype of its library is of kind 'bool' (a flag's) or 'real floating' "
        "(float16, bfloat16, float32, float64: a norm's), with a Python bool",
        "isfinite": "isfinite(x) must be False for NaN, inf and -inf and True for every "
        "finite value (the transition grows the scale only where the product is finite)",
        "maximum": "maximum(a, b) must return the larger of two float32 values",
        "minimum": "minimum(a, b) must return the smaller of two float32 values",
    }
)


class _Namespace:
    """A backend's namespace under the ``namespace`` check: each call named, and refused
    with the member's duty when it raises or gives the wrong thing."""

    def __init__(self, c: Check, xp: Any) -> None:
        self.c, self.xp = c, xp

    def broken(self, call: str, did: str) -> BackendContractError:
        member = call.partition("(")[0]
        return self.c.fail(f"namespace().{call} {did}, but {NAMESPACE_DUTIES[member]}")

    def __call__(self, call: str, *args: Any, **kwargs: Any) -> Any:
        """``namespace().<member>(*args, **kwargs)``; ``call`` shows it in messages."""
        self.c.now(f"namespace().{call}")
        try:
            return getattr(self.xp, call.partition("(")[0])(*args, **kwargs)
        except BackendContractError:
            raise
        except Exception as exc:
            raise self.broken(call, f"raised {type(exc).__name__}: {exc}") from exc

    def array(self, call: str, value: Any, shape: tuple[int, ...] = ()) -> Any:
        """``value``, which ``call`` returned, after checking it is an array of ``shape``."""
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise self.broken(call, f"returned {value!r}, which has no .shape and .dtype")
        if tuple(value.shape) != shape:
            raise self.broken(call, f"returned an array of shape {tuple(value.shape)}, not {shape}")
        return value

    def number(self, call: str, value: Any, want: float) -> None:
        """``value`` (a 0-d array ``call`` returned) must read back as ``want``."""
        try:
            got = float(value)
        except Exception as exc:
            raise self.broken(
                call, f"returned {describe(value)}, which float() cannot read"
            ) from exc
        if not (got == want or (math.isnan(got) and math.isnan(want))):
            raise self.broken(call, f"gave {got!r}, not {want!r}")

    def truth(self, call: str, value: Any, want: bool) -> None:
        """``value`` (a flag ``call`` returned) must read back as ``want``."""
        got = self(f"read({call})", value)
        if got is not want:
            raise self.broken(call, f"gave a flag that reads as {got!r}, not {want!r}")


def check_namespace(c: Check) -> None:
    """``namespace()`` serves every member the core reads, called as the core calls it:
    ``on_host``, ``float64_missing``, ``flag``, ``read``, ``is_array``, ``logical_or``,
    ``where``, ``map_pairs`` (``fn(path, a, b)``), ``asarray`` (arrays with ``.shape`` and
    ``.dtype``), the dtypes ``float32``, ``float64`` (both callable) and ``int32``,
    ``isfinite`` (false for NaN and +-inf), ``maximum`` and ``minimum``."""
    c.now("namespace()")
    xp = c.backend.namespace()
    missing = [m for m in NAMESPACE_DUTIES if not hasattr(xp, m)]
    if missing:
        raise c.fail(
            f"namespace() returned a {type(xp).__qualname__} without {missing}, but the core "
            f"reads every one of {list(NAMESPACE_DUTIES)}"
        )
    ns = _Namespace(c, xp)
    if xp.on_host not in (True, False):
        raise ns.broken("on_host", f"is {xp.on_host!r}")
    if xp.float64_missing is not None and not isinstance(xp.float64_missing, str):
        raise ns.broken("float64_missing", f"is {xp.float64_missing!r}")
    flags = _namespace_flags(ns)
    _namespace_values(ns, flags)
    _namespace_leaves(ns, flags)


def _namespace_flags(ns: _Namespace) -> dict[bool, Any]:
    """``flag``, ``read`` and ``logical_or``: the flags ``flag(True)`` and ``flag(False)``."""
    flags = {}
    for value in (True, False):
        call = f"flag({value})"
        flag = ns(call, value)
        if ns.xp.on_host:
            try:
                ok = host_flag(flag) is not None
            except GradientTypeError:
                ok = False
        else:
            ok = (
                ns(f"is_array({call})", flag) is True
                and tuple(getattr(flag, "shape", (1,))) == ()
                and ns(f"isdtype({call}.dtype, 'bool')", getattr(flag, "dtype", None), "bool")
                is True
            )
        if not ok:
            raise ns.broken(call, f"returned {describe(flag)}")
        got = ns(f"read({call})", flag)
        if type(got) is not bool or got is not value:
            raise ns.broken("read", f"of flag({value}) returned {got!r}")
        flags[value] = flag
    for a in (True, False):
        for b in (True, False):
            call = f"logical_or(flag({a}), flag({b}))"
            ns.truth(call, ns(call, flags[a], flags[b]), a or b)
    return flags


def _namespace_values(ns: _Namespace, flags: dict[bool, Any]) -> None:
    """The 0-d values the transition and the clip coefficient compute with: ``asarray``,
    the dtypes, ``isfinite``, ``maximum``, ``minimum`` and ``where``."""
    xp, f32_, i32 = ns.xp, ns.xp.float32, ns.xp.int32
    for value, dtype, name in ((0.1, f32_, "float32"), (7, i32, "int32"), (-2.5, f32_, "float32")):
        call = f"asarray({value!r}, dtype={name})"
        ns.number(call, ns.array(call, ns(call, value, dtype=dtype)), f32(value))
    if xp.float64_missing is None:
        call = "asarray(0.1, dtype=float64)"
        ns.number(call, ns.array(call, ns(call, 0.1, dtype=xp.float64)), 0.1)
        ns.number("float64(0.1)", ns("float64(0.1)", 0.1), 0.1)
    for value in (True, False):
        call = f"asarray({value}, dtype=bool)"
        ns.truth(call, ns.array(call, ns(call, value, dtype=bool)), value)
    ns.truth("asarray(False)", ns.array("asarray(False)", ns("asarray(False)", False)), False)
    ns.number("float32(0.1)", ns("float32(0.1)", 0.1), f32(0.1))

    def f32_array(value: float) -> Any:
        call = f"asarray({value!r}, dtype=float32)"
        return ns.array(call, ns(call, value, dtype=f32_))

    two, three = f32_array(2.0), f32_array(3.0)
    ns.c.now("arithmetic on namespace().asarray(2.0, dtype=float32) and float32(0.5)")
    ns.number("float32(0.5)", two * ns("float32(0.5)", 0.5), 1.0)
    ns.truth("asarray(2.0, dtype=float32) < asarray(3.0, dtype=float32)", two < three, True)
    for value in (1.0, 3.0e38, math.inf, -math.inf, math.nan):
        call = f"isfinite(asarray({value!r}, dtype=float32))"
        ns.truth(call, ns(call, f32_array(value)), math.isfinite(value))
    ns.number("maximum(2.0, float32(3.0))", ns("maximum", two, ns("float32(3.0)", 3.0)), 3.0)
    ns.number("maximum(3.0, float32(2.0))", ns("maximum", three, ns("float32(2.0)", 2.0)), 3.0)
    ns.number("minimum(2.0, 3.0)", ns("minimum", two, three), 2.0)
    ns.number("minimum(3.0, 2.0)", ns("minimum", three, two), 2.0)
    seven = ns("asarray(7, dtype=int32)", 7, dtype=i32)
    kinds = (
        ("flag(True)", flags[True].dtype, {"bool": True, "real floating": False}),
        ("asarray(2.0, dtype=float32)", two.dtype, {"bool": False, "real floating": True}),
        ("asarray(7, dtype=int32)", seven.dtype, {"bool": False, "real floating": False}),
    )
    for made, dtype, answers in kinds:
        for kind, answer in answers.items():
            call = f"isdtype({made}.dtype, {kind!r})"
            got = ns(call, dtype, kind)
            if got is not answer:
                raise ns.broken(call, f"returned {got!r}, not {answer!r}")
    for value in (True, False):
        call = f"where(flag({value}), asarray(2.0, dtype=float32), asarray(3.0, dtype=float32))"
        ns.number(call, ns(call, flags[value], two, three), 2.0 if value else 3.0)
        call = f"where(flag({value}), 5, asarray(7, dtype=int32))"
        ns.number(call, ns(call, flags[value], 5, seven), 5 if value else 7)


def _namespace_leaves(ns: _Namespace, flags: dict[bool, Any]) -> None:
    """What ``select`` asks of the namespace for the library's arrays: ``asarray`` keeps
    shape and dtype, and on a device ``is_array`` and ``where``; then ``map_pairs``."""
    c = ns.c
    hosts = [np.arange(6, dtype=d).reshape(2, 3) for d in c.subject.dtypes[:2]]
    leaves = [c.array(h) for h in hosts]
    seen = [
        ns.array(f"asarray(<a {h.dtype} array>)", ns("asarray", x), h.shape)
        for h, x in zip(hosts, leaves, strict=True)
    ]
    if len({str(x.dtype) for x in seen}) != len(seen):
        raise ns.broken(
            f"asarray(<a {hosts[-1].dtype} array>)",
            f"gave the dtype {seen[-1].dtype}, as of a {hosts[0].dtype} array",
        )
    if not ns.xp.on_host:  # where is the device select's, is_array its test for an array
        if ns("is_array(<an array>)", leaves[0]) is not True:
            raise ns.broken("is_array(<an array>)", "returned something else than True")
        if ns("is_array(1.0)", 1.0) is not False:
            raise ns.broken("is_array(1.0)", "returned something else than False")
        for value in (True, False):
            a, b = c.array(hosts[0]), c.array(hosts[0][::-1].copy())
            call = f"where(flag({value}), <an array>, <another>)"
            got = c.host(ns.array(call, ns(call, flags[value], a, b), hosts[0].shape))
            if not same_bits(got, hosts[0] if value else hosts[0][::-1]):
                raise ns.broken(call, f"gave {got!r}")
    _namespace_map_pairs(ns, leaves[0])


def _namespace_map_pairs(ns: _Namespace, leaf: Any) -> None:
    """``map_pairs(fn, on_skip, on_step)``: ``fn(path, a, b)`` per pair of leaves, the
    results in ``on_step``'s structure, InvalidArgumentError for trees that differ."""
    calls: list[tuple[Any, ...]] = []
    results: list[object] = []

    def fn(*args: Any) -> object:
        calls.append(args)
        results.append(object())
        return results[-1]

    on_skip = {"w": leaf, "b": [leaf, None], "t": (leaf,)}
    on_step = {"w": leaf, "b": [leaf, None], "t": (leaf,)}
    pairs = 3
    call = "map_pairs(fn, on_skip, on_step)"
    out = ns(call, fn, on_skip, on_step)
    for args in calls:
        if len(args) != len(("path", "a", "b")) or not isinstance(args[0], str):
            shown = ", ".join(type(a).__qualname__ for a in args)
            raise ns.broken(call, f"called fn({shown})")
    if len(calls) != pairs:
        raise ns.broken(call, f"called fn {len(calls)} times for {pairs} pairs of leaves")
    try:
        kept = out["b"][1] is None and type(out["t"]) is tuple
        placed = {id(out["w"]), id(out["b"][0]), id(out["t"][0])} == {id(r) for r in results}
    except Exception as exc:
        raise ns.broken(call, f"returned {out!r}, not a tree of on_step's structure") from exc
    if not (kept and placed):
        raise ns.broken(call, f"returned {out!r}, not on_step's structure holding fn's results")
    ns.c.now("namespace().map_pairs(fn, on_skip, on_step) of trees that differ")
    try:
        ns.xp.map_pairs(fn, {"w": leaf}, {"w": leaf, "b": leaf})
    except InvalidArgumentError:
        return
    except Exception as exc:
        raise ns.broken(
            call, f"raised {type(exc).__name__} for trees that differ, not InvalidArgumentError"
        ) from exc
    raise ns.broken(call, "paired trees that differ without raising InvalidArgumentError")
