"""The gradient sets: shapes only, filled with random data (never zeros)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class GradSet:
    """A named list of gradient shapes, one dtype, and what is measured on it.

    ``task`` is ``"unscale"`` (multiply by ``inv_scale`` and detect) or
    ``"detect"`` (detection only).
    """

    name: str
    task: str
    dtype: Any
    shapes: Callable[[bool], list[tuple[int, ...]]]
    note: str


def gpt2_shapes(div: int = 1) -> list[tuple[int, ...]]:
    """The 148 parameter shapes of GPT-2 small (124M), the wide dimensions
    divided by ``div`` (the JAX and MLX benchmarks' small runs)."""
    d, vocab, ctx, layers = 768, 50257, 1024, 12
    shapes: list[tuple[int, ...]] = [(vocab // div, d), (ctx // div, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d // div), (3 * d // div,), (d, d // div), (d,)]
        shapes += [(d,), (d,), (d, 4 * d // div), (4 * d // div,), (4 * d // div, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def gpt2_small_shapes(small: bool) -> list[tuple[int, ...]]:
    """GPT-2 small's 148 parameter shapes (124M values); ``small`` shrinks every dimension."""
    vocab, ctx, d, layers = (50257, 1024, 768, 12) if not small else (1000, 64, 48, 12)
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]  # ln_1, attn
        shapes += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # ln_2, mlp
    shapes += [(d,), (d,)]  # ln_f
    return shapes


SETS: dict[str, GradSet] = {
    s.name: s
    for s in [
        GradSet(
            "2000x1024",
            "unscale",
            np.float32,
            lambda small: [(1024 if not small else 256,)] * (2000 if not small else 200),
            "many small arrays: per-array overhead",
        ),
        GradSet(
            "gpt2-small",
            "unscale",
            np.float32,
            gpt2_small_shapes,
            "GPT-2 small parameter shapes, 148 arrays",
        ),
        GradSet(
            "4x16M",
            "unscale",
            np.float32,
            lambda small: [(16 << 20 if not small else 1 << 16,)] * 4,
            "a few large arrays: memory bandwidth",
        ),
        GradSet("gpt2-small-f16", "detect", np.float16, gpt2_small_shapes, "detect only"),
        GradSet("gpt2-small-bf16", "detect", ml_dtypes.bfloat16, gpt2_small_shapes, "detect only"),
    ]
}


def build(gset: GradSet, *, small: bool, dirty: bool, seed: int = 0) -> list[np.ndarray]:
    """Random normal gradients (no zeros); ``dirty`` puts one inf in the middle one."""
    rng = np.random.default_rng(seed)
    grads = []
    for shape in gset.shapes(small):
        values = rng.standard_normal(shape, dtype=np.float32)
        values[values == 0] = 1.0
        grads.append(values.astype(gset.dtype))
    if dirty:
        middle = grads[len(grads) // 2].reshape(-1)
        middle[middle.size // 2] = np.inf
    return grads
