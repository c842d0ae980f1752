"""One error hierarchy, rooted at :class:`ScalerError`.

Every class also derives from the built-in exception a caller would naturally
catch (``ValueError`` for bad values, ``TypeError`` for bad types, ...), so
``except ValueError`` keeps working for code that does not know this library.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "GradientTypeError",
    "GradientValueError",
    "InvalidConfigError",
    "InvalidGradientError",
    "InvalidStateError",
    "LifecycleError",
    "ReplicaMismatchError",
    "ReplicaTimeoutError",
    "ScaleCollapseError",
    "ScalerError",
    "SkipLimitError",
]


class ScalerError(Exception):
    """Root of every error raised by scaler-core."""


class InvalidConfigError(ScalerError, ValueError):
    """A configuration field is out of range or of the wrong type."""


class InvalidStateError(ScalerError, ValueError):
    """A state or a serialised state (checkpoint) is malformed or out of range."""


class ScaleCollapseError(ScalerError, ArithmeticError):
    """The scaler refused a transition that would leave it unable to train.

    Raised instead of producing a scale of 0, a float32 subnormal or a
    non-finite value, when a backoff is demanded at a floor configured to fail
    closed, and (as :class:`SkipLimitError`) past the consecutive-skip limit.
    The caller's state is never modified when this is raised.
    """


class SkipLimitError(ScaleCollapseError):
    """More consecutive steps were skipped than ``max_consecutive_skips`` allows."""


class LifecycleError(ScalerError, RuntimeError):
    """The step lifecycle was used out of order (for example unscaling twice)."""


class InvalidGradientError(ScalerError):
    """A gradient leaf cannot be unscaled or checked. Base of the two below."""


class GradientTypeError(InvalidGradientError, TypeError):
    """A gradient leaf has an unsupported type or dtype, or libraries are mixed."""


class GradientValueError(InvalidGradientError, ValueError):
    """A gradient leaf has a supported type but cannot be used (e.g. read-only)."""


class BackendUnavailableError(ScalerError, ImportError):
    """The requested backend is unknown, or its array library is not installed."""


class ReplicaMismatchError(ScalerError, RuntimeError):
    """Data-parallel replicas hold different scaler states or parameters.

    Raised on every replica at once by
    :func:`scaler_core.distributed.check_consistent`, so no replica is left
    waiting in a collective. ``groups`` lists the ranks that agree with each
    other (one list per distinct fingerprint); ``differences`` maps each field
    or parameter that differs to ``{rank: value}``.
    """

    def __init__(
        self,
        message: str,
        groups: list[list[int]] | None = None,
        differences: dict[str, dict[int, object]] | None = None,
    ) -> None:
        super().__init__(message)
        self.groups: list[list[int]] = [] if groups is None else groups
        self.differences: dict[str, dict[int, object]] = {} if differences is None else differences


class ReplicaTimeoutError(ScalerError, TimeoutError):
    """Not every replica joined a collective within the ``timeout`` given.

    One replica has stopped: it raised, left its training loop early (uneven
    data shards), or waits in a different collective. The communicator cannot
    be used any more; abort the job (:func:`scaler_core.distributed.abort_on_error`
    does it when this error reaches it).
    """
