"""The JAX backend: functional, jit-safe, on arbitrary pytrees.

Everything here traces: no method but :meth:`JaxBackend.to_bool` reads a value
back to the host, so unscale, detection, the transition and the select of a
training step all run inside one ``jax.jit`` with no host synchronisation.

Gradients are any pytree (dicts, lists, tuples, NamedTuples, registered
dataclasses, equinox modules); ``None`` leaves are skipped, as
``jax.tree_util`` does. The dtype rules and messages are the NumPy backend's.

Detection reduces ``y - y`` (0 for a finite ``y``, NaN for NaN or +-inf) with a
float sum: exact, because every term is 0 or NaN, and much faster on XLA's CPU
backend than a boolean ``all(isfinite(y))`` (see PERF_NOTES). Large leaves are
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
from scaler_core.backends._numpy import _ACCEPTED, _HALF, FLOAT_DTYPES, inv_scale_of

from scaler_core._errors import GradientTypeError, GradientValueError
from scaler_core._state import DATA_FIELDS, ScalerState, device_update, register_pytree

__all__ = ["BACKEND", "JaxBackend", "jax_leaves", "non_finite", "to_device"]

register_pytree()

_FLAG_MUST = (
    "it must be a bool or a 0-d boolean array; pass the flag returned by unscale() or "
    "find_non_finite()"
)


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
        if not isinstance(leaf, jax.Array):
            raise GradientTypeError(
                f"{path} is a {type(leaf).__qualname__}, but the jax backend needs jax.Array "
                f"leaves of dtype {_ACCEPTED}; convert it with jnp.asarray(x)"
            )
        if np.dtype(leaf.dtype) not in FLOAT_DTYPES:
            raise GradientTypeError(
                f"{path} has dtype {leaf.dtype}, but gradients must be {_ACCEPTED}; "
                f"cast it with .astype(jnp.float32) or leave it out of the tree"
            )
        leaves.append(leaf)
        paths.append(path)
    return leaves, treedef, paths


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
    """A device scale as a 0-d float32 array (not value-checked: it may be traced)."""
    if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.floating):
        raise GradientValueError(
            f"{what} has shape {scale.shape} and dtype {scale.dtype}, but a device scale "
            f"must be a 0-d float array; pass state.scale"
        )
    return scale.astype(jnp.float32)  # type: ignore[no-any-return]


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
    if dtype in _HALF:
        return (g.astype(jnp.float32) * inv).astype(dtype)
    return g * inv.astype(dtype)


def _flag(found: Any, what: str = "found") -> jax.Array:
    """``found`` as a 0-d boolean JAX array, or a clear error."""
    if isinstance(found, (bool, np.bool_)):
        return jnp.asarray(bool(found))
    if isinstance(found, (jax.Array, np.ndarray)) and found.shape == () and found.dtype == bool:
        return jnp.asarray(found)
    raise GradientTypeError(f"{what}={found!r}, but {_FLAG_MUST}")


def to_device(state: ScalerState) -> ScalerState:
    """``state`` with a 0-d float32 scale and 0-d int32 counters (JAX arrays).

    Pass a device state to ``jax.jit``: Python scalars would be traced as weakly
    typed values and the first step's output (strongly typed) would retrace.
    A recorded failure is kept, not raised.
    """
    if not isinstance(state, ScalerState):
        raise GradientTypeError(
            f"state={state!r}, but it must be a ScalerState; build one with scaler_core.init()"
        )
    values = {"scale": jnp.asarray(state.scale, dtype=jnp.float32)}
    for name in DATA_FIELDS[1:]:
        values[name] = jnp.asarray(getattr(state, name), dtype=jnp.int32)
    return ScalerState(config=state.config, **values)


class JaxBackend:
    """Unscale and detection for JAX arrays; the flag is a 0-d boolean ``jax.Array``.

    Functional: :meth:`unscale` returns a new tree. Every method works inside
    ``jax.jit``, ``vmap``, ``shard_map`` and ``pmap``.
    """

    name = "jax"

    def unscale(self, grads: Any, scale: Any) -> tuple[Any, jax.Array]:
        """See :meth:`scaler_core.Backend.unscale`: returns a new tree."""
        inv, is_one = _inv_scale(scale)
        leaves, treedef, _ = jax_leaves(grads)
        out = leaves if is_one else [_unscale_leaf(g, inv) for g in leaves]
        found = non_finite(leaves, None if is_one else inv, out)
        return jax.tree_util.tree_unflatten(treedef, out), found

    def find_non_finite(self, grads: Any) -> jax.Array:
        """See :meth:`scaler_core.Backend.find_non_finite`."""
        leaves, _, _ = jax_leaves(grads)
        return non_finite(leaves)

    def scale_loss(self, loss: Any, scale: Any) -> jax.Array:
        """See :meth:`scaler_core.Backend.scale_loss`."""
        if isinstance(scale, jax.Array):
            return jnp.multiply(loss, _scale_array(scale))
        inv_scale_of(scale)  # validates scale
        return jnp.multiply(loss, jnp.float32(scale))

    def select(self, found: Any, on_skip: Any, on_step: Any) -> Any:
        """See :meth:`scaler_core.Backend.select`: a new tree, selected leaf by leaf.

        Each leaf is ``on_skip``'s where ``found`` is true, bit for bit, else
        ``on_step``'s, with no host synchronisation (``jnp.where``).

        Raises:
            GradientTypeError: The trees differ in structure, or a pair of
                leaves differs in shape or dtype.
        """
        flag = _flag(found)
        skip, skip_def = jax.tree_util.tree_flatten(on_skip)
        step, step_def = jax.tree_util.tree_flatten(on_step)
        if skip_def != step_def:  # type: ignore[operator]
            raise GradientTypeError(
                f"on_skip has structure {skip_def} but on_step has {step_def}; select needs "
                f"two trees of one structure (the old and the updated values)"
            )
        paths = [
            "on_step" + jax.tree_util.keystr(k)
            for k, _ in jax.tree_util.tree_flatten_with_path(on_step)[0]
        ]
        out = []
        for path, a, b in zip(paths, skip, step, strict=True):
            a_arr, b_arr = jnp.asarray(a), jnp.asarray(b)
            if a_arr.shape != b_arr.shape or a_arr.dtype != b_arr.dtype:
                raise GradientTypeError(
                    f"{path} has shape {b_arr.shape} and dtype {b_arr.dtype}, but on_skip has "
                    f"{a_arr.shape} and {a_arr.dtype}; select keeps shapes and dtypes, so "
                    f"cast the updated value back to the old one's dtype"
                )
            out.append(jnp.where(flag, a_arr, b_arr))
        return jax.tree_util.tree_unflatten(step_def, out)

    def any(self, *flags: Any) -> jax.Array:
        """See :meth:`scaler_core.Backend.any`."""
        out = jnp.asarray(False)
        for i, f in enumerate(flags):
            out = out | _flag(f, f"flags[{i}]")
        return out

    def to_bool(self, found: Any) -> bool:
        """See :meth:`scaler_core.Backend.to_bool`: the one host synchronisation.

        Raises:
            GradientTypeError: ``found`` is not a boolean flag, or it is traced
                (inside ``jax.jit`` no value can be read; use :meth:`select`).
        """
        if _is_traced(found):
            raise GradientTypeError(
                "found is traced (inside jax.jit, vmap or shard_map), so it has no value to "
                "read; decide with select() and advance with update(), which run on the device"
            )
        return bool(_flag(found))

    def update(self, state: ScalerState, found: Any) -> ScalerState:
        """See :meth:`scaler_core.Backend.update`: the branch-free device transition.

        A failing step records ``state.failure`` instead of raising; the first
        host-side look (``check``, ``current_scale``, ``to_dict``) raises it.
        """
        if not isinstance(state, ScalerState):
            raise GradientTypeError(
                f"state={state!r}, but it must be a ScalerState; build one with scaler_core.init()"
            )
        return device_update(jnp, state, _flag(found, "found_non_finite"))


BACKEND = JaxBackend()
