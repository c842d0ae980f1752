"""The MLX backend: each pass is one compiled MLX computation, with nothing read back.

How a call runs: the gradient tree is flattened and validated (types, dtypes)
before anything is computed; then one function compiled with ``mx.compile`` takes
the leaves and the scale (a 0-d float32 array) and returns the unscaled leaves,
the flag and the norm, or the clipped leaves. The inverse scale
(:func:`~scaler_core.backend_kit.inverse_scale`) and the clip coefficient
(:func:`~scaler_core.backend_kit.clip_coefficient`) are computed inside it, from
the core's own functions traced on MLX arrays, so a device scale is never read back
and a bad one fails closed (every gradient NaN, the flag set).

Compiled functions are kept per pass, leaf dtypes and default device: a training
loop compiles each pass once (``mx.compile`` itself retraces only when a shape
changes). MLX is functional, as JAX is: every pass returns a new tree; the
``writable`` of :meth:`MlxBackend.plan` asks nothing of MLX arrays.

The arithmetic is the rules': float16 and bfloat16 are computed in float32 and
rounded back, float64 in float64. The norm's sum of squares is accumulated in
float64 where the default device has float64 (the CPU; then within one float32 ulp
of the exactly rounded norm), else in float32. In float64, a square of a float32
value cannot overflow, so over float16, bfloat16 and float32 leaves that sum is NaN
or inf exactly when an unscaled value is: it is their flag too. Float64 leaves, and
every leaf of a pass without a norm, are checked by summing ``y - y`` (0, or NaN for
NaN and +-inf).

How the reductions run: MLX's CPU reductions are not fused with the elementwise work
before them, and are slow (about one element per nanosecond). So the leaves are
reduced in flat pieces of about a million elements (large leaves cut into views,
small ones joined into one copy, since every MLX operation costs microseconds), and
each piece is folded eight ways by one fused elementwise kernel before its sum: the
measuring pass then reads about as fast as a copy does (``benchmarks/bench_mlx.py``).

Nothing here synchronises with the host but :meth:`MlxNamespace.read` (what
``to_bool`` calls) and :meth:`MlxBackend.non_finite_counts`: the flag is a 0-d
``mx.bool_`` array, the norm a 0-d float32 array, and the transition
(:func:`scaler_core.device_update`) runs on MLX arrays, also inside ``mx.compile``.
The device state and the skipped optimizer step are in :mod:`scaler_core.mlx`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import reduce
from typing import Any

import mlx.core as mx
import numpy as np

from scaler_core._backend import Backend
from scaler_core._errors import GradientTypeError, GradientValueError, InvalidArgumentError
from scaler_core._f32 import FLT_MIN, f32
from scaler_core._ops import as_flag
from scaler_core._tree import first_of_each
from scaler_core.backend_kit import clip_coefficient, inverse_scale, leaves_with_paths, map_pairs

from ._common import LeafKind, inv_scale_of

__all__ = [
    "BACKEND",
    "LEAVES",
    "NAMESPACE",
    "MlxBackend",
    "MlxNamespace",
    "Prepared",
    "compiled_passes",
]

_HALF = (mx.float16, mx.bfloat16)


def _numpy_dtype(dtype: Any) -> np.dtype[Any] | None:
    """The NumPy dtype of an accepted MLX dtype (what :class:`LeafKind` checks), else None."""
    if dtype == mx.bfloat16:
        import ml_dtypes  # noqa: PLC0415 - only for bfloat16 leaves

        bfloat16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bfloat16
    names = {mx.float16: "float16", mx.float32: "float32", mx.float64: "float64"}
    name = names.get(dtype) if isinstance(dtype, mx.Dtype) else None
    return None if name is None else np.dtype(name)


#: MLX gradient leaves.
LEAVES = LeafKind(
    "mlx",
    mx.array,
    "mlx.core.array",
    "mx",
    "mx.array(x)",
    numpy_dtype=_numpy_dtype,
    cast=".astype(mx.float32)",
)


# ---------------------------------------------------------------- the namespace
class _DType:
    """An MLX dtype for :func:`scaler_core.device_update`: callable, to make a 0-d value."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: mx.Dtype) -> None:
        self.dtype = dtype

    def __call__(self, value: Any) -> mx.array:
        return NAMESPACE.asarray(value, dtype=self.dtype)

    def __repr__(self) -> str:
        return f"MlxNamespace.{str(self.dtype).rpartition('.')[2]}"


def _mx_dtype(dtype: Any) -> mx.Dtype | None:
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if isinstance(dtype, _DType):
        return dtype.dtype
    if dtype is bool:
        return mx.bool_
    raise InvalidArgumentError(
        f"dtype={dtype!r}, but the mlx namespace takes None, bool, an mlx.core.Dtype or one "
        f"of its float32, float64 and int32"
    )


class MlxNamespace:
    """``mlx.core`` as :meth:`scaler_core.Backend.namespace` describes it: flags are 0-d
    ``mx.bool_`` arrays, selected and advanced with ``mx.where``, eagerly and inside
    ``mx.compile`` alike; trees are nested dicts, lists and tuples, as MLX's own
    (``model.parameters()``, ``optimizer.state``)."""

    on_host = False
    map_pairs = staticmethod(map_pairs)
    isfinite = staticmethod(mx.isfinite)
    logical_or = staticmethod(mx.logical_or)
    maximum = staticmethod(mx.maximum)
    where = staticmethod(mx.where)
    float32, float64, int32 = _DType(mx.float32), _DType(mx.float64), _DType(mx.int32)

    @property
    def float64_missing(self) -> str | None:
        """None on the CPU; on a GPU (MLX has float64 on its CPU only), what to do."""
        if mx.default_device().type == mx.DeviceType.cpu:
            return None
        return (
            "run the transition on MLX's CPU, which has float64: "
            "with mx.stream(mx.cpu): state = scaler_core.update(state, found)"
        )

    @staticmethod
    def asarray(value: Any, dtype: Any = None) -> mx.array:
        """An MLX array of ``value`` (an array is cast only where ``dtype`` differs)."""
        dt = _mx_dtype(dtype)
        if isinstance(value, mx.array):
            return value if dt is None or value.dtype == dt else value.astype(dt)
        if dt is None:
            return mx.array(value)
        return mx.array(value, dtype=dt)

    @staticmethod
    def is_array(value: Any) -> bool:
        return isinstance(value, mx.array)

    @staticmethod
    def flag(value: bool) -> mx.array:
        return mx.array(bool(value), dtype=mx.bool_)

    @staticmethod
    def read(flag: mx.array) -> bool:
        """Raises :class:`GradientTypeError` inside ``mx.compile``: the flag has no value yet."""
        try:
            return bool(flag.item())
        except ValueError as exc:  # MLX refuses to evaluate inside a transformation
            raise GradientTypeError(
                "found is being traced (inside mx.compile or another MLX transformation), "
                "so it has no value to read; decide with select() and advance with update(), "
                "which run on the device"
            ) from exc

    @staticmethod
    def isdtype(dtype: Any, kind: str) -> bool:
        """``mx.isdtype`` for MLX dtypes (anything else is of no kind)."""
        return isinstance(dtype, mx.Dtype) and bool(mx.isdtype(dtype, kind))

    @staticmethod
    def minimum(a: Any, b: Any) -> mx.array:
        """``b`` where it is below ``a``, else ``a``: a NaN ``a`` comes back bit for bit, as
        PyTorch's clamp returns it, so the clip coefficient has the bits of every backend."""
        return mx.where(b < a, b, a)


NAMESPACE = MlxNamespace()


# ---------------------------------------------------------------- the passes
def _wide() -> mx.Dtype:
    """What squares are summed in: float64 where the default device has it."""
    return mx.float32 if NAMESPACE.float64_missing else mx.float64


def _times(g: mx.array, factor: mx.array) -> mx.array:
    """``g * factor`` rounded to ``g``'s dtype; half types computed in float32."""
    if g.dtype in _HALF:
        return (g.astype(mx.float32) * factor).astype(g.dtype)
    return g * factor.astype(g.dtype)


#: Elements per piece of a reduction: larger leaves are cut into pieces of this size.
PIECE = 1 << 20
#: Leaves (and tails of cut leaves) of fewer elements are joined, per dtype, into
#: pieces of about :data:`PIECE`: each piece costs a dozen MLX operations (several
#: microseconds each on the CPU), as much as copying this many elements.
JOIN = 1 << 16
#: Each piece is folded this many ways before it is reduced (see :func:`_folded_sum`).
FOLD = 8


def _pieces(leaves: Sequence[mx.array]) -> list[mx.array]:
    """Flat pieces holding every element of ``leaves`` once: leaves of at least
    :data:`JOIN` elements cut into slices of :data:`PIECE` (views), smaller ones
    (and short tails) joined per dtype into pieces of about :data:`PIECE` (copies)."""
    pieces: list[mx.array] = []
    joined: dict[mx.Dtype, tuple[list[mx.array], list[int]]] = {}
    for g in leaves:
        flat = g if g.ndim == 1 else g.reshape(-1)
        n = flat.size
        cut = 0 if n < JOIN else n if n % PIECE >= JOIN else n - n % PIECE
        pieces.extend(flat[i : min(i + PIECE, cut)] for i in range(0, cut, PIECE))
        if cut < n:
            group, size = joined.setdefault(g.dtype, ([], [0]))
            group.append(flat[cut:] if cut else flat)
            size[0] += n - cut
            if size[0] >= PIECE:
                pieces.append(mx.concatenate(group))
                group.clear()
                size[0] = 0
    for group, _ in joined.values():
        if group:
            pieces.append(group[0] if len(group) == 1 else mx.concatenate(group))
    return [p for p in pieces if p.size]


def _folded_sum(piece: mx.array, term: Callable[[mx.array], mx.array]) -> mx.array:
    """The sum of ``term`` over ``piece``, the piece folded :data:`FOLD` ways first.

    MLX's CPU reductions are not fused with the elementwise work before them, and
    reduce about one element per nanosecond. Adding the terms of the piece's
    :data:`FOLD` parts elementwise first (one fused, vectorised kernel writing an
    eighth of the piece) leaves an eighth of the work to the reduction: on 2 cores
    the pass then reads at about the speed of a copy (measured with
    ``benchmarks/bench_mlx.py``). The terms are added in the dtype ``term`` gives;
    the last ``size % FOLD`` elements are summed on their own.
    """
    k = piece.size // FOLD
    if k == 0:
        return mx.sum(term(piece))
    total = mx.sum(reduce(mx.add, [term(piece[j * k : (j + 1) * k]) for j in range(FOLD)]))
    return total + mx.sum(term(piece[FOLD * k :])) if piece.size % FOLD else total


def _total(partials: list[mx.array], dtype: mx.Dtype) -> mx.array:
    return mx.sum(mx.stack(partials)) if partials else mx.array(0.0, dtype=dtype)


def _nan_term(y: mx.array) -> mx.array:
    # y - y is exactly 0 for a finite y and NaN for NaN or +-inf: a sum of these is
    # NaN exactly when a value is not finite, and cannot overflow.
    return (y - y).astype(mx.float32)


def _any_non_finite(pieces: Sequence[mx.array]) -> mx.array:
    """Whether any element of the unscaled ``pieces`` is NaN or +-inf."""
    return mx.isnan(_total([_folded_sum(p, _nan_term) for p in pieces], mx.float32))


def _unscaled_pieces(leaves: Sequence[mx.array], inv: mx.array) -> list[mx.array]:
    """The :func:`_pieces` of the leaves, each unscaled by the elementwise arithmetic of
    the leaves' own unscale (:func:`_times`), so the values checked are the values
    returned; MLX fuses the multiply into the fold. For the passes that write nothing:
    where the unscaled leaves are outputs, their pieces are read instead (faster)."""
    return [_times(p, inv) for p in _pieces(leaves)]


def _flag_and_norm(pieces: Sequence[mx.array], wide: mx.Dtype) -> tuple[mx.array, mx.array]:
    """The flag and the float32 norm of the unscaled ``pieces``. Where the squares are
    summed in float64, their sum over the float16, bfloat16 and float32 pieces is the
    flag of those pieces too (see the module docstring); float64 pieces are checked."""

    def square(y: mx.array) -> mx.array:
        return mx.square(y.astype(wide))

    if wide != mx.float64:
        total = _total([_folded_sum(p, square) for p in pieces], wide)
        return _any_non_finite(pieces), mx.sqrt(total).astype(mx.float32)
    narrow = [p for p in pieces if p.dtype != mx.float64]
    doubles = [p for p in pieces if p.dtype == mx.float64]
    squares = _total([_folded_sum(p, square) for p in narrow], wide)
    found = ~mx.isfinite(squares) | _any_non_finite(doubles)
    total = squares + _total([_folded_sum(p, square) for p in doubles], wide)
    return found, mx.sqrt(total).astype(mx.float32)


def _detect(leaves: list[mx.array]) -> mx.array:
    return _any_non_finite(_pieces(leaves))


def _unscale(leaves: list[mx.array], scale: mx.array) -> tuple[list[mx.array], mx.array]:
    inv = inverse_scale(NAMESPACE, scale)
    ys = [_times(g, inv) for g in leaves]
    return ys, _any_non_finite(_pieces(ys))


def _measure_with(wide: mx.Dtype, *, write: bool) -> Callable[..., Any]:
    def measure(leaves: list[mx.array], scale: mx.array) -> Any:
        inv = inverse_scale(NAMESPACE, scale)
        if not write:
            return _flag_and_norm(_unscaled_pieces(leaves, inv), wide)
        ys = [_times(g, inv) for g in leaves]
        return (ys, *_flag_and_norm(_pieces(ys), wide))

    return measure


def _clip(
    leaves: list[mx.array], scale: mx.array, norm: mx.array, max_norm: float, skip: mx.array
) -> list[mx.array]:
    # max_norm is a Python float: mx.compile takes it as a constant (a new value traces
    # the pass again; a training loop clips to one max_norm).
    inv = inverse_scale(NAMESPACE, scale)
    coef = clip_coefficient(NAMESPACE, norm, max_norm)
    return [mx.where(skip, g, _times(_times(g, inv), coef)) for g in leaves]


def _counts(leaves: list[mx.array]) -> mx.array:
    """The ``(n, 2)`` NaN and +-inf counts of the leaves (int32 each, as MLX sums bools)."""
    return mx.stack([mx.stack([mx.sum(mx.isnan(g)), mx.sum(mx.isinf(g))]) for g in leaves])


_COMPILED: dict[tuple[Any, ...], Callable[..., Any]] = {}
_LOCK = threading.Lock()


def compiled_passes(kind: str, dtypes: tuple[mx.Dtype, ...]) -> Callable[..., Any]:
    """The compiled pass ``kind`` for leaves of ``dtypes`` on the default device, made once.

    ``kind`` is ``"detect"``, ``"unscale"``, ``"measure"`` (writing), ``"measure_ro"``
    (the flag and the norm alone), ``"clip"`` or ``"counts"``. Each is one
    ``mx.compile``'d function; MLX recompiles it only for new shapes.
    """
    key = (kind, dtypes, str(mx.default_device()))
    fn = _COMPILED.get(key)
    if fn is None:
        bodies: dict[str, Callable[[], Callable[..., Any]]] = {
            "detect": lambda: _detect,
            "unscale": lambda: _unscale,
            "measure": lambda: _measure_with(_wide(), write=True),
            "measure_ro": lambda: _measure_with(_wide(), write=False),
            "clip": lambda: _clip,
            "counts": lambda: _counts,
        }
        with _LOCK:
            fn = _COMPILED.setdefault(key, mx.compile(bodies[kind]()))
    return fn


class Prepared:
    """What :meth:`MlxBackend.plan` returns: the tree and its validated leaves.

    Attributes:
        grads: The gradient tree as given (returned as it is where nothing is
            computed).
        leaves: Its leaves (``None`` skipped), in :func:`leaves_with_paths` order, each
            array once: one given twice (a tied weight's gradient) is one gradient,
            counted once in the norm.
        dtypes: Their dtypes, the key of the compiled passes.
    """

    __slots__ = ("at", "dtypes", "grads", "leaves")

    def __init__(self, grads: Any, leaves: list[mx.array]) -> None:
        self.grads = grads
        first: dict[int, int] = {}
        self.leaves: list[mx.array] = []
        #: For each leaf of the tree, the index of its array in :attr:`leaves`.
        self.at: list[int] = []
        for g in leaves:
            i = first.setdefault(id(g), len(self.leaves))
            if i == len(self.leaves):
                self.leaves.append(g)
            self.at.append(i)
        self.dtypes = tuple(g.dtype for g in self.leaves)

    def tree(self, out: Sequence[mx.array]) -> Any:
        """A tree of ``grads``'s structure holding ``out`` (one per array of
        :attr:`leaves`), leaf for leaf."""
        it = iter([out[i] for i in self.at])
        return map_pairs(lambda _path, _a, _b: next(it), self.grads, self.grads, root="grads")


def _validated(grads: Any) -> tuple[list[mx.array], list[str]]:
    leaves, paths = [], []
    for path, leaf in leaves_with_paths(grads):
        LEAVES.check(path, leaf)
        leaves.append(leaf)
        paths.append(path)
    return leaves, paths


def _scale_array(scale: Any) -> tuple[mx.array, bool]:
    """``(scale as a 0-d float32 array, is_one)``; a host scale checked now.

    A device scale is not read back: it is checked for shape and dtype here and for
    its value inside the pass (:func:`~scaler_core.backend_kit.inverse_scale`), where
    a bad one makes every gradient NaN.

    Raises:
        GradientValueError: A host scale that is not a positive normal float32, or
            an MLX scale that is not a 0-d float array.
    """
    if isinstance(scale, mx.array):
        if scale.shape != () or not NAMESPACE.isdtype(scale.dtype, "real floating"):
            raise GradientValueError(
                f"scale has shape {tuple(scale.shape)} and dtype {scale.dtype}, but a device "
                f"scale must be a 0-d float array; pass state.scale"
            )
        return NAMESPACE.asarray(scale, dtype=mx.float32), False
    inv = inv_scale_of(scale)  # raises GradientValueError, naming the value
    return mx.array(f32(float(scale)), dtype=mx.float32), inv == 1.0


class MlxBackend(Backend):
    """Unscale, detection, norm and clip for MLX arrays; the flag is a 0-d ``mx.bool_``.

    Functional: every pass returns a new tree. Every method but ``to_bool`` and
    ``non_finite_counts`` works inside ``mx.compile`` (the clip pass selects with
    ``mx.where`` on the skip flag, never reading it back).
    """

    name = "mlx"

    def plan(self, grads: Any, *, writable: bool) -> Prepared:
        """See :meth:`scaler_core.Backend.plan`: the tree flattened once, its leaves
        validated (MLX arrays are immutable: ``writable`` asks nothing of them)."""
        leaves, _ = _validated(grads)
        return Prepared(grads, leaves)

    def unscale(self, leaves: Prepared, scale: Any) -> tuple[Any, mx.array]:
        """See :meth:`scaler_core.Backend.unscale`: a new tree; with ``scale`` ``None``
        (or a host scale of 1), detection alone and the tree as given."""
        if scale is not None:
            s, is_one = _scale_array(scale)
            if not is_one and leaves.leaves:
                out, found = compiled_passes("unscale", leaves.dtypes)(leaves.leaves, s)
                return leaves.tree(out), found
        if not leaves.leaves:
            return leaves.grads, NAMESPACE.flag(False)
        return leaves.grads, compiled_passes("detect", leaves.dtypes)(leaves.leaves)

    def measure(
        self, leaves: Prepared, scale: Any, *, write: bool
    ) -> tuple[Any, mx.array, mx.array]:
        """See :meth:`scaler_core.Backend.measure`: one compiled computation; with
        ``write`` a new tree of the unscaled leaves, without it the tree as given."""
        s, _ = _scale_array(scale)
        if not leaves.leaves:
            return leaves.grads, NAMESPACE.flag(False), mx.array(0.0, dtype=mx.float32)
        if write:
            out, found, norm = compiled_passes("measure", leaves.dtypes)(leaves.leaves, s)
            return leaves.tree(out), found, norm
        found, norm = compiled_passes("measure_ro", leaves.dtypes)(leaves.leaves, s)
        return leaves.grads, found, norm

    def clip(self, leaves: Prepared, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        """See :meth:`scaler_core.Backend.clip`: a new tree, leaf by leaf the given
        leaf where ``skip`` (decided on the device: the very values given), else the
        unscaled leaf times the clip coefficient; one compiled computation."""
        flag = as_flag(NAMESPACE, skip, "skip")
        s, _ = _scale_array(scale)
        if not leaves.leaves:
            return leaves.grads
        out = compiled_passes("clip", leaves.dtypes)(
            leaves.leaves,
            s,
            NAMESPACE.asarray(norm, dtype=mx.float32),
            float(max_norm),
            flag,
        )
        return leaves.tree(out)

    def scale_loss(self, loss: Any, scale: Any) -> mx.array:
        """See :meth:`scaler_core.Backend.scale_loss`: ``loss * f32(scale)`` (float32 for
        float16, bfloat16 and float32 losses); a device scale that is not a positive
        normal float32 gives NaN."""
        s, _ = _scale_array(scale)
        valid = mx.isfinite(s) & (s >= mx.array(FLT_MIN, dtype=mx.float32))
        return mx.multiply(loss, mx.where(valid, s, mx.array(float("nan"), dtype=mx.float32)))

    def namespace(self, *values: Any) -> MlxNamespace:
        """See :meth:`scaler_core.Backend.namespace`: ``mlx.core``; MLX arrays have no
        device of their own (unified memory), their operations run on the default one."""
        return NAMESPACE

    def non_finite_counts(self, grads: Any) -> list[tuple[str, int, int]]:
        """See :class:`scaler_core.Backend` (``non_finite_counts``): counted in one
        compiled computation, read back at once; not inside ``mx.compile``.

        Raises:
            GradientTypeError: As ``unscale``: a leaf is not an MLX array of an
                accepted dtype; or the leaves are being traced (inside ``mx.compile``
                no count can be read: call this outside, once ``to_bool(found)`` says
                the step was skipped).
        """
        leaves, paths = _validated(grads)
        pairs = first_of_each(zip(paths, leaves, strict=True))
        if not pairs:
            return []
        arrays = [a for _, a in pairs]
        counts = compiled_passes("counts", tuple(a.dtype for a in arrays))(arrays)
        try:
            host = counts.tolist()
        except ValueError as exc:
            raise GradientTypeError(
                f"{pairs[0][0]} is being traced (inside mx.compile), so its NaN and inf cannot "
                f"be counted on the host; call non_finite_leaves outside, for example once "
                f"to_bool(found) says the step was skipped"
            ) from exc
        return [(path, int(n), int(i)) for (path, _), (n, i) in zip(pairs, host, strict=True)]


BACKEND = MlxBackend()
