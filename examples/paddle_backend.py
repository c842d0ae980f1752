"""A PaddlePaddle backend from scaler-core's public protocol alone, in place: flags are 0-d
bool tensors made on Paddle's current device, and only ``read`` syncs with the host."""

from types import SimpleNamespace
from typing import Any

import paddle
from paddle import Tensor

import scaler_core as sc
from scaler_core.backend_kit import clip_coefficient, inverse_scale, leaves_with_paths, map_pairs

HALF, WIDE = (paddle.float16, paddle.bfloat16), (paddle.float32, paddle.float64)
KINDS = {"bool": (paddle.bool,), "real floating": HALF + WIDE}


class DType(str):  # a dtype name Paddle takes, called as float32(x) for a 0-d value
    def __call__(self, x: Any) -> Tensor:
        return paddle.full([], x, dtype=str(self))


def times(g: Tensor, factor: Tensor) -> Tensor:
    """``g * factor`` in float32 (float64 for float64), rounded to g's dtype."""
    u = g.astype(w := "float64" if g.dtype == paddle.float64 else "float32") * factor.astype(w)
    if g.dtype == paddle.float16:  # Paddle's CPU cast gives 2**-89 <= |u| < 2**-77 subnormals
        u = u * (u.abs() > 2.0**-25).astype(w)  # where float16 has +-0
    return u.astype(g.dtype)


def asarray(value: Any, dtype: Any = None) -> Tensor:  # numbers filled in on the device
    if isinstance(value, Tensor):
        return value if dtype is None else value.astype(dtype)
    return paddle.full([], value, dtype)


def where(cond: Tensor, a: Any, b: Any) -> Tensor:  # a number takes the other's dtype
    like = b if isinstance(b, Tensor) else a
    a, b = (v if isinstance(v, Tensor) else paddle.full([], v, like.dtype) for v in (a, b))
    if like.dtype not in HALF:
        return paddle.where(cond, a, b)
    # Paddle's CPU where has no 16-bit kernel: choose the bits, widened to int32
    a, b = (v.view(paddle.int16).astype("int32") for v in (a, b))
    return paddle.where(cond, a, b).astype("int16").view(like.dtype)


XP = SimpleNamespace(on_host=False, float64_missing=None, map_pairs=map_pairs, where=where)
XP.asarray, XP.float32, XP.float64, XP.int32 = asarray, *map(DType, ("float32", "float64", "int32"))
XP.isfinite, XP.maximum, XP.minimum = paddle.isfinite, paddle.maximum, paddle.minimum
XP.logical_or, XP.flag = paddle.logical_or, lambda value: paddle.full([], value, dtype=bool)
XP.is_array, XP.read = lambda value: isinstance(value, Tensor), lambda flag: bool(flag.item())
XP.isdtype = lambda dtype, kind: dtype in KINDS[kind]


class PaddleBackend(sc.Backend):
    name, namespace = "paddle", staticmethod(lambda *values: XP)

    def leaves(self, grads: Any, *, writable: bool) -> tuple[Any, list[Tensor]]:
        for path, g in (pairs := list(leaves_with_paths(grads))):
            if not (isinstance(g, Tensor) and g.dtype in KINDS["real floating"]):
                what = getattr(g, "dtype", type(g))
                raise sc.GradientTypeError(f"{path} is {what}; pass a float paddle.Tensor")
        return grads, list({id(g): g for _, g in pairs}.values())  # each tensor once

    def unscale(self, leaves: Any, scale: Any) -> tuple[Any, Tensor]:  # (and one reduction more)
        return self.measure(leaves, scale, write=scale is not None)[:2]

    def measure(self, leaves: Any, scale: Any, *, write: bool) -> tuple[Any, Tensor, Tensor]:
        inv = None if scale is None else inverse_scale(XP, scale)  # None: detection alone
        us = leaves[1] if inv is None else [times(g, inv) for g in leaves[1]]
        us = [paddle.assign(u, g) for g, u in zip(leaves[1], us, strict=True)] if write else us
        norm = sum((u.astype("float64").square().sum() for u in us), XP.float64(0.0)).sqrt()
        return leaves[0], self.any(*(~paddle.isfinite(u).all() for u in us)), norm.astype("float32")

    def rescale(self, leaves: Any, scale: Any, norm: Any, max_norm: float, skip: Any) -> Any:
        inv, coef = inverse_scale(XP, scale), clip_coefficient(XP, norm, max_norm)
        for g in leaves[1]:
            paddle.assign(where(self.any(skip), g, times(times(g, inv), coef)), g)
        return leaves[0]

    def scale_loss(self, loss: Tensor, scale: Any) -> Tensor:
        inverse_scale(XP, scale)  # refuses a bad scale
        wide = loss if loss.dtype in WIDE else loss.astype("float32")
        return wide * asarray(scale, XP.float32).astype(wide.dtype)


sc.register_backend("paddle", PaddleBackend, array_modules=["paddle"])
