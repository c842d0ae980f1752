"""One error hierarchy, rooted at :class:`ScalerError`.

Every class also derives from the built-in exception a caller would naturally
catch (``ValueError`` for bad values, ``TypeError`` for bad types, ...), so
``except ValueError`` keeps working for code that does not know this library.
"""

from __future__ import annotations

__all__ = [
    "BackendContractError",
    "BackendUnavailableError",
    "GradientTypeError",
    "GradientValueError",
    "InvalidArgumentError",
    "InvalidConfigError",
    "InvalidGradientError",
    "InvalidStateError",
    "LifecycleError",
    "MissingDependencyError",
    "PolicyViolationError",
    "ReplicaMismatchError",
    "ReplicaTimeoutError",
    "ScaleCollapseError",
    "ScalerError",
    "SkipLimitError",
    "TraceError",
]


class ScalerError(Exception):
    """Root of every error raised by scaler-core."""


class InvalidConfigError(ScalerError, ValueError):
    """A configuration field is out of range or of the wrong type."""


class InvalidStateError(ScalerError, ValueError):
    """A state or a serialised state (checkpoint) is malformed or out of range."""


class InvalidArgumentError(ScalerError, ValueError, TypeError):
    """An argument that is not a config, a state or a gradient is wrong.

    A communicator without the methods needed, an ``axis_name`` of ``None``, a
    policy that is not callable, a backend name already taken, trees of
    different structures passed to ``select``, a bad command-line setting. Both
    a ``ValueError`` and a ``TypeError``, so either ``except`` catches it.
    """


class TraceError(ScalerError, ValueError):
    """A trace for :mod:`scaler_core.simulate` is missing, malformed or empty."""


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


class MissingDependencyError(ScalerError, ImportError):
    """An optional package that a feature needs is not installed.

    The message names the package and the extra that installs it.
    """


class BackendUnavailableError(MissingDependencyError):
    """The requested backend is unknown, or its array library is not installed."""


class PolicyViolationError(ScalerError, AssertionError):
    """A scale policy broke a property checked by :func:`scaler_core.testing.check_policy`."""


class BackendContractError(ScalerError, AssertionError):
    """A backend broke the Backend contract (:func:`scaler_core.testing.check_backend`)."""


class ReplicaMismatchError(ScalerError, RuntimeError):
    """Data-parallel replicas hold different scaler states or parameters.

    Raised on every replica at once by
    :func:`scaler_core.mpi.check_consistent`, so no replica is left
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
    be used any more; abort the job (:func:`scaler_core.mpi.abort_on_error`
    does it when this error reaches it).
    """
