"""Walking nested gradient containers without any array library.

Containers are dicts (and other mappings), lists, tuples and NamedTuples, to
any depth; ``None`` leaves are skipped (a frozen layer has no gradient).
Everything else is a leaf. JAX pytrees go through ``jax.tree_util`` in the JAX
backend instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ._errors import GradientValueError

__all__ = ["leaves_with_paths"]


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
