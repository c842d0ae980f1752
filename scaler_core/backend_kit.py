"""What a backend author calls: the core's own tree walk, inverse scale and clip coefficient.

A backend (see :class:`scaler_core.Backend` and ``docs/reference.md``) writes its
library's passes; the rules those passes share are written once, in the core, and
served here, so a backend restates none of them and cannot drift from the others:

- :func:`leaves_with_paths`: each leaf of a gradient tree (nested dicts, lists,
  tuples and NamedTuples; ``None`` skipped) with the path messages name it by;
- :func:`map_pairs`: two trees paired leaf by leaf, what a namespace's
  ``map_pairs`` is for nested containers;
- :func:`inverse_scale`: ``f32(1 / f64(scale))`` on the backend's namespace, a host
  scale checked, a device scale failing closed (NaN) where it is not a positive
  normal float32;
- :func:`clip_coefficient`: PyTorch's ``clip_grad_norm_`` coefficient, clamped at 1,
  computed in the norm's library on its device.

>>> import numpy as np
>>> from scaler_core import get_backend
>>> xp = get_backend("numpy").namespace()
>>> [path for path, _ in leaves_with_paths({"w": np.ones(2), "b": [None, np.ones(1)]})]
["grads['w']", "grads['b'][1]"]
>>> float(inverse_scale(xp, 1024.0)), float(clip_coefficient(xp, np.float32(0.5), 1.0))
(0.0009765625, 1.0)
"""

from __future__ import annotations

from ._ops import clip_coefficient, inverse_scale
from ._tree import leaves_with_paths, map_pairs

__all__ = ["clip_coefficient", "inverse_scale", "leaves_with_paths", "map_pairs"]
