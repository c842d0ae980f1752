"""The backend protocol, backends by name, and dispatch from arrays.

A backend provides one array library's fused passes and its array namespace; the
operations on flags are written once, here (the protocol's default methods, over
``scaler_core._ops``), and every operation on gradients in ``scaler_core._ops``.
Backends are looked up by name or from the arrays themselves, through the registry
(``scaler_core._registry``: a leaf's type names its top-level module, which is
necessarily imported already, so dispatch never imports a library the user has not
imported). Backend modules themselves load lazily, on first use.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from . import _deprecated, _ops, _registry
from ._errors import BackendUnavailableError, GradientTypeError, InvalidArgumentError
from ._state import ScalerState

__all__ = [
    "BACKEND_MEMBERS",
    "CORE_MEMBERS",
    "KERNEL_MEMBERS",
    "Backend",
    "available_backends",
    "backend_for",
    "get_backend",
    "missing_members",
    "register_backend",
]


@runtime_checkable
class Backend(Protocol):
    """What every backend provides: its library's fused passes. The docstrings here
    are the contract.

    A backend is a set of kernels, not a set of features: a plan of the validated
    gradients, unscale with detection, a measuring pass that can also write, a clip
    pass that applies the clip coefficient or nothing, ``scale_loss``, and its
    library's array namespace. Every user-level operation (:func:`scaler_core.unscale`,
    ``unscale_and_norm``, ``unscale_and_clip``, ``find_non_finite``,
    :func:`scaler_core.non_finite_leaves`, and the flag operations :meth:`select`,
    :meth:`any`, :meth:`to_bool` and :meth:`update`) is composed from these once, in
    the core (``scaler_core._ops``), for every backend. Derive from ``Backend`` to
    inherit the flag operations.

    Flags ("found" values) are whatever the library keeps on its device: a NumPy
    bool for NumPy, a 0-d boolean array for CuPy, JAX and PyTorch. No method but
    :meth:`to_bool` may synchronise with the host.

    Optional: ``non_finite_counts(grads) -> list[tuple[str, int, int]]``, what
    :func:`scaler_core.non_finite_leaves` reads: each leaf once (at its first path,
    in leaf order, the paths as in the backend's error messages) with its number of
    NaN and of +-inf elements, as Python ints read back to the host. It validates
    the leaves as :meth:`plan` does, read-only arrays accepted, and modifies
    nothing. The report itself is built once, by the core, for every backend.
    """

    #: The name the backend is registered under (``"numpy"``, ``"jax"``...).
    name: str

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A backend class written against the members' old names (``leaves`` and
        ``rescale``, before they were renamed :meth:`plan` and :meth:`clip`) keeps
        working until the next release, with a DeprecationWarning; the old names
        stay callable on every backend class, warning."""
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("_is_protocol", False):
            _deprecated.name_old_members(cls)

    def plan(self, grads: Any, *, writable: bool) -> Any:
        """The plan of ``grads``: its leaves, validated, prepared for the passes below.

        What it returns is the backend's own (a list of arrays, a plan of address
        tables, a flattened pytree): the core only hands it back to :meth:`unscale`,
        :meth:`measure` and :meth:`clip`, which return the gradient tree from it.

        Args:
            grads: A gradient tree (nested dicts, lists, tuples; ``None`` leaves
                skipped; a JAX pytree for JAX).
            writable: Whether a pass will write (a read-only array is refused).

        Raises:
            GradientTypeError: A leaf is not an array of this library, or has an
                integer, bool, complex or object dtype.
            GradientValueError: ``writable`` and a leaf is read-only.
        """
        ...

    def unscale(self, leaves: Any, scale: Any) -> tuple[Any, Any]:
        """Multiply every gradient by ``inv_scale`` and report non-finite values.

        ``inv_scale = f32(1 / f64(scale))`` as PyTorch computes it. float16 and
        bfloat16 gradients are computed in float32 and written back in their own
        dtype; float64 gradients are multiplied in float64. The flag is true if
        any element, as stored after unscaling, is NaN or +-inf. With ``scale``
        ``None`` (and with a scale of 1) nothing is written: detection alone, each
        element read once.

        Args:
            leaves: What :meth:`plan` returned.
            scale: The current scale: a Python float, or a 0-d float32 array of
                this backend's library (a device state's ``scale``); or ``None``.

        Returns:
            ``(grads, found)``: the tree modified in place where the library
            allows it (NumPy, CuPy, PyTorch), a new tree where it does not (JAX), and one
            flag for all gradients.

        Raises:
            GradientValueError: ``scale`` is not a positive normal float32 (a
                device scale is not read back: a bad one fails closed, every
                gradient NaN and the flag set). Before anything is written.
        """
        ...

    def measure(self, leaves: Any, scale: Any, *, write: bool) -> tuple[Any, Any, Any]:
        """The flag and the global L2 norm of the unscaled gradients, in one read.

        The flag is exactly :meth:`unscale`'s. The norm is the square root of the
        sum of squares of every element *as stored after unscaling*, accumulated in
        float64 and rounded once to float32: it equals the exactly rounded norm to
        within one float32 unit in the last place (ulp), and is NaN or inf whenever
        the flag is true (it can also be inf with the flag false, when the norm
        itself passes float32's largest value). It stays on the device (NumPy: a
        ``numpy.float32``; others: a 0-d float32 array).

        With ``write`` the unscaled values are stored too (what :meth:`unscale`
        stores): unscale, detection and norm in one pass. Without it nothing is
        written, except on a backend that has no read-only pass, which may store
        the unscaled values here and say so in its docs (its :meth:`clip` then
        applies the coefficient alone); given a plan made with ``writable=False``,
        it writes nothing whatever it costs (no :meth:`clip` follows those).

        Returns:
            ``(grads, found, norm)``.

        Raises:
            The errors of :meth:`unscale`, before anything is modified.
        """
        ...

    def clip(self, leaves: Any, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        """The clip pass after :meth:`measure` with ``write=False``: one write, or none.

        Unless ``skip`` (a flag, kept on the device) is true, stores, for every
        element ``u`` that :meth:`unscale` would store, ``u * coef`` rounded to the
        element's dtype (float16/bfloat16 computed in float32, float64 in float64),
        where ``coef`` is ``scaler_core._ops.clip_coefficient`` of ``norm`` and
        ``max_norm`` (PyTorch's ``clip_grad_norm_`` coefficient, in float32). With
        ``coef == 1`` that is exactly :meth:`unscale`'s result. On a skipped step
        nothing is written: the gradients keep their scaled values.

        Args:
            leaves: The same :meth:`plan` as the measuring pass had.
            scale: The same scale.
            norm: The norm :meth:`measure` returned.
            max_norm: A positive float, checked by the core.
            skip: The step's decision flag.

        Returns:
            The gradient tree.
        """
        ...

    def scale_loss(self, loss: Any, scale: Any) -> Any:
        """``loss * scale`` (float32 scale), computed on the loss's device."""
        ...

    def namespace(self, *values: Any) -> Any:
        """The array namespace the flag operations and the device transition run on.

        For the device of the first of ``values`` that is this library's array (a
        flag, a state's scale), else the library's default device. The core reads
        these members of it, and nothing else:

        - ``on_host``: ``True`` where flags are host values (NumPy): the core then
          decides on the host, and the transition is the host one, raising on a
          failing step. ``False`` for a device library: nothing is read back.
        - ``is_array(value)``: whether ``value`` is an array of this library.
        - ``flag(value)``: a flag of this library holding the Python bool
          ``value`` (NumPy: a ``numpy.bool_``; a device library: a 0-d boolean
          array made on the device, not copied from the host).
        - ``read(flag)``: the flag as a Python bool, the host synchronisation
          (raising :class:`GradientTypeError` where no value can be read, as
          inside ``jax.jit``).
        - ``logical_or(a, b)``: the flag ``a or b``. ``where(cond, a, b)``: ``a``
          where the flag ``cond`` is true, else ``b`` (arrays, ``float32(x)``
          values or Python numbers), the chosen bits, NaN payloads included.
        - ``map_pairs(fn, on_skip, on_step)``: calls ``fn(path, a, b)`` for each
          pair of leaves (``path`` a str naming the leaf, ``a`` from ``on_skip``,
          ``b`` from ``on_step``) and returns a tree of ``on_step``'s structure
          holding the results, raising :class:`InvalidArgumentError` where the
          trees differ (``scaler_core._tree.map_pairs`` does this for nested
          containers).
        - For the device transition and the clip coefficient: ``asarray(value,
          dtype=None)``, an array of the library with ``.shape`` and ``.dtype``
          (a 0-d one holding a Python number or bool rounded to ``dtype``: one of
          ``float32``, ``float64``, ``int32`` or Python's ``bool``; of one of its
          arrays, one of the same shape and dtype); the dtypes ``float32`` and
          ``float64``, also called as ``float32(x)`` to make a 0-d value, and
          ``int32``; ``isfinite`` (false for NaN and +-inf), ``maximum`` and
          ``minimum``; ``isdtype(dtype, kind)``, the Array API's, for the kinds
          ``"bool"`` (is this a flag) and ``"real floating"`` (is this a norm), so
          the core never reads a dtype's name; and ``float64_missing``: ``None``
          where float64 is exact, else how to enable it (JAX without x64), so
          factors that are not float32 values are refused.

        The arrays are computed with by operators (``+ - * /``, comparisons, and
        ``& | ~`` on booleans) and a device state is read back with ``float()``
        and ``int()`` of its 0-d fields. ``scaler_core.testing.NAMESPACE_DUTIES``
        lists these duties member by member, and ``check_backend`` holds a
        namespace to them.
        """
        ...

    # Written once, in the core, for every backend: a class that derives from
    # Backend inherits these four; the docstrings are the contract.
    def select(self, found: Any, on_skip: Any, on_step: Any) -> Any:
        """``on_skip`` where ``found`` is true, else ``on_step``, leaf by leaf.

        Used to keep parameters and optimizer state bit-identical on a skipped
        step: compute the updated trees, then select. Both trees must have the
        same structure. A host library decides on the host and copies nothing; a
        device library selects on the device, with no host synchronisation.

        Raises:
            GradientTypeError: ``found`` is not a flag.
            InvalidArgumentError: The trees differ in structure, or a pair of
                leaves differs in shape or dtype.
        """
        return _ops.select(self, found, on_skip, on_step)

    def any(self, *flags: Any) -> Any:
        """The logical OR of several flags (several groups, micro-batches), kept
        on the first device flag's device; ``flag(False)`` for none."""
        return _ops.any_found(self, *flags)

    def to_bool(self, found: Any) -> bool:
        """The flag as a Python bool: the one deliberate host synchronisation."""
        return _ops.to_bool(self, found)

    def update(self, state: ScalerState, found: Any, grad_norm: Any = None) -> ScalerState:
        """One transition of ``state`` (see :func:`scaler_core.update`).

        Host libraries raise on a failing step; device libraries record the
        failure in the state without a host synchronisation. ``grad_norm`` is
        the step's global gradient norm (a number, or a 0-d float array of this
        library), for spike skipping.

        Raises:
            InvalidStateError: ``state`` is not a ScalerState.
            GradientTypeError: ``found`` is not a flag.
            InvalidConfigError: A factor is not exactly a float32 and the
                namespace has no exact float64.
        """
        return _ops.update(self, state, found, grad_norm)


#: The members every backend has: the protocol's methods and its ``name``.
BACKEND_MEMBERS: tuple[str, ...] = tuple(
    sorted(
        {*Backend.__annotations__}
        | {n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_")}
    )
)


#: The members written once, in the core, over the others: a class that derives from
#: :class:`Backend` inherits them, and no built-in backend overrides them.
CORE_MEMBERS: tuple[str, ...] = ("any", "select", "to_bool", "update")

#: What a backend writes itself: its passes, ``scale_loss`` and its namespace.
KERNEL_MEMBERS: tuple[str, ...] = tuple(m for m in BACKEND_MEMBERS if m not in CORE_MEMBERS)


def missing_members(obj: object) -> list[str]:
    """The :data:`BACKEND_MEMBERS` that ``obj`` lacks, alike on every Python version.

    A member counts where ``isinstance(obj, Backend)`` finds it from Python 3.12 on:
    on the object's class or in its instance ``__dict__``, never through
    ``__getattr__`` (which Python 3.11's check followed). Every check of
    scaler-core's uses this, never ``isinstance`` with the protocol, so a backend
    is accepted or refused the same on every version ``requires-python`` allows.

    >>> missing_members(get_backend("numpy")), missing_members(object())[:2]
    ([], ['any', 'clip'])
    """
    missing = []
    for member in BACKEND_MEMBERS:
        try:
            value = inspect.getattr_static(obj, member)
        except AttributeError:
            missing.append(member)
            continue
        if value is None and member != "name":  # None on a class: "not implemented"
            missing.append(member)
    return missing


def register_backend(
    name: str,
    loader: Callable[[], Backend],
    *,
    array_modules: Iterable[str] = (),
    replace: bool = False,
) -> None:
    """Register a backend so it can be found by name and from its arrays.

    Third-party array libraries plug in here without editing scaler-core. A library
    whose arrays carry the Array API standard's ``__array_namespace__`` needs no
    registration: the ``array_api`` backend serves it; register one to replace it.

    Args:
        name: The backend's name, as passed to ``get_backend`` or ``backend=``.
        loader: Called once, on first use, to build the backend. Import the
            array library inside it, not at registration.
        array_modules: Top-level module names whose array types this backend
            owns (``type(x).__module__`` up to the first dot).
        replace: Allow replacing an existing registration.

    Raises:
        InvalidArgumentError: ``name`` is not a non-empty str, ``name`` is taken
            (and ``replace`` is false), a module name is not a top-level name, or a
            module is already owned by another backend.

    >>> register_backend("mylib", lambda: get_backend("numpy"), array_modules=["mylib"])
    >>> get_backend("mylib").name
    'numpy'
    """
    _registry.register(name, loader, array_modules=array_modules, replace=replace)
    forget_dispatch()  # a remembered dispatch may now belong to another backend


def get_backend(name: str | Backend = _registry.DEFAULT) -> Backend:
    """The backend registered as ``name`` (a :class:`Backend` passes through).

    Raises:
        BackendUnavailableError: ``name`` is unknown, or its library is not
            installed (the message says what to install).
        InvalidArgumentError: ``name`` is neither a str nor a Backend.
    """
    loaded = _registry.LOADED.get(name) if isinstance(name, str) else None
    if loaded is not None:  # the common case, first
        return loaded  # type: ignore[no-any-return]
    if not isinstance(name, str):
        missing = missing_members(name)
        if missing:  # a backend written against the old member names, until they go
            _deprecated.adopt_old_members(name, missing)
            missing = missing_members(name)
        if not missing:
            return name
        lacks = (
            ""
            if len(missing) == len(BACKEND_MEMBERS)
            else f" (it lacks {missing}: define them on its class; members served by "
            f"__getattr__ do not count)"
        )
        raise InvalidArgumentError(
            f"backend={name!r}, but it must be a backend name {_registry.registered()!r} or "
            f"a Backend{lacks}"
        )
    backend = _registry.load(name)  # once per name: later calls find it loaded, above
    missing = missing_members(backend)
    if missing:  # a backend written against the old member names, until they go
        _deprecated.adopt_old_members(backend, missing)
    return backend  # type: ignore[no-any-return]


def available_backends() -> list[str]:
    """Names of the registered backends that load on this machine."""
    out = []
    for name in _registry.registered():
        try:
            get_backend(name)
        except BackendUnavailableError:
            continue
        out.append(name)
    return out


def backend_for(*trees: Any, default: str = _registry.DEFAULT, root: str = "grads") -> Backend:
    """The backend that owns every leaf of ``trees``.

    Trees with no leaves at all get ``default``. ``root`` names a single tree in
    the messages (``"loss"`` for a loss); several trees are ``trees[i]``.

    Raises:
        GradientTypeError: A leaf belongs to no registered backend, or leaves
            come from two array libraries.
    """
    if len(trees) == 1:
        known = _same_flat_container(trees[0])
        if known is None:
            known = _flat_container_backend(trees[0])
        if known is not None:
            return known
    found: _registry.Claim | None = None
    first_path = ""
    claim = _registry.claim
    for i, tree in enumerate(trees):
        root = root if len(trees) == 1 else f"trees[{i}]"
        for path, leaf in _registry.dispatch_leaves(tree, root):
            owner = claim(leaf)
            if owner is None:
                raise GradientTypeError(
                    f"{path} is a {type(leaf).__module__}.{type(leaf).__qualname__}, which no "
                    f"backend handles; pass arrays of a supported library "
                    f"{_registry.registered()!r} (or arrays with __array_namespace__), or "
                    f"register a backend for it"
                )
            if owner is found:  # the same type as the first leaf's, most often
                continue
            if found is None:
                found, first_path = owner, path
            elif owner.library != found.library:
                raise GradientTypeError(
                    f"{path} is a {owner.library} array but {first_path} is a {found.library} "
                    f"array; one call takes arrays of one library: convert them, or make one "
                    f"call per library"
                )
    return get_backend(default if found is None else found.backend)


#: The fewest elements whose array's truth is ambiguous (``bool`` raises).
_AMBIGUOUS = 2
#: An array's element count, read in C.
_SIZE = operator.attrgetter("size")
#: The last flat list, tuple or dict of host arrays dispatched: its kind, a list of its
#: arrays, and its backend. A loop that hands the same arrays every step finds its
#: backend in one C-level comparison.
_LAST_FLAT: list[tuple[type, list[Any], Backend] | None] = [None]


def _flat_children(tree: Any) -> list[Any] | None:
    """The children of a flat list, tuple or dict (a dict's values), as a new list."""
    kind = type(tree)
    if kind is dict:
        return list(tree.values())
    if kind is list or kind is tuple:
        return list(tree)
    return None


def _flat_container_backend(tree: Any) -> Backend | None:
    """The backend of a flat list, tuple or dict of arrays of one library, found from the
    distinct types of its children (one claim per type, not per array), and remembered;
    ``None`` for anything else (a nested tree, ``None`` children, an unclaimed value),
    which the walk then dispatches leaf by leaf, and words any error."""
    children = _flat_children(tree)
    if not children:
        return None
    kinds = set(map(type, children))
    if len(kinds) == 1:
        samples = [children[0]]
    else:  # a few kinds: one child of each
        samples = [next(c for c in children if type(c) is kind) for kind in kinds]
    owners = [_registry.claim(sample) for sample in samples]
    claims = [o for o in owners if o is not None]
    if len(claims) != len(owners) or len({o.library for o in claims}) != 1:
        return None
    backend = get_backend(claims[0].backend)
    _remember_flat_container(tree, children, all(o.host for o in claims), backend)
    return backend


def _same_flat_container(tree: Any) -> Backend | None:
    """The backend of ``tree`` when it is a list, tuple or dict holding the very arrays
    of the last one remembered, in order, else ``None``.

    Only host arrays (NumPy's) are remembered, and compared with ``==`` of two lists,
    which compares identity first: a differing pair (each of two elements or more, as
    remembered) compares by value, which raises (an array's truth is ambiguous) or
    answers False, a miss."""
    last = _LAST_FLAT[0]
    if last is None or type(tree) is not last[0]:
        return None
    children = _flat_children(tree)
    if children is None or len(children) != len(last[1]):
        return None
    try:
        same = bool(last[1] == children)
    except Exception:  # an array's ambiguous truth: not the same arrays
        return None
    return last[2] if same else None


def _remember_flat_container(tree: Any, children: list[Any], host: bool, backend: Backend) -> None:
    """Remember ``tree``'s ``children`` (arrays of one library) for
    :func:`_same_flat_container` when they are host arrays of two elements or more
    each: only then does ``==`` tell them from others. A device library's arrays are
    not remembered: holding them would keep a step's gradients alive on the device
    until the next call (and ``==`` on a JAX tracer would be an operation of its
    trace); their types find their backend at each call."""
    smallest = 0
    if host:
        try:
            smallest = min(map(_SIZE, children))
        except (AttributeError, TypeError):  # a host array type without a size
            smallest = 0
    _LAST_FLAT[0] = (type(tree), children, backend) if smallest >= _AMBIGUOUS else None


def forget_dispatch() -> None:
    """Forget the remembered flat container (and with it the references to its arrays):
    what ``register_backend`` and a backend's ``clear_cache`` do."""
    _LAST_FLAT[0] = None


def resolve_backend(backend: str | Backend | None, *trees: Any) -> Backend:
    """``backend`` by name, or the one the trees' arrays belong to."""
    return backend_for(*trees) if backend is None else get_backend(backend)
