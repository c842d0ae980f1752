"""scaler-core: a framework-agnostic dynamic loss scaler for mixed precision.

The pure core (config, state, transition, serialisation) imports no array
library; backends for NumPy (default), CuPy and JAX load lazily.

>>> import numpy as np
>>> import scaler_core as sc
>>> state = sc.init()
>>> grads = [np.array([65536.0], np.float32)]
>>> grads, found = sc.unscale(grads, state)
>>> state = sc.update(state, found)
>>> grads[0].tolist(), state.steps
([1.0], 1)
"""

from ._api import find_non_finite, unscale, update
from ._backend import Backend, available_backends, backend_for, get_backend, register_backend
from ._config import ScalerConfig
from ._errors import (
    BackendUnavailableError,
    GradientTypeError,
    GradientValueError,
    InvalidConfigError,
    InvalidGradientError,
    InvalidStateError,
    LifecycleError,
    ReplicaMismatchError,
    ReplicaTimeoutError,
    ScaleCollapseError,
    ScalerError,
    SkipLimitError,
)
from ._lifecycle import GradScaler
from ._presets import PRESETS, PresetInfo, preset
from ._serialize import from_dict, from_torch_state_dict, to_dict, to_torch_state_dict
from ._state import Failure, ScalerState, StepKind, classify, device_update, init

__version__ = "0.1.0"

__all__ = [  # noqa: RUF022 - plain sorted(), which tests/test_public_api.py checks
    "Backend",
    "BackendUnavailableError",
    "Failure",
    "GradScaler",
    "GradientTypeError",
    "GradientValueError",
    "InvalidConfigError",
    "InvalidGradientError",
    "InvalidStateError",
    "LifecycleError",
    "PRESETS",
    "PresetInfo",
    "ReplicaMismatchError",
    "ReplicaTimeoutError",
    "ScaleCollapseError",
    "ScalerConfig",
    "ScalerError",
    "ScalerState",
    "SkipLimitError",
    "StepKind",
    "available_backends",
    "backend_for",
    "classify",
    "device_update",
    "find_non_finite",
    "from_dict",
    "from_torch_state_dict",
    "get_backend",
    "init",
    "preset",
    "register_backend",
    "to_dict",
    "to_torch_state_dict",
    "unscale",
    "update",
]
