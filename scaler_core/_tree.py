"""Walking nested gradient containers without any array library.

Containers are dicts (and other mappings), lists, tuples and NamedTuples, to
any depth; ``None`` leaves are skipped (a frozen layer has no gradient).
Everything else is a leaf. JAX pytrees go through ``jax.tree_util`` in the JAX
backend instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ._errors import GradientValueError, InvalidArgumentError

__all__ = ["first_of_each", "leaves_with_paths", "map_pairs"]


def leaves_with_paths(tree: Any, root: str = "grads") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every non-``None`` leaf, in a stable order.

    The path reads like the Python expression that reaches the leaf, so error
    messages can name it.

    >>> list(leaves_with_paths({"w": [1, None, 2]}))
    [("grads['w'][0]", 1), ("grads['w'][2]", 2)]

    Raises:
        GradientValueError: A container holds itself (a cycle).
    """
    stack: list[tuple[str, Any]] = [(root, tree)]
    open_containers: set[int] = set()
    while stack:
        path, node = stack.pop()
        if node is None:
            continue
        if isinstance(node, (Mapping, list, tuple)):
            if id(node) in open_containers:
                raise GradientValueError(
                    f"{path} is a container that also appears elsewhere in the tree (a cycle or a "
                    f"shared container); pass each gradient container once"
                )
            open_containers.add(id(node))
        if isinstance(node, Mapping):
            children = [(f"{path}[{key!r}]", value) for key, value in node.items()]
        elif isinstance(node, (list, tuple)):
            fields = getattr(node, "_fields", None)
            if isinstance(node, tuple) and fields is not None:
                children = [
                    (f"{path}.{name}", value) for name, value in zip(fields, node, strict=True)
                ]
            else:
                children = [(f"{path}[{i}]", value) for i, value in enumerate(node)]
        else:
            yield path, node
            continue
        stack.extend(reversed(children))


def first_of_each(pairs: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Each leaf once (by identity), at its first path, in order: an array that appears
    at several paths is read, unscaled, counted and reported once.

    >>> a, b = [1.0], [2.0]
    >>> first_of_each([("x", a), ("y", b), ("z", a)])
    [('x', [1.0]), ('y', [2.0])]
    """
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for path, leaf in pairs:
        if id(leaf) not in seen:
            seen.add(id(leaf))
            out.append((path, leaf))
    return out


def _structure_error(path: str, skip: str, step: str) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{path} is {step} in on_step but {skip} in on_skip; select() needs two trees of the "
        f"same structure (the old values and the updated ones)"
    )


def _describe(node: Any) -> str:
    if node is None:
        return "None"
    if isinstance(node, Mapping):
        return f"a {type(node).__name__} with keys {list(node.keys())!r}"
    if isinstance(node, (list, tuple)):
        return f"a {type(node).__name__} of {len(node)}"
    return "a leaf"


def map_pairs(
    fn: Callable[[str, Any, Any], Any], on_skip: Any, on_step: Any, root: str = "on_step"
) -> Any:
    """A tree of ``on_step``'s structure whose leaves are ``fn(path, skip_leaf, step_leaf)``.

    The two trees must have the same structure: the same container types, the
    same keys in the same order, the same lengths, ``None`` at the same places.

    Raises:
        InvalidArgumentError: They differ; the message names the first place.

    >>> map_pairs(lambda path, a, b: a + b, {"w": [1, None]}, {"w": [10, None]})
    {'w': [11, None]}
    """

    def walk(path: str, a: Any, b: Any) -> Any:
        if a is None or b is None:
            if a is not b:
                raise _structure_error(path, _describe(a), _describe(b))
            return None
        if isinstance(b, Mapping):
            if not isinstance(a, Mapping) or list(a.keys()) != list(b.keys()):
                raise _structure_error(path, _describe(a), _describe(b))
            return type(b)({k: walk(f"{path}[{k!r}]", a[k], b[k]) for k in b})  # type: ignore[call-arg]
        if isinstance(b, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                raise _structure_error(path, _describe(a), _describe(b))
            fields = getattr(b, "_fields", None)
            names = [f".{n}" for n in fields] if fields else [f"[{i}]" for i in range(len(b))]
            items = [walk(path + n, x, y) for n, x, y in zip(names, a, b, strict=True)]
            return type(b)(*items) if fields else type(b)(items)
        if isinstance(a, (Mapping, list, tuple)):
            raise _structure_error(path, _describe(a), _describe(b))
        return fn(path, a, b)

    return walk(root, on_skip, on_step)
