"""scaler-core: a framework-agnostic dynamic loss scaler for mixed precision.

The pure core (config, state, transition, serialisation) imports no array
library; backends for NumPy (default), CuPy, JAX, PyTorch, MLX and any Array API
library load lazily. :class:`LossScaler` is the step-lifecycle facade for any of
them, and ``scaler_core.torch.GradScaler`` is a drop-in for ``torch.amp.GradScaler``.

>>> import numpy as np
>>> import scaler_core as sc
>>> state = sc.init()
>>> grads = [np.array([65536.0], np.float32)]
>>> grads, found = sc.unscale(grads, state)
>>> state = sc.update(state, found)
>>> grads[0].tolist(), state.steps
([1.0], 1)
"""

import os as _os
from typing import TYPE_CHECKING as _TYPE_CHECKING

# A source checkout keeps the backends beside this package, in backends/; the wheel
# installs them inside it, as scaler_core/backends/. Run from a checkout (no
# backends/ here, a sibling backends/ holding _common.py), that folder is loaded as
# scaler_core.backends, so a checkout imports exactly what the wheel holds.
_HERE = _os.path.dirname(__file__)
_CHECKOUT_BACKENDS = _os.path.join(_os.path.dirname(_HERE), "backends")
if not _os.path.isdir(_os.path.join(_HERE, "backends")) and _os.path.isfile(
    _os.path.join(_CHECKOUT_BACKENDS, "_common.py")
):
    import importlib.util as _util
    import sys as _sys

    _spec = _util.spec_from_file_location(
        f"{__name__}.backends",
        _os.path.join(_CHECKOUT_BACKENDS, "__init__.py"),
        submodule_search_locations=[_CHECKOUT_BACKENDS],
    )
    if _spec is not None and _spec.loader is not None:
        # Bound as an attribute too, as an import of the submodule would bind it.
        _sys.modules[_spec.name] = backends = _util.module_from_spec(_spec)
        _spec.loader.exec_module(backends)
    del _spec, _sys, _util
del _HERE, _CHECKOUT_BACKENDS, _os

from ._api import (  # noqa: E402
    find_non_finite,
    unscale,
    unscale_and_clip,
    unscale_and_norm,
    update,
)
from ._backend import (  # noqa: E402
    Backend,
    available_backends,
    backend_for,
    get_backend,
    register_backend,
)
from ._config import ScalerConfig  # noqa: E402
from ._errors import (  # noqa: E402
    BackendContractError,
    BackendUnavailableError,
    GradientTypeError,
    GradientValueError,
    InvalidArgumentError,
    InvalidConfigError,
    InvalidGradientError,
    InvalidStateError,
    LifecycleError,
    MissingDependencyError,
    PolicyViolationError,
    ReplicaMismatchError,
    ReplicaTimeoutError,
    ScaleCollapseError,
    ScalerError,
    SkipLimitError,
    TraceError,
)
from ._lifecycle import LossScaler, StepPhase, StepReport  # noqa: E402
from ._presets import PRESETS, PresetInfo, preset  # noqa: E402
from ._report import LeafReport, non_finite_leaves  # noqa: E402
from ._serialize import (  # noqa: E402
    from_dict,
    to_dict,
)
from ._state import (  # noqa: E402
    Failure,
    ScalerState,
    StepKind,
    classify,
    device_update,
    init,
    step_skipped,
)

#: The one place the version is written (pyproject.toml reads it from here).
__version__ = "0.1.0"

__all__ = [  # noqa: RUF022 - plain sorted(), which tests/core/test_public_api.py checks
    "Backend",
    "BackendContractError",
    "BackendUnavailableError",
    "Failure",
    "GradientTypeError",
    "GradientValueError",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvalidGradientError",
    "InvalidStateError",
    "LeafReport",
    "LifecycleError",
    "LossScaler",
    "MissingDependencyError",
    "PRESETS",
    "PolicyViolationError",
    "PresetInfo",
    "ReplicaMismatchError",
    "ReplicaTimeoutError",
    "ScaleCollapseError",
    "ScalerConfig",
    "ScalerError",
    "ScalerState",
    "SkipLimitError",
    "StepKind",
    "StepPhase",
    "StepReport",
    "TraceError",
    "available_backends",
    "backend_for",
    "classify",
    "device_update",
    "find_non_finite",
    "from_dict",
    "get_backend",
    "init",
    "non_finite_leaves",
    "preset",
    "register_backend",
    "step_skipped",
    "to_dict",
    "unscale",
    "unscale_and_clip",
    "unscale_and_norm",
    "update",
]

if not _TYPE_CHECKING:  # the old names, served (warning) as the new until the next release
    from . import _deprecated

    __getattr__ = _deprecated.module_getattr(__name__, {"GradScaler": "LossScaler"})
