"""The JAX backend: functional, jit-safe, on arbitrary pytrees.

Everything here traces: no method but :meth:`JaxBackend.to_bool` reads a value
back to the host, so unscale, detection, the transition and the select of a
training step all run inside one ``jax.jit`` with no host synchronisation.

Gradients are any pytree (dicts, lists, tuples, NamedTuples, registered
dataclasses, equinox modules); ``None`` leaves are skipped, as
``jax.tree_util`` does. The dtype rules and messages are the NumPy backend's.

Detection reduces ``y - y`` (0 for a finite ``y``, NaN for NaN or +-inf) with a
float sum: exact, because every term is 0 or NaN, and much faster on XLA's CPU
backend than a boolean ``all(isfinite(y))`` (4-10x, measured on a 2-core CPU). Large leaves are
reduced where they are, so a global sharded array stays sharded (each device
reduces its shard and XLA adds the partials); leaves of at most
:data:`SMALL_LEAF` elements are unscaled again and reduced together in one flat
buffer per dtype, because each leaf's reduction costs XLA kernels and compile
time.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from scaler_core._backend import Backend
from scaler_core._errors import (
    GradientTypeError,
    GradientValueError,
    InvalidArgumentError,
)
from scaler_core._f32 import FLT_MIN
from scaler_core._ops import as_flag, clip_coefficient
from scaler_core._registration import register_pytree
from scaler_core._state import ScalerState
from scaler_core._tree import first_of_each
from scaler_core.backend_kit import state_on

from ._common import (
    HALF_DTYPES,
    LeafKind,
    inv_scale_of,
)

__all__ = [
    "BACKEND",
    "LEAVES",
    "JaxBackend",
    "Prepared",
    "jax_leaves",
    "non_finite",
    "to_device",
]

register_pytree()

#: JAX gradient leaves.
LEAVES = LeafKind("jax", jax.Array, "jax.Array", "jnp", "jnp.asarray(x)")


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def jax_leaves(grads: Any, root: str = "grads") -> tuple[list[Any], Any, list[str]]:
    """The leaves of ``grads`` (``None`` skipped), its treedef and each leaf's path.

    Validation happens at trace time only (types and dtypes are static).

    Raises:
        GradientTypeError: A leaf is not a JAX array, or has a dtype other than
            float16, bfloat16, float32 or float64.
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
    leaves, paths = [], []
    for key, leaf in with_paths:
        path = root + jax.tree_util.keystr(key)
        LEAVES.check(path, leaf)
        leaves.append(leaf)
        paths.append(path)
    return leaves, treedef, paths


def _once(leaves: list[Any], values: list[Any]) -> list[Any]:
    """``values`` (one per leaf) without those of a leaf given again: an array that
    appears twice in a tree (a tied weight's gradient) is one gradient, counted once in
    the norm, as every other backend counts it (at trace time: the same tracer)."""
    seen: set[int] = set()
    out = []
    for leaf, value in zip(leaves, values, strict=True):
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append(value)
    return out


#: Leaves with at most this many elements are checked together, in one flat
#: buffer per dtype: on XLA's CPU backend every leaf's reduction costs two or
#: three kernels (microseconds each) and compile time grows steeply with their
#: number, while one copy of the small leaves is cheap. Larger leaves are reduced
#: where they are, which also keeps a sharded leaf sharded.
SMALL_LEAF = 1 << 16


def _nan_sum(y: jax.Array) -> jax.Array:
    # y - y is exactly 0 for finite y and NaN for NaN or +-inf: the sum is NaN
    # if and only if some element is not finite, and it cannot overflow.
    return jnp.sum(y - y, dtype=jnp.float32)


def non_finite(
    leaves: list[Any], inv: jax.Array | None = None, out: list[Any] | None = None
) -> jax.Array:
    """One 0-d boolean: whether any element of any leaf, unscaled, is NaN or +-inf.

    Args:
        leaves: The gradient leaves as given.
        inv: The inverse scale, or ``None`` for detection alone.
        out: The unscaled leaves (``_unscale_leaf(g, inv)``), reused for large
            leaves; small leaves are unscaled again inside one flat buffer,
            by the same elementwise arithmetic, so the values checked are the
            values returned.
    """
    out = leaves if out is None else out
    partial = []
    small: dict[np.dtype[Any], list[Any]] = {}
    for g, y in zip(leaves, out, strict=True):
        if g.size <= SMALL_LEAF:
            small.setdefault(np.dtype(g.dtype), []).append(jnp.ravel(g))
        else:
            partial.append(_nan_sum(y))
    for group in small.values():
        flat = group[0] if len(group) == 1 else jnp.concatenate(group)
        # The barrier keeps XLA from fusing the unscale into the copy, which
        # compiles very slowly with thousands of operands.
        flat = jax.lax.optimization_barrier(flat)  # type: ignore[no-untyped-call]
        partial.append(_nan_sum(flat if inv is None else _unscale_leaf(flat, inv)))
    if not partial:
        return jnp.asarray(False)
    total = partial[0] if len(partial) == 1 else jnp.sum(jnp.stack(partial))
    return jnp.isnan(total)


def _scale_array(scale: Any, what: str = "scale") -> jax.Array:
    """A device scale as a 0-d float32 array, checked as far as it can be.

    A concrete scale (outside ``jit``) is read and validated like a host one. A
    traced one has no value yet: it becomes NaN unless it is a positive, finite,
    normal float32, so a bad scale fails closed (the step is flagged, and the update
    records a collapse) instead of flipping or zeroing every gradient.
    """
    if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise GradientValueError(
            f"{what} has shape {scale.shape} and dtype {scale.dtype}, but a device scale "
            f"must be a 0-d float array; pass state.scale"
        )
    s = scale.astype(jnp.float32)
    if not _is_traced(s):
        inv_scale_of(float(s))  # raises GradientValueError, naming the value
        return s  # type: ignore[no-any-return]
    valid = jnp.isfinite(s) & (s >= jnp.float32(FLT_MIN))
    return jnp.where(valid, s, jnp.float32(jnp.nan))


def _inv_scale(scale: Any) -> tuple[jax.Array, bool]:
    """``(inv_scale, is_one)``: f32(1 / f64(scale)), and whether it is statically 1.

    In float32, the correctly rounded ``1 / s`` (IEEE division) equals
    ``f32(1 / f64(s))``: rounding the float64 quotient again is innocuous since
    53 >= 2 * 24 + 2. So a device scale needs no float64.
    """
    if isinstance(scale, jax.Array):
        return jnp.float32(1.0) / _scale_array(scale), False
    inv = inv_scale_of(scale)  # host value: validated now, before anything is traced
    return jnp.float32(inv), inv == 1.0


def _unscale_leaf(g: jax.Array, inv: jax.Array) -> jax.Array:
    dtype = np.dtype(g.dtype)
    if dtype in HALF_DTYPES:
        return (g.astype(jnp.float32) * inv).astype(dtype)
    return g * inv.astype(dtype)


def _norm(out: list[Any]) -> jax.Array:
    """The global L2 norm of the unscaled leaves, a float32 0-d array.

    Squares are summed in float64 when ``jax_enable_x64`` is on (then within one
    float32 ulp of the exact norm); without it XLA sums them in float32, in its
    own tree order, within a few ulps. XLA fuses these reductions with the
    unscale under ``jax.jit``, so the gradients are read once.
    """
    wide = jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32  # type: ignore[no-untyped-call]
    if not out:
        return jnp.zeros((), jnp.float32)
    total = sum(jnp.sum(jnp.square(y.astype(wide))) for y in out)
    return jnp.sqrt(total).astype(jnp.float32)


def _clip_leaf(u: jax.Array, coef: jax.Array) -> jax.Array:
    dtype = np.dtype(u.dtype)
    if dtype in HALF_DTYPES:
        return (u.astype(jnp.float32) * coef).astype(dtype)
    return u * coef.astype(dtype)


class JaxNamespace:
    """``jax.numpy`` as :meth:`scaler_core.Backend.namespace` describes it: flags are
    0-d boolean arrays, selected and advanced with ``jnp.where`` (eagerly and under
    ``jax.jit`` alike); the pytrees are paired as JAX pairs them."""

    on_host = False
    asarray = staticmethod(jnp.asarray)
    where = staticmethod(jnp.where)
    logical_or = staticmethod(jnp.logical_or)
    isfinite = staticmethod(jnp.isfinite)
    isdtype = staticmethod(jnp.isdtype)
    maximum = staticmethod(jnp.maximum)
    minimum = staticmethod(jnp.minimum)
    float32, float64, int32 = jnp.float32, jnp.float64, jnp.int32

    @property
    def float64_missing(self) -> str | None:
        if jax.config.read("jax_enable_x64"):  # type: ignore[no-untyped-call, unused-ignore]
            return None
        return "enable float64 in JAX with jax.config.update('jax_enable_x64', True)"

    @staticmethod
    def is_array(value: Any) -> bool:
        return isinstance(value, jax.Array)

    @staticmethod
    def flag(value: bool) -> jax.Array:
        return jnp.asarray(value)

    @staticmethod
    def read(flag: Any) -> bool:
        """Raises :class:`GradientTypeError` for a traced flag: it has no value yet."""
        if _is_traced(flag):
            raise GradientTypeError(
                "found is traced (inside jax.jit, vmap or shard_map), so it has no value to "
                "read; decide with select() and advance with update(), which run on the device"
            )
        return bool(flag)

    @staticmethod
    def map_pairs(fn: Any, on_skip: Any, on_step: Any) -> Any:
        """The two pytrees paired leaf by leaf; paths as ``on_step`` + ``keystr``.

        Raises:
            InvalidArgumentError: The pytrees differ in structure.
        """
        skip, skip_def = jax.tree_util.tree_flatten(on_skip)
        step_paths, step_def = jax.tree_util.tree_flatten_with_path(on_step)
        if skip_def != step_def:  # type: ignore[operator, unused-ignore]
            raise InvalidArgumentError(
                f"on_step has structure {step_def} but on_skip has {skip_def}; select() needs "
                f"two trees of the same structure (the old values and the updated ones)"
            )
        out = [
            fn("on_step" + jax.tree_util.keystr(key), a, b)
            for (key, b), a in zip(step_paths, skip, strict=True)
        ]
        return jax.tree_util.tree_unflatten(step_def, out)


NAMESPACE = JaxNamespace()


def to_device(state: ScalerState) -> ScalerState:
    """``state`` with a 0-d float32 scale and 0-d int32 counters (JAX arrays).

    Pass a device state to ``jax.jit``: Python scalars would be traced as weakly
    typed values and the first step's output (strongly typed) would retrace.
    Nothing is read back: a recorded failure moves with the state and raises at
    the first host-side look. Works inside ``jax.jit`` too. With spike skipping
    off, the window statistics stay Python numbers: they never change then, and
    the pytree holds them as static data beside the config, so a jitted step
    does not carry them.

    Raises:
        InvalidArgumentError: ``state`` is not a :class:`~scaler_core.ScalerState`.
    """
    return state_on(NAMESPACE, state)


class Prepared:
    """What :meth:`JaxBackend.plan` returns: the tree, flattened once.

    Attributes:
        grads: The gradient tree as given (returned as it is where nothing is
            computed).
        leaves: Its leaves (``None`` skipped), validated.
        treedef: Its structure, to build the new tree the passes return.
        unscaled: ``(scale, leaves, inv)`` of the last :func:`_unscaled` call, so
            the clip pass reuses the measuring pass's unscaled leaves (eager
            calls would compute them twice; under ``jit`` XLA merges them anyway).
    """

    __slots__ = ("grads", "leaves", "treedef", "unscaled")

    def __init__(self, grads: Any, leaves: list[Any], treedef: Any) -> None:
        self.grads, self.leaves, self.treedef = grads, leaves, treedef
        self.unscaled: tuple[Any, list[Any], jax.Array | None] | None = None


def _unscaled(leaves: Prepared, scale: Any) -> tuple[list[Any], jax.Array | None]:
    """The unscaled leaves, and the inverse scale (``None`` when it is statically 1:
    then the leaves are the given ones); computed once per scale and leaves."""
    kept = leaves.unscaled
    if kept is not None and kept[0] is scale:
        return kept[1], kept[2]
    inv, is_one = _inv_scale(scale)
    out = leaves.leaves if is_one else [_unscale_leaf(g, inv) for g in leaves.leaves]
    leaves.unscaled = (scale, out, None if is_one else inv)
    return out, None if is_one else inv


class JaxBackend(Backend):
    """Unscale and detection for JAX arrays; the flag is a 0-d boolean ``jax.Array``.

    Functional: every pass returns a new tree (JAX arrays are immutable, so
    ``writable`` asks nothing of them). Every method works inside ``jax.jit``,
    ``vmap``, ``shard_map`` and ``pmap``: the clip pass selects with ``jnp.where``
    on the traced skip flag, never reading it back.
    """

    name = "jax"

    def plan(self, grads: Any, *, writable: bool) -> Prepared:
        """See :meth:`scaler_core.Backend.plan`: the pytree flattened once, its leaves
        validated (at trace time: types and dtypes are static)."""
        leaves, treedef, _ = jax_leaves(grads)
        return Prepared(grads, leaves, treedef)

    def unscale(self, leaves: Prepared, scale: Any) -> tuple[Any, jax.Array]:
        """See :meth:`scaler_core.Backend.unscale`: returns a new tree; with ``scale``
        ``None``, detection alone and the tree as given."""
        if scale is None:
            return leaves.grads, non_finite(leaves.leaves)
        out, inv = _unscaled(leaves, scale)
        found = non_finite(leaves.leaves, inv, out)
        return jax.tree_util.tree_unflatten(leaves.treedef, out), found

    def measure(
        self, leaves: Prepared, scale: Any, *, write: bool
    ) -> tuple[Any, jax.Array, jax.Array]:
        """See :meth:`scaler_core.Backend.measure`: with ``write`` a new tree of the
        unscaled leaves, without it the tree as given; the flag and norm of the
        unscaled values either way (XLA fuses them with the unscale under ``jit``)."""
        out, inv = _unscaled(leaves, scale)
        found = non_finite(leaves.leaves, inv, out)
        grads = jax.tree_util.tree_unflatten(leaves.treedef, out) if write else leaves.grads
        return grads, found, _norm(_once(leaves.leaves, out))

    def clip(self, leaves: Prepared, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        """See :meth:`scaler_core.Backend.clip`: a new tree, leaf by leaf the given
        leaf where ``skip`` (decided on the device: the very values given) and else
        the unscaled leaf times the clip coefficient."""
        flag = as_flag(NAMESPACE, skip)
        unscaled, _ = _unscaled(leaves, scale)
        coef = clip_coefficient(jnp, norm, max_norm)
        out = [
            jnp.where(flag, g, _clip_leaf(u, coef))
            for g, u in zip(leaves.leaves, unscaled, strict=True)
        ]
        return jax.tree_util.tree_unflatten(leaves.treedef, out)

    def scale_loss(self, loss: Any, scale: Any) -> jax.Array:
        """See :meth:`scaler_core.Backend.scale_loss`."""
        if isinstance(scale, jax.Array):
            return jnp.multiply(loss, _scale_array(scale))
        inv_scale_of(scale)  # validates scale
        return jnp.multiply(loss, jnp.float32(scale))

    def namespace(self, *values: Any) -> JaxNamespace:
        """See :meth:`scaler_core.Backend.namespace`: ``jax.numpy``, on every device."""
        return NAMESPACE

    def non_finite_counts(self, grads: Any) -> list[tuple[str, int, int]]:
        """See :class:`scaler_core.Backend` (``non_finite_counts``), on any pytree (paths as in
        this backend's messages: ``grads`` + ``jax.tree_util.keystr``). The counts of
        the leaves that live on the same devices are one jitted computation; all of
        them are read back in one ``jax.device_get``; not inside ``jax.jit``.

        Raises:
            GradientTypeError: As ``unscale``: a leaf is not a JAX array of an
                accepted dtype; or a leaf is traced (inside ``jax.jit`` no count can
                be read: call this outside, once ``to_bool(found)`` says the step
                was skipped).
        """
        leaves, _, paths = jax_leaves(grads)
        pairs = first_of_each(zip(paths, leaves, strict=True))
        groups: dict[tuple[tuple[str, int], ...], list[int]] = {}
        for i, (path, leaf) in enumerate(pairs):
            if isinstance(leaf, jax.core.Tracer):
                raise GradientTypeError(
                    f"{path} is traced (inside jax.jit, vmap or shard_map), so its NaN and inf "
                    f"cannot be counted on the host; call non_finite_leaves outside, for "
                    f"example once to_bool(found) says the step was skipped"
                )
            key = tuple(sorted((d.platform, d.id) for d in leaf.devices()))
            groups.setdefault(key, []).append(i)
        outputs = [_counts([pairs[i][1] for i in indices]) for indices in groups.values()]
        counts: list[tuple[int, int]] = [(0, 0)] * len(pairs)
        for indices, host in zip(groups.values(), jax.device_get(outputs), strict=True):
            for i, (nan, inf) in zip(indices, np.asarray(host).tolist(), strict=True):
                counts[i] = (int(nan), int(inf))
        return [(path, n, i) for (path, _), (n, i) in zip(pairs, counts, strict=True)]


@jax.jit
def _counts(leaves: list[Any]) -> Any:
    """The ``(n, 2)`` NaN and inf counts of a list of leaves, one computation."""
    return jnp.stack([jnp.stack([jnp.sum(jnp.isnan(g)), jnp.sum(jnp.isinf(g))]) for g in leaves])


BACKEND = JaxBackend()
