"""PaddlePaddle from scaler-core's protocol alone: in place, flags on Paddle's device."""

import paddle

import scaler_core as sc
from scaler_core import backend_kit as kit

HALF, WIDE = (paddle.float16, paddle.bfloat16), (paddle.float32, paddle.float64)


def times(g, factor):  # g * factor in float32 (float64 for float64), rounded to g's dtype
    u = g.astype(w := "float64" if g.dtype == paddle.float64 else "float32") * factor.astype(w)
    if g.dtype == paddle.float16:  # Paddle's CPU cast makes 2**-89 <= |u| < 2**-77 subnormal
        u = u * (u.abs() > 2.0**-25).astype(w)  # where float16 has +-0
    return u.astype(g.dtype)


def where(cond, a, b):  # Paddle's CPU has no 16-bit where: choose the bits, widened
    if a.dtype not in HALF:
        return paddle.where(cond, a, b)
    a16, b16 = (v.view(paddle.int16).astype("int32") for v in (a, b))
    return paddle.where(cond, a16, b16).astype("int16").view(a.dtype)


def full(value, dtype):  # a 0-d tensor made on Paddle's device
    return paddle.full([], value, dtype)


XP = kit.DeviceNamespace(paddle, paddle.Tensor, full=full, floats=HALF + WIDE, where=where)


class PaddleBackend(sc.Backend):
    name, namespace = "paddle", staticmethod(lambda *values: XP)

    def plan(self, grads, *, writable):
        return grads, kit.float_leaves(grads, XP)

    def unscale(self, leaves, scale):  # measure's flag (and one reduction more)
        return self.measure(leaves, scale, write=scale is not None)[:2]

    def measure(self, leaves, scale, *, write):
        inv = None if scale is None else kit.inverse_scale(XP, scale)  # None: detection alone
        us = [g if inv is None else times(g, inv) for g in leaves[1]]
        us = [paddle.assign(u, g) for g, u in zip(leaves[1], us, strict=True)] if write else us
        norm = sum((u.astype("float64").square().sum() for u in us), XP.float64(0.0)).sqrt()
        return leaves[0], self.any(*(~paddle.isfinite(u).all() for u in us)), norm.astype("float32")

    def clip(self, leaves, scale, norm, max_norm, skip):
        inv, coef = kit.inverse_scale(XP, scale), kit.clip_coefficient(XP, norm, max_norm)
        for g in leaves[1]:
            paddle.assign(XP.where(self.any(skip), g, times(times(g, inv), coef)), g)
        return leaves[0]

    def scale_loss(self, loss, scale):
        kit.inverse_scale(XP, scale)  # refuses a bad scale
        wide = loss if loss.dtype in WIDE else loss.astype("float32")
        return wide * XP.asarray(scale, XP.float32).astype(wide.dtype)


sc.register_backend("paddle", PaddleBackend, array_modules=["paddle"])
